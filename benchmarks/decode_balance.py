"""Decode attention over sequences of unequal length: how the threads share a step.

    python benchmarks/decode_balance.py --out docs/results/decode_balance.json \\
        [--baseline ~/.cache/torch_extensions/py311_cpu/<an older build>/<its name>.so]

A decode step's attention over cold pools of the default model's shape, for batches whose
lengths are drawn from the long-context workload's prompt range (2,000-6,000 tokens), in the
order drawn and sorted (longest last, as when older sequences have decoded more). With
``--baseline``, another build of the C++ ops (an older commit's, built by running it once) is
loaded into the same process and the two alternate round by round, so that this machine's drift
falls on both alike; each cell is the median of the rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_bandwidth import attention_layers
from workloads import cpu_name

from kvserve.model.cpu_kernels import cpu_kernels


def load_build(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-dtypes", default="bf16,int4")
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=6, help="pools per step (together larger than the LLC)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", type=Path, default=None, help="another build's .so to alternate with")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    builds = {"this": cpu_kernels()}
    if builds["this"] is None:
        raise SystemExit("the C++ ops are not available here")
    if args.baseline is not None:
        builds["baseline"] = load_build(args.baseline)
    rows = []
    print(f"| batch | order | KV dtype | {' | '.join(f'{b} ms / layer' for b in builds)} |")
    print("|---|---|---|" + "---|" * len(builds))
    for batch in (int(b) for b in args.batches.split(",")):
        drawn = [random.Random(batch).randrange(2000, 6000) for _ in range(batch)]
        for order, lens in (("as drawn", drawn), ("sorted", sorted(drawn))):
            for kv_dtype in args.kv_dtypes.split(","):
                steps = {}
                for name, ops in builds.items():
                    torch.manual_seed(batch)  # the same pools and block tables for every build
                    steps[name] = attention_layers(kv_dtype, args.block_size, lens, args.layers, ops=ops)[0]
                times: dict[str, list[float]] = {name: [] for name in builds}
                for _ in range(args.rounds):
                    for name, layer in steps.items():
                        layer(0)
                        start = time.perf_counter()
                        for i in range(args.layers):
                            layer(i)
                        times[name].append((time.perf_counter() - start) / args.layers * 1e3)
                row = {"batch": batch, "order": order, "kv_dtype": kv_dtype,
                       **{f"ms_{name}": statistics.median(t) for name, t in times.items()},
                       **{f"rounds_{name}": t for name, t in times.items()}}
                rows.append(row)
                print(f"| {batch} | {order} | {kv_dtype} | "
                      + " | ".join(f"{row[f'ms_{name}']:.3f}" for name in builds) + " |", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "block_size": args.block_size,
                                        "baseline": str(args.baseline), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
