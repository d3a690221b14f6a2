"""The linear layers of a step: kvserve's bf16 GEMM against oneDNN's, on the default model's shapes.

    python benchmarks/linear_gemm.py --out docs/results/linear_gemm.json

For each batch size (rows), one step's linear layers — 30 layers x (qkv 576→960, o 576→576,
gate_up 576→3,072, down 1,536→576), each layer its own weights, so they come from memory as in
the engine — and the LM head (576→49,152) alone, with the weights packed for oneDNN
(``torch.ops.mkldnn._linear_pointwise``, what PackedLinear used before) and for kvserve's
``bf16_linear`` (what it uses on CPUs with AVX512-BF16 and no AMX). The two alternate round by
round in one process; each cell is the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workloads import cpu_name

from kvserve.model.cpu_kernels import cpu_op

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of one decoder layer
LM_HEAD = (576, 49152)
LAYERS = 30


def both_packings(k: int, n: int) -> tuple[Callable[[torch.Tensor], object], Callable[[torch.Tensor], object]]:
    """(oneDNN, kvserve) calls of one random bf16 weight [n, k]."""
    weight = torch.randn(n, k).to(torch.bfloat16) / k**0.5
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    (ours,) = cpu_op("bf16_gemm_pack")(weight)
    linear = cpu_op("bf16_linear")
    return (lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
            lambda x: linear(x, ours, n, None, False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,256,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pack = cpu_op("bf16_gemm_pack")
    if pack is None or not pack(torch.zeros(16, 2, dtype=torch.bfloat16)):
        raise SystemExit("no bf16_linear in this build (no AVX512-BF16, or an AMX CPU, where oneDNN is used)")
    layers = [[both_packings(k, n) for k, n in LAYER_SHAPES] for _ in range(LAYERS)]
    head = both_packings(*LM_HEAD)
    rows_out = []
    print("| rows | part | oneDNN ms | kvserve ms | kvserve / oneDNN | kvserve GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = [torch.randn(rows, k).to(torch.bfloat16) for k, _ in LAYER_SHAPES]
        head_input = torch.randn(rows, LM_HEAD[0]).to(torch.bfloat16)
        parts = {
            "30 decoder layers": (lambda which, inputs=inputs: [fns[which](x) for layer in layers
                                                                for fns, x in zip(layer, inputs, strict=True)],
                                  LAYERS * sum(2 * rows * k * n for k, n in LAYER_SHAPES)),
            "LM head": (lambda which, x=head_input: head[which](x), 2 * rows * LM_HEAD[0] * LM_HEAD[1]),
        }
        for part, (run, flops) in parts.items():
            times: list[list[float]] = [[], []]
            run(0), run(1)
            for _ in range(args.rounds):
                for which in (0, 1):
                    start = time.perf_counter()
                    run(which)
                    times[which].append(time.perf_counter() - start)
            onednn, ours = (statistics.median(t) for t in times)
            rows_out.append({"rows": rows, "part": part, "onednn_ms": 1e3 * onednn, "kvserve_ms": 1e3 * ours,
                             "kvserve_gflops": flops / ours / 1e9, "onednn_gflops": flops / onednn / 1e9})
            print(f"| {rows} | {part} | {1e3 * onednn:.2f} | {1e3 * ours:.2f} | {ours / onednn:.2f}x | "
                  f"{flops / ours / 1e9:.0f} |", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
