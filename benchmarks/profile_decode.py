"""Profile decode steps at batch 32 (uniform workload, context ~130-160 tokens): where the time goes.

    python benchmarks/profile_decode.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from workloads import uniform

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m", torch.device("cpu"), getattr(torch, args.dtype))
    engine = LLM(loaded=loaded, kv_cache_memory="2GiB", max_model_len=2048).engine
    work = uniform()
    for prompt, n in zip(work.prompts, work.output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    engine.step()
    engine.step()  # the 4096 prompt tokens, in two 2048-token steps
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step = (time.perf_counter() - start) / args.steps
    print(f"{args.dtype}: decode step at batch 32: {1000 * step:.1f} ms = {32 / step:.0f} tok/s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
