"""``--quantization int8`` (W8A8 linear layers) against the bf16 (or ``--dtype float32``) model.

    python benchmarks/int8_weights.py --out docs/results/int8_weights_<machine>.json

Both models are loaded and served by an engine each (2 threads, 2 GiB KV, 64 sequences, 2,048
batched tokens), and measured in turn within every round, so that drift in the machine's speed
falls on both alike: the median decode step (ms) at ``--batches`` running sequences of
``--context`` prompt tokens, then one run of the uniform workload (32 requests, 128 prompt + 128
output tokens, as benchmarks/throughput.py). Each figure is the median over ``--rounds``; the
uniform ratio also per round (both engines measured within a minute of each other), with its
range and median: on a machine whose speed drifts, the paired figure.
Quality is measured apart, with ``kvserve eval --dtype bfloat16 [--quantization int8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kv_quant_throughput import decode_steps
from workloads import WORKLOADS, cpu_name

from kvserve import LLM, SamplingParams
from kvserve.engine.loading import load_model


def uniform_seconds(llm: LLM) -> float:
    work = WORKLOADS["uniform"]()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == work.output_tokens
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="32,64")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the model dtype of both variants (float32 where bf16 is emulated: no AVX-512)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    variants: dict[str, str | None] = {"bf16" if dtype == torch.bfloat16 else "fp32": None, "int8": "int8"}
    engines, weight_bytes = {}, {}
    for name, quantization in variants.items():
        loaded = load_model("smollm2-135m", torch.device("cpu"), dtype, quantization)
        engines[name] = LLM(loaded=loaded, quantization=quantization, kv_cache_memory="2GiB", max_num_seqs=64,
                            max_num_batched_tokens=2048, max_model_len=2048, enable_prefix_caching=False)
        weight_bytes[name] = loaded.weight_bytes
        print(f"{name}: weights {loaded.weight_bytes / 2**20:.1f} MiB", flush=True)
        uniform_seconds(engines[name])  # warm-up: kernels built, pool pages touched
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            run = {f"step_ms_b{b}": decode_steps(llm, b, args.context, args.steps)["step_ms"] for b in batches}
            run["uniform_s"] = uniform_seconds(llm)
            runs[name].append(run)
            print(name, {k: round(v, 2) for k, v in run.items()}, flush=True)
    output_tokens = WORKLOADS["uniform"]().output_tokens
    rows: list[dict[str, Any]] = []
    for name in variants:
        keys = runs[name][0].keys()
        row: dict[str, Any] = {"weights": name, "weight_bytes": weight_bytes[name],
                               **{k: statistics.median(r[k] for r in runs[name]) for k in keys}}
        row["uniform_tok_s"] = output_tokens / row["uniform_s"]
        row["rounds"] = runs[name]
        rows.append(row)
    base = rows[0]
    for r in rows:  # the paired statistic: each round's ratio, both engines measured within a minute
        r["uniform_round_ratios"] = [b["uniform_s"] / o["uniform_s"]
                                     for b, o in zip(base["rounds"], r["rounds"], strict=True)]
    print("\n| weights | " + " | ".join(f"decode step, batch {b} (ms)" for b in batches)
          + " | uniform tok/s | uniform, rounds' ratios (median) |")
    print("|---|" + "---|" * (len(batches) + 2))
    for r in rows:
        steps = " | ".join(f"{r[f'step_ms_b{b}']:.1f} ({base[f'step_ms_b{b}'] / r[f'step_ms_b{b}']:.2f}x)"
                           for b in batches)
        ratios = r["uniform_round_ratios"]
        print(f"| {r['weights']} | {steps} | {r['uniform_tok_s']:.0f} "
              f"({r['uniform_tok_s'] / base['uniform_tok_s']:.2f}x) | {min(ratios):.2f}-{max(ratios):.2f} "
              f"({statistics.median(ratios):.2f}x) |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "args": {k: str(v) for k, v in vars(args).items()},
                                        "results": rows}, indent=1))


if __name__ == "__main__":
    main()
