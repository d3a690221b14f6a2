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

    python benchmarks/kv_eviction.py --ppl-curve 20480 --out docs/results/kv_eviction_curve.json

scores the built-in held-out text teacher-forced in chunks of 32 tokens, one sequence of that
many tokens, with the full cache (up to SmolLM2's 8,192 positions), StreamingLLM (4 sink tokens,
a 1,024-token window) and the window alone, checks the streaming request's blocks after every
chunk, and plots the negative log-likelihood per 1,024 tokens (kv_eviction_curve.png).
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
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine, load_model
from kvserve.model.llama import apply_rope, rope_at, rope_inv_freq
from kvserve.model.loader import ModelConfig
from kvserve.quant.evaluate import chunk_logprobs

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


def nll_curve(engine: LLMEngine, tokens: list[int], chunk: int, bound: int | None) -> list[float]:
    """Negative log-likelihood of each next token, teacher-forced chunk by chunk through the
    engine as ``kvserve eval`` scores (evicting before each chunk when it streams); ``bound``: the
    most blocks the request may hold, checked after every chunk."""
    from tqdm import tqdm

    nll: list[float] = []
    for start, logprobs in tqdm(chunk_logprobs(engine, tokens, chunk), total=-(-len(tokens) // chunk),
                                desc=engine.config.kv_eviction, unit="chunk", mininterval=10):
        if bound is not None:
            assert len(engine.kv_manager.block_tables["eval"][0]) <= bound, "the streaming request outgrew its bound"
        targets = torch.tensor(tokens[start + 1 : start + 1 + len(logprobs)])
        nll += (-logprobs[: len(targets)].float().gather(1, targets[:, None])[:, 0]).tolist()
    return nll


def ppl_curve(num_tokens: int, out: Path | None, chunk: int = 32, window: int = 1024) -> None:
    from kvserve.quant.data import read_samples, token_stream

    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    tokens = token_stream(read_samples("builtin:python-reference"), lambda text: list(tokenizer.encode(text)),
                          lambda messages: list(tokenizer.apply_chat_template(messages, tokenize=True)), num_tokens)
    limit = loaded.config.max_position_embeddings
    curves: dict[str, list[float]] = {}
    for name, kwargs, length in (
            ("full cache", {}, min(num_tokens, limit)),
            (f"streaming (4 sinks + {window})", {"kv_eviction": "streaming", "kv_window": window}, num_tokens),
            (f"window {window} alone", {"kv_eviction": "streaming", "kv_window": window, "kv_sink_tokens": 0},
             num_tokens)):
        engine = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", kv_cache_memory="2GiB",
                                        enable_prefix_caching=False, max_num_batched_tokens=chunk, **kwargs),
                           loaded=loaded)
        bound = engine.streaming.blocks_held(16, chunk) if engine.streaming is not None else None
        curves[name] = nll_curve(engine, tokens[:length], chunk, bound)
    bucket = 1024
    table = {name: [sum(c[i : i + bucket]) / len(c[i : i + bucket]) for i in range(0, len(c), bucket)]
             for name, c in curves.items()}
    for name, values in table.items():
        print(f"{name:28s} " + " ".join(f"{v:.2f}" for v in values))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_name(), "chunk": chunk, "window": window, "bucket": bucket,
                                   "model_positions": limit, "mean_nll_per_bucket": table}, indent=1))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for name, values in table.items():
            ax.plot([bucket * (i + 0.5) for i in range(len(values))], values, marker="o", label=name)
        ax.axvline(limit, color="grey", linestyle=":", label=f"SmolLM2's {limit} positions")
        ax.set_xlabel("token position")
        ax.set_ylabel(f"mean NLL per {bucket} tokens")
        ax.set_title("SmolLM2-135M, teacher-forced held-out text")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize="small")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--ppl-curve", type=int, default=0, metavar="TOKENS",
                        help="only score one sequence of this many held-out tokens (see the module docstring)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.ppl_curve:
        ppl_curve(args.ppl_curve, args.out)
        return
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
