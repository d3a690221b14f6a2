"""Where a decode step's time goes, and what the fused paged kernel saves over the gather path.

    python benchmarks/profile_decode.py --dtype bfloat16                # batch 32, uniform workload, op table
    python benchmarks/profile_decode.py --dtype bfloat16 --workload mixed [--gather]
        # the whole mixed workload step by step: prefill vs decode time; --gather forces the
        # gather + batched-matmul decode path instead of the fused C++ kernel
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from workloads import WORKLOADS

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workload", default="uniform", choices=list(WORKLOADS))
    parser.add_argument("--gather", action="store_true", help="decode through gather + matmul, not the kernel")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m", torch.device("cpu"), getattr(torch, args.dtype))
    engine = LLM(loaded=loaded, kv_cache_memory="6GiB", max_model_len=2048).engine
    if args.gather:
        engine.runner.decode_kernel = False
    work = WORKLOADS[args.workload]()
    for prompt, n in zip(work.prompts, work.output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    path = "gather + matmul" if args.gather else "fused kernel"
    if args.workload == "mixed":
        prefill, decode = [], []
        while engine.has_unfinished_requests():
            # judged before the step: a step that finishes the last prompt chunk is a prefill step
            has_prefill = bool(engine.scheduler.waiting) or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
            start = time.perf_counter()
            engine.step()
            (prefill if has_prefill else decode).append((time.perf_counter() - start, engine.num_running))
        busiest = max(decode, key=lambda s: s[1])
        print(f"{args.dtype}, {path}: {sum(s[0] for s in prefill):.1f} s in {len(prefill)} steps with prefill, "
              f"{sum(s[0] for s in decode):.1f} s in {len(decode)} decode-only steps "
              f"(mean {1000 * statistics.mean(s[0] for s in decode):.0f} ms; first decode-only step: "
              f"{1000 * decode[0][0]:.0f} ms at {decode[0][1]} sequences; busiest: {busiest[1]} sequences)")
        return
    for _ in range(5):
        engine.step()  # the prompts (two 2048-token steps) and a few decodes
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step = (time.perf_counter() - start) / args.steps
    print(f"{args.dtype}, {path}: decode step at batch 32: {1000 * step:.1f} ms = {32 / step:.0f} tok/s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
