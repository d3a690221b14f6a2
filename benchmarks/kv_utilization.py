"""KV memory utilization of the paged pool vs contiguous max-length preallocation.

Runs the mixed workload (64 requests, prompts 16..1024, outputs 16..256) through the engine at
several block sizes under one fixed KV budget, and records after every step the live tokens,
the allocated slots and the running sequences. The contiguous baseline is computed from the
same trace: each running sequence would hold max_model_len slots.

    python benchmarks/kv_utilization.py --out docs/results/kv_utilization.json --plot docs/kv_utilization.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workloads import mixed

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import load_model


def run(loaded: Any, block_size: int, budget: str, max_model_len: int) -> dict[str, Any]:
    work = mixed()
    llm = LLM(loaded=loaded, block_size=block_size, kv_cache_memory=budget, max_num_seqs=64,
              max_model_len=max_model_len)
    engine = llm.engine
    for prompt, n in zip(work.prompts, work.output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    live_sum = alloc_sum = contiguous_sum = 0
    max_running = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.kv_stats()
        running = stats.num_requests
        max_running = max(max_running, running)
        if running:
            live_sum += stats.live_tokens
            alloc_sum += stats.allocated_slots
            contiguous_sum += running * max_model_len
    stats = engine.kv_stats()
    capacity = engine.kv_manager.capacity_tokens
    return {
        "block_size": block_size,
        "capacity_tokens": capacity,
        "peak_utilization": stats.utilization_at_peak,
        "mean_utilization": live_sum / alloc_sum,
        "peak_usage": stats.peak_usage,
        "max_concurrent_seqs": max_running,
        "preemptions": stats.num_preemptions,
        "contiguous_mean_utilization": live_sum / contiguous_sum,
        "contiguous_max_concurrent_seqs": capacity // max_model_len,
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [str(r["block_size"]) for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(sizes, [100 * r["peak_utilization"] for r in results], label="paged, at peak usage")
    ax1.plot(sizes, [100 * r["mean_utilization"] for r in results], "ko-", label="paged, mean over steps")
    ax1.axhline(100 * results[0]["contiguous_mean_utilization"], color="r", ls="--",
                label="contiguous max-length prealloc")
    ax1.set_xlabel("block size (tokens)")
    ax1.set_ylabel("utilization = live / allocated (%)")
    ax1.set_ylim(0, 105)
    ax1.legend(loc="lower left", fontsize=8)
    ax2.bar(sizes, [r["max_concurrent_seqs"] for r in results], label="paged")
    ax2.axhline(results[0]["contiguous_max_concurrent_seqs"], color="r", ls="--", label="contiguous")
    ax2.set_xlabel("block size (tokens)")
    ax2.set_ylabel("max concurrent sequences")
    ax2.legend(fontsize=8)
    fig.suptitle("Mixed workload (64 req, prompts 16-1024, outputs 16-256), same KV budget")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-sizes", default="8,16,32,64,128")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--max-model-len", type=int, default=1280, help="longest request of the workload")
    parser.add_argument("--dtype", default="bfloat16", help="utilization does not depend on it; bf16 is faster")
    parser.add_argument("--out", default="docs/results/kv_utilization.json")
    parser.add_argument("--plot", default="docs/kv_utilization.png")
    parser.add_argument("--plot-only", action="store_true", help="re-draw the plot from --out")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text())["results"], Path(args.plot))
        return
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m", torch.device("cpu"), getattr(torch, args.dtype))
    results = []
    for size in (int(s) for s in args.block_sizes.split(",")):
        r = run(loaded, size, args.kv_cache_memory, args.max_model_len)
        results.append(r)
        print(json.dumps(r), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"kv_cache_memory": args.kv_cache_memory, "dtype": args.dtype,
                                          "max_model_len": args.max_model_len, "results": results}, indent=1))
    plot(results, Path(args.plot))


if __name__ == "__main__":
    main()
