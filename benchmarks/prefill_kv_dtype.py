"""Prefill over each KV dtype's pool: where a prompt-heavy workload's time goes (issue 19, target 3).

    python benchmarks/prefill_kv_dtype.py --kv-cache-dtype auto,int8,auto,int8 \\
        --kv-scales docs/results/smollm2_kv_scales.json

One engine per entry (bf16 model, 2 threads, 1 GiB of KV, prefix caching off, 2,048 batched
tokens): ``--batch`` prompts of ``--context`` random tokens prefilled to their first token under
torch's profiler; prints the wall time and the ops that took the most CPU time (attention kernels,
linear layers, the K/V write). Repeat a dtype in the list to see the machine's spread.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from kv_quant_throughput import workload
from workloads import top_ops

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="auto,int8")
    parser.add_argument("--kv-scales", default=None, help="calibration file (static int8 key scales)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m", torch.device("cpu"), torch.bfloat16)
    for kv_dtype in args.kv_cache_dtype.split(","):
        extra = {"kv_scales": args.kv_scales} if args.kv_scales and kv_dtype == "int8" else {}
        engine = LLM(loaded=loaded, kv_cache_dtype=kv_dtype, kv_cache_memory="1GiB", enable_prefix_caching=False,
                     max_num_seqs=args.batch, max_num_batched_tokens=2048, **extra).engine
        for prompt in workload(3, args.batch, args.context):
            engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            while engine.requests:
                engine.step()
            wall = time.perf_counter() - start
        print(f"{kv_dtype}: prefill {args.batch} x {args.context} in {wall:.1f} s; {top_ops(prof)}", flush=True)
        del engine


if __name__ == "__main__":
    main()
