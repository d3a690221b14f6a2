"""MLA's KV cache: bytes per token against the same model's K and V expanded, and decode step
time with weight absorption against up-projecting every cached token.

    python benchmarks/mla.py --out docs/results/mla.json

1. Bytes: `kvserve plan`'s arithmetic for DeepSeek-V2 (236B), DeepSeek-V2-Lite and
   DeepSeek-V3 presets: the latent vector (kv_lora_rank + qk_rope_head_dim) against the K/V
   the heads would cache without it (heads x (qk_nope + qk_rope) for K, heads x v_head_dim for
   V), and the engine's own pool for a random-weight checkpoint of DeepSeek-V2-Lite's
   attention shape (the pool is sized by the same formula; this checks it allocates it).
2. Decode: that checkpoint (DeepSeek-V2-Lite's attention: 16 heads, kv_lora_rank 512,
   rope 64, nope 128, v 128; 4 dense layers, random weights, made with transformers' own
   DeepseekV2 classes) decoding a batch of sequences at a given context, fp32 on CPU: the mean
   step time with absorption and without, same engine, same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.deepseek import MLAAttention
from kvserve.plan.presets import preset
from kvserve.plan.spec import ModelSpec

LITE_ATTENTION = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
                  "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def expanded_elements(spec: ModelSpec, nope: int, v_dim: int) -> int:
    """K and V elements per token per layer without the latent: every head's key and value."""
    return spec.num_heads * (nope + spec.qk_rope_head_dim) + spec.num_heads * v_dim


def make_checkpoint(dest: Path, layers: int) -> Path:
    import transformers

    if (dest / "config.json").exists():
        return dest
    config = transformers.DeepseekV2Config(vocab_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                                           n_routed_experts=1, first_k_dense_replace=layers,
                                           max_position_embeddings=8192, **LITE_ATTENTION)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(dest))
    return dest


def decode_steps(path: Path, absorb: bool, batch: int, context: int, steps: int) -> dict[str, Any]:
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="4GiB", max_num_batched_tokens=context,
              max_num_seqs=batch, enable_prefix_caching=False)
    for layer in llm.engine.model.decoder_layers:
        assert isinstance(layer.self_attn, MLAAttention)
        layer.self_attn.absorb = absorb
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        llm.engine.add_request([(i * 7 + j) % 1000 + 3 for j in range(context)], params)
    while any(r.num_computed_tokens < r.num_tokens - 1 or not r.output_token_ids
              for r in llm.engine.requests.values()):
        llm.engine.step()  # prefill (and the first token)
    times = []
    while llm.engine.has_unfinished_requests():
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    return {"absorb": absorb, "batch": batch, "context": context, "steps": len(times),
            "mean_step_ms": 1000 * statistics.mean(times), "median_step_ms": 1000 * statistics.median(times),
            "kv_block_bytes": llm.engine.kv_block_bytes, "block_size": llm.engine.config.cache_config.block_size}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("docs/results/mla.json"))
    parser.add_argument("--folder", type=Path, default=Path("/tmp/kvserve-mla-lite-attention"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(2)
    result: dict[str, Any] = {"bytes": [], "decode": []}
    for name, nope, v_dim in (("deepseek-v2", 128, 128), ("deepseek-v2-lite", 128, 128), ("deepseek-v3", 128, 128)):
        spec = preset(name)
        latent = spec.kv_layout.elements
        expanded = expanded_elements(spec, nope, v_dim)
        row = {"model": name, "latent_elements": latent, "expanded_elements": expanded, "ratio": expanded / latent,
               "bf16_bytes_per_token": 2 * latent * spec.num_layers,
               "bf16_expanded_bytes_per_token": 2 * expanded * spec.num_layers}
        result["bytes"].append(row)
        print(f"{name}: {latent} latent elements vs {expanded} expanded per token per layer: "
              f"{row['ratio']:.1f}x smaller ({row['bf16_bytes_per_token'] / 1024:.1f} KiB vs "
              f"{row['bf16_expanded_bytes_per_token'] / 1024:.1f} KiB per token in bf16)", flush=True)
    path = make_checkpoint(args.folder, args.layers)
    for context in map(int, args.contexts.split(",")):
        for absorb in (True, False):
            row = decode_steps(path, absorb, args.batch, context, args.steps)
            result["decode"].append(row)
            print(f"context {context}, batch {args.batch}, absorb={absorb}: {row['mean_step_ms']:.1f} ms per "
                  f"decode step ({row['kv_block_bytes'] // row['block_size']} B of KV per token)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
