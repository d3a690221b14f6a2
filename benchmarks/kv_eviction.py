"""KV eviction: what keeping StreamingLLM's positions right costs, three ways, on SmolLM2's shapes.

    python benchmarks/kv_eviction.py --out docs/results/kv_eviction.json

StreamingLLM puts every cached token at its position within the cache. When a block is evicted
the tokens after it move bs positions earlier, and keys are cached after RoPE, so either
- **window**: re-rotate every cached key of the window by -bs at each eviction (in place);
- **read**: store keys before RoPE and rotate the whole window at every attention read;
- **sinks** (kvserve's): keep queries and window keys at their absolute positions (RoPE scores
  depend only on q - k, so their distances are already the cache's) and turn only the sink
  keys by the evicted count, from their keys as first written.
Per decode step (bf16, 30 layers, 3 KV heads of 64, block size 16, 4 sink tokens): the time each
way adds, amortized over the bs steps between evictions, and the error that in-place
re-rotation accumulates in bf16 keys over the W / bs evictions a key lives through.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workloads import cpu_name

from kvserve.cache.kv_cache import PagedKVCache
from kvserve.model.llama import apply_rope, rope_at, rope_inv_freq
from kvserve.model.loader import ModelConfig

LAYERS, KV_HEADS, HEAD_DIM, BLOCK, SINK_BLOCKS = 30, 3, 64, 16, 1


def timed(fn: Any, repeats: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def costs(window: int, inv_freq: torch.Tensor) -> dict[str, float]:
    """Milliseconds per decode step each way adds at this window."""
    blocks = window // BLOCK + SINK_BLOCKS + 1
    cache = PagedKVCache(LAYERS, blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cpu"))
    for layer in cache.storage:
        layer.data.normal_()
    window_ids = list(range(1 + SINK_BLOCKS, blocks + 1))
    sink_ids = list(range(1, 1 + SINK_BLOCKS))
    cos, sin = rope_at(torch.tensor([-BLOCK]), inv_freq)
    originals = cache.read_keys(sink_ids)
    turn_cos, turn_sin = rope_at(torch.tensor([4096]), inv_freq)

    def rerotate_window() -> None:
        cache.write_keys(window_ids, [apply_rope(k.float(), cos[0], sin[0]) for k in cache.read_keys(window_ids)])

    def turn_sinks() -> None:
        cache.write_keys(sink_ids, [apply_rope(k.float(), turn_cos[0], turn_sin[0]) for k in originals])

    positions = torch.arange(window)
    read_cos, read_sin = rope_at(positions, inv_freq)
    read_cos, read_sin = read_cos.to(torch.bfloat16)[:, None], read_sin.to(torch.bfloat16)[:, None]
    raw = [torch.randn(window, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]

    def rotate_at_read() -> None:  # every layer's window, every step (the torch path's cost)
        for keys in raw:
            apply_rope(keys, read_cos, read_sin)

    return {"window_per_eviction_ms": 1000 * timed(rerotate_window),
            "window_per_step_ms": 1000 * timed(rerotate_window) / BLOCK,
            "read_per_step_ms": 1000 * timed(rotate_at_read),
            "sinks_per_eviction_ms": 1000 * timed(turn_sinks),
            "sinks_per_step_ms": 1000 * timed(turn_sinks) / BLOCK}


def accumulated_error(window: int, inv_freq: torch.Tensor) -> dict[str, float]:
    """Relative error of bf16 keys turned by -bs once per eviction over a window's lifetime,
    against one turn by the total (what turning from the original keys gives)."""
    torch.manual_seed(0)
    keys = torch.randn(4096, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    steps = window // BLOCK
    cos, sin = rope_at(torch.tensor([-BLOCK]), inv_freq)
    stepwise = keys
    for _ in range(steps):
        stepwise = apply_rope(stepwise.float(), cos[0], sin[0]).to(torch.bfloat16)
    cos_all, sin_all = rope_at(torch.tensor([-BLOCK * steps]), inv_freq)
    exact = apply_rope(keys.float(), cos_all[0], sin_all[0])
    once = exact.to(torch.bfloat16)
    norm = exact.norm(dim=-1)
    return {"evictions": steps,
            "stepwise_rel_error": float(((stepwise.float() - exact).norm(dim=-1) / norm).mean()),
            "once_rel_error": float(((once.float() - exact).norm(dim=-1) / norm).mean())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=LAYERS, num_heads=9, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
    inv_freq = rope_inv_freq(config)
    rows = []
    for window in args.windows:
        row = {"window": window, **costs(window, inv_freq), **accumulated_error(window, inv_freq)}
        rows.append(row)
        print(f"W={window:5d}: re-rotate window {row['window_per_eviction_ms']:.3f} ms/eviction "
              f"({row['window_per_step_ms']:.3f} ms/step), rotate at read {row['read_per_step_ms']:.3f} ms/step, "
              f"turn sinks {row['sinks_per_eviction_ms']:.3f} ms/eviction ({row['sinks_per_step_ms']:.4f} ms/step); "
              f"bf16 error after {row['evictions']} in-place turns {100 * row['stepwise_rel_error']:.2f}% "
              f"vs one turn {100 * row['once_rel_error']:.2f}%", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
