"""What each ISA level of the C++ ops gives on this CPU: the uniform workload (32 requests, 128
prompt + 128 output tokens, as benchmarks/throughput.py) served at every level this CPU runs.

    python benchmarks/isa_levels.py --variants float32,int8 --native --out docs/results/isa_levels.json

Every (level, variant) engine is loaded first, then each round runs all of them in turn, so that
drift in the machine's speed falls on all alike; each figure is the median over ``--rounds``,
with its ratio to the best level's. ``--native`` adds a build of the same sources with
-march=native (what the ops were built with before there were levels): the check that the
levels' explicit flags lose nothing on this CPU. Variants: float32, bfloat16 (model dtypes), int8
(``--quantization int8`` on the bf16 model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from int8_weights import uniform_seconds
from workloads import cpu_name

from kvserve import LLM
from kvserve.engine.loading import load_model
from kvserve.model.cpu_build import IsaLevel
from kvserve.model.cpu_kernels import cpu_flags, runnable_levels, use_isa

# -march=native builds for the CPU at hand: its flags go into the build's name (through a define),
# so a cache that outlives this CPU never hands the build to another
NATIVE = IsaLevel("native", ("-march=native", "-DKVSERVE_NATIVE_FOR=" + hashlib.sha256(
    " ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]), cpu_flags())
VARIANTS = {"float32": (torch.float32, None), "bfloat16": (torch.bfloat16, None), "int8": (torch.bfloat16, "int8")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="float32,int8", help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--native", action="store_true", help="add a -march=native build of the same sources")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    levels = [*runnable_levels(), *([NATIVE] if args.native else [])]
    engines: dict[tuple[str, str], tuple[IsaLevel, LLM]] = {}
    for isa in levels:
        for variant in args.variants.split(","):
            dtype, quantization = VARIANTS[variant]
            with use_isa(isa):  # the model's layers pick their ops (packed weights) at load
                loaded = load_model("smollm2-135m", torch.device("cpu"), dtype, quantization)
                llm = LLM(loaded=loaded, quantization=quantization, kv_cache_memory="2GiB", max_num_seqs=64,
                          max_num_batched_tokens=2048)
                uniform_seconds(llm)  # warm-up
            engines[(isa.name, variant)] = (isa, llm)
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
    for round_ in range(args.rounds):
        for key, (isa, llm) in engines.items():
            with use_isa(isa):
                seconds[key].append(uniform_seconds(llm))
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    best = runnable_levels()[-1].name
    rows = []
    print(f"\n{cpu_name()}, 2 threads, uniform workload (32 x 128 + 128), median of {args.rounds} rounds\n")
    print("| level | variant | output tok/s | runs (s) | vs " + best + " |")
    print("|---|---|---|---|---|")
    for (name, variant), runs in seconds.items():
        median = statistics.median(runs)
        ratio = statistics.median(seconds[(best, variant)]) / median
        row = {"level": name, "variant": variant, "tok_s": 32 * 128 / median, "seconds": runs, f"vs_{best}": ratio}
        rows.append(row)
        print(f"| {name} | {variant} | {row['tok_s']:.1f} | {', '.join(f'{s:.2f}' for s in runs)} | {ratio:.2f}x |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "threads": 2, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
