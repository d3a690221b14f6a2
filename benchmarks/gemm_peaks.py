"""The linear layers' GEMMs against this CPU's dot-product peaks: bf16 (vdpbf16ps) and int8 (vpdpbusd).

    python benchmarks/gemm_peaks.py --out docs/results/gemm_peaks.json

First the peaks: a loop of independent dot-product instructions on each thread (12 accumulators,
no memory traffic), compiled here with g++ -march=native and called through ctypes — the most
either instruction can do on this machine. Then one decode step's linear layers (30 layers x
qkv 576→960, o 576→576, gate_up 576→3,072, down 1,536→576, each layer its own weights) at each
row count, as the bf16 model runs them (``PackedLinear``: kvserve's bf16 GEMM) and as
``--quantization int8`` runs them (``Int8Linear``: activations quantized per row, VNNI int8 GEMM,
rescaled), alternating round by round in one process. At 2,048 rows (a prefill chunk) the first
8 layers only. Each rate is reported against its own instruction's peak.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from linear_gemm import LAYER_SHAPES, LAYERS
from native import native_library
from workloads import cpu_name

from kvserve.model.int8_linear import Int8Linear
from kvserve.model.llama import PackedLinear

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
// ops per call: iterations x 12 accumulators x 16 lanes x (2 products in bf16 | 4 in int8) x 2
extern "C" double peak(int int8, long iterations, int threads) {
  double sink = 0;
  #pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512 f[12]; __m512i q[12];
    for (int i = 0; i < 12; ++i) { f[i] = _mm512_set1_ps(i); q[i] = _mm512_set1_epi32(i); }
    __m512i a = _mm512_set1_epi16(0x3f80 + omp_get_thread_num()), b = _mm512_set1_epi16(0x3f00);
    for (long it = 0; it < iterations; ++it) {
      if (int8) {
        #pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) q[i] = _mm512_dpbusd_epi32(q[i], a, b);
      } else {
        #pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) f[i] = _mm512_dpbf16_ps(f[i], (__m512bh)a, (__m512bh)b);
      }
      __asm__ volatile("" : "+v"(a));
    }
    for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(f[i]) + _mm512_reduce_add_epi32(q[i]);
  }
  return sink;
}
"""


def dot_peaks(threads: int, iterations: int = 20_000_000) -> dict[str, float]:
    """G(FL)OP/s of back-to-back vdpbf16ps and vpdpbusd on ``threads`` threads, best of 3."""
    peak = native_library(PEAK_SOURCE).peak
    peak.restype, peak.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    rates = {}
    for name, int8, products in (("bf16", 0, 2), ("int8", 1, 4)):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            peak(int8, iterations, threads)
            best = min(best, time.perf_counter() - start)
        rates[name] = iterations * 12 * 16 * products * 2 * threads / best / 1e9
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="32,64,2048")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peaks = dot_peaks(args.threads)
    print(f"peaks on {args.threads} threads: bf16 {peaks['bf16']:.0f} GFLOP/s, int8 {peaks['int8']:.0f} GOP/s")
    bf16, int8 = [], []
    for _ in range(LAYERS):
        for k, n in LAYER_SHAPES:
            linear = nn.Linear(k, n, bias=False).to(torch.bfloat16)
            bf16.append(PackedLinear(linear))
            int8.append(Int8Linear(linear))
    if int8[0].kernel_packed is None:
        raise SystemExit("no VNNI int8 GEMM in this build")
    results = []
    print("| rows | bf16 ms | bf16 GFLOP/s (of peak) | int8 ms | int8 GOP/s (of peak) | int8 / bf16 time |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        count = len(bf16) if rows < 1024 else 8 * len(LAYER_SHAPES)
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k, _ in LAYER_SHAPES}
        ops = 2 * rows * sum(k * n for k, n in LAYER_SHAPES) * count // len(LAYER_SHAPES)
        times: dict[str, list[float]] = {"bf16": [], "int8": []}
        for _ in range(args.rounds + 1):  # the first round warms up, not counted
            for name, modules in (("bf16", bf16), ("int8", int8)):
                start = time.perf_counter()
                for module in modules[:count]:
                    module(inputs[module.in_features])
                times[name].append(time.perf_counter() - start)
        row: dict[str, float] = {"rows": rows, "layers": count // len(LAYER_SHAPES)}
        for name in ("bf16", "int8"):
            seconds = statistics.median(times[name][1:])
            row[f"{name}_ms"], row[f"{name}_rate"] = seconds * 1e3, ops / seconds / 1e9
            row[f"{name}_of_peak"] = row[f"{name}_rate"] / peaks[name]
        results.append(row)
        print(f"| {rows} | {row['bf16_ms']:.2f} | {row['bf16_rate']:.0f} ({row['bf16_of_peak']:.0%}) | "
              f"{row['int8_ms']:.2f} | {row['int8_rate']:.0f} ({row['int8_of_peak']:.0%}) | "
              f"{row['int8_ms'] / row['bf16_ms']:.2f} |", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "peaks": peaks,
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()
