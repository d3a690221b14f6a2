"""The decode step per KV dtype at long context and high concurrency.

    python benchmarks/decode_step.py --kv-scales docs/results/smollm2_kv_scales.json \\
        --out docs/results/decode_step_<machine>.json [--block-size 64] [--fill random] [--dtype float32]

One engine per KV dtype (bf16 model unless ``--dtype``, 2 threads, prefix caching off, memory for
every sequence): ``--batch`` sequences of ``--context`` random prompt tokens are prefilled in every
engine first (``--fill random``: their K/V written at random through each pool's own write path
instead of computed, random_kv_prefill; the decode steps then run the model);
then, ``--rounds`` times, each engine in turn (the order rotated each round) takes the median wall
time of ``--steps`` decode steps and, over a few more steps under torch's profiler, the time
spent in the attention kernels, so the rest of the step (linear layers, norms, sampling) shows
beside it. All engines stay alive, so a round's dtypes run seconds apart: drift in the machine
(this VM's memory bandwidth moves by ~20% over minutes) falls on all of them alike. Each dtype
reports its median over the rounds, and its ratio to the first dtype as the median of the
rounds' ratios. A dtype named with ``/4k`` or ``/2m`` (``bf16/2m``) is the same engine with its pools
on 4 KB or 2 MB pages (``KVSERVE_HUGE_PAGES`` 0 or 1 while it is built).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kv_quant_throughput import start_decoding, time_decode_steps
from workloads import cpu_name, page_choice

from kvserve import LLM
from kvserve.engine.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="auto,fp8_e4m3,int8,int4")
    parser.add_argument("--kv-scales", default=None, help="calibration file (static int8 key scales)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the model's dtype")
    parser.add_argument("--fill", default="prefill", choices=["prefill", "random"],
                        help="prefill: the prompts' K/V computed by the model; random: written at random")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m", torch.device("cpu"), getattr(torch, args.dtype))
    dtypes = args.kv_cache_dtype.split(",")
    runs: dict[str, list[dict[str, float]]] = {d: [] for d in dtypes}
    profiled = 3
    engines: dict[str, LLM] = {}
    decode = args.rounds * (args.steps + profiled)
    stored_dtypes = {page_choice(d)[0] for d in dtypes}
    widest = 2 if args.dtype == "float32" and ({"auto", "fp32"} & stored_dtypes) else 1  # 32-bit KV: twice 16-bit's
    memory = widest * 5 * 23040 * args.batch * (args.context + decode + 64) // 4  # 16-bit KV for all, + 25%
    for kv_dtype in dtypes:  # every engine prefilled before any step is timed
        stored, huge = page_choice(kv_dtype)
        kwargs: dict[str, Any] = {"kv_scales": args.kv_scales} if args.kv_scales and stored == "int8" else {}
        pages = {} if huge is None else {"KVSERVE_HUGE_PAGES": "1" if huge else "0"}
        with mock.patch.dict(os.environ, pages):  # read as the pools are allocated
            engines[kv_dtype] = LLM(loaded=loaded, kv_cache_dtype=stored, kv_cache_memory=memory,
                                    enable_prefix_caching=False, max_num_seqs=args.batch,
                                    max_num_batched_tokens=2048, block_size=args.block_size, **kwargs)
        start_decoding(engines[kv_dtype], args.batch, args.context, decode, random_kv=args.fill == "random")
        print(f"{kv_dtype}: {args.batch} x {args.context} prefilled", flush=True)
    for round_index in range(args.rounds):
        for kv_dtype in dtypes[round_index % len(dtypes):] + dtypes[: round_index % len(dtypes)]:
            runs[kv_dtype].append(time_decode_steps(engines[kv_dtype], args.steps, profiled))
            print(round_index, kv_dtype, runs[kv_dtype][-1], flush=True)
    rows = []
    for kv_dtype in dtypes:
        step = statistics.median(r["step_ms"] for r in runs[kv_dtype])
        attention = statistics.median(r["attention_ms"] for r in runs[kv_dtype])
        ratios = [r["step_ms"] / b["step_ms"] for r, b in zip(runs[kv_dtype], runs[dtypes[0]], strict=True)]
        rows.append({"kv_cache_dtype": kv_dtype, "kv_bytes_per_token": engines[kv_dtype].engine.kv_bytes_per_token,
                     "step_ms": step, "attention_ms": attention, "ratio": statistics.median(ratios),
                     "round_ratios": ratios, "rounds": runs[kv_dtype]})
    base = rows[0]
    print(f"\n| KV dtype | B/token | step (ms) | vs {base['kv_cache_dtype']} (rounds) | attention (ms) | rest (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        each = " / ".join(f"{x:.2f}" for x in r["round_ratios"])
        print(f"| {r['kv_cache_dtype']} | {r['kv_bytes_per_token']} | {r['step_ms']:.1f} | "
              f"{r['ratio']:.2f}x ({each}) | {r['attention_ms']:.1f} | {r['step_ms'] - r['attention_ms']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_name(), "args": {k: str(v) for k, v in vars(args).items()},
                                        "results": rows}, indent=1))


if __name__ == "__main__":
    main()
