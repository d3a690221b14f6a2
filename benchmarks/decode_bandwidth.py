"""Decode attention over a cold pool against this machine's sequential read bandwidth.

    python benchmarks/decode_bandwidth.py --out docs/results/decode_bandwidth_<machine>.json
    python benchmarks/decode_bandwidth.py --length 4096 --rounds 5   # the KV dtypes side by side
    python benchmarks/decode_bandwidth.py --rounds 5 --warm           # ... and each one's pool warm

One decode step's attention for every layer of the default model's shape (30 layer pools, 9
query heads on 3 KV heads, head_dim 64), each layer's pool larger than the last-level cache, so
every K/V byte comes from memory: the kernel's bytes of K/V (and scales) read per second, beside
the sequential read bandwidth measured in the same run (``x.sum()`` over 512 MiB, the same
threads; the best of its measurements at the start and at the end). int8, int4 and fp8 pools are
counted in their own bytes (codes plus per-token value scales; int4 also its per-block key
tables), int8 and fp8 with calibrated static key scales, as ``--kv-cache-dtype int8|fp8
--kv-scales`` runs them; ``int8-block`` is int8 with key scales per block (also counted), as
``--kv-cache-dtype int8`` runs it without a calibration file; ``bf16-fp32q`` is a bf16 pool read by
float32 queries, as a float32 model (the default on CPUs without AVX512-BF16) runs
``--kv-cache-dtype bf16``. ``read-pattern`` is not attention but its floor: the bytes a bf16 step
reads, in the kernel's order, summed with no other compute (C++ built here; READ_PATTERN_SOURCE).
Pools are placed as the engine places them (kvserve.cache.huge_pages);
a dtype named with ``/4k`` or ``/2m`` (``bf16/2m``) forces 4 KB or 2 MB pages, to compare.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from native import native_library
from workloads import cpu_name, page_choice

from kvserve.cache.huge_pages import empty_per_block
from kvserve.cache.kv_quant import KIND_CODES
from kvserve.model.attention import fp8_table
from kvserve.model.cpu_kernels import cpu_op

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30
DEFAULT_KV_DTYPES = ("bf16", "read-pattern", "int8", "int4", "fp8")
KV_DTYPES = (*DEFAULT_KV_DTYPES, "int8-block", "bf16-fp32q")

# The floor of the decode kernels' access pattern: what a bf16 decode step reads, in its order (a
# thread takes a sequence; per KV head, its key rows through the block table, then its value
# rows), summed as 64-bit words with no other compute and no software prefetch.
READ_PATTERN_SOURCE = r"""
#include <cstdint>
extern "C" uint64_t read_pattern(const uint16_t* pool, const int64_t* tables, const int64_t* lens, long batch,
                                 long width, long kv_heads, long block_size, long dim, int threads) {
  const long tile = block_size * dim, block_stride = 2 * kv_heads * tile, row_words = dim / 4;
  uint64_t total = 0;
  #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : total)
  for (long b = 0; b < batch; ++b) {
    uint64_t sum = 0;
    for (long h = 0; h < kv_heads; ++h)
      for (long part = 0; part < 2; ++part)  // keys, then values
        for (long pos = 0; pos < lens[b]; pos += block_size) {
          const long rows = lens[b] - pos < block_size ? lens[b] - pos : block_size;
          const uint64_t* words = reinterpret_cast<const uint64_t*>(
              pool + tables[b * width + pos / block_size] * block_stride + (part * kv_heads + h) * tile);
          for (long w = 0; w < rows * row_words; ++w) sum += words[w];
        }
    total += sum;
  }
  return total;
}
"""


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def sequential_read_gbps() -> float:
    """The fastest read of 512 MiB that torch does here: ``x.sum()`` over float32 and over int64
    (a bf16 sum widens every element and was partly compute-bound on an AVX2 CPU, 16.7-23 GB/s
    against 24-27 for float32 in one session)."""
    best = 0.0
    for dtype in (torch.float32, torch.int64):
        x = torch.ones(512 * 2**20 // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
        best = max(best, x.numel() * x.element_size() / best_of(x.sum, 5) / 1e9)
    return best


def attention_layers(kv_dtype: str, block_size: int, lens: list[int], layers: int, scattered: bool = True,
                     ops: Any = None) -> tuple[Callable[[int], None], float]:
    """``layers`` pools of one decode step for sequences of ``lens`` tokens, and the op that reads
    pool i (``ops``: a build of the C++ ops, by default this checkout's); with the K/V bytes
    (and scales) per token. Blocks scattered through the pool, as after churn, or (``scattered``
    False) each sequence's in order."""
    kv_dtype, huge = page_choice(kv_dtype)

    def placed(t: torch.Tensor) -> torch.Tensor:  # as the engine places it, or on the pages asked for
        return empty_per_block(t.shape, t.dtype, t.device, huge).copy_(t)
    batch, per = len(lens), [-(-n // block_size) for n in lens]
    num_blocks = sum(per) + 1
    order = (torch.randperm(num_blocks - 1) if scattered else torch.arange(num_blocks - 1)) + 1
    tables = torch.zeros(batch, max(per), dtype=torch.long)
    for b, chunk in enumerate(order.split(per)):
        tables[b, : len(chunk)] = chunk
    seq_lens = torch.tensor(lens)
    q = torch.randn(batch, HEADS, DIM).to(torch.float32 if kv_dtype == "bf16-fp32q" else torch.bfloat16)
    out = torch.empty_like(q)
    shape = (num_blocks, 2 * KV_HEADS, block_size, DIM)
    if kv_dtype in ("bf16", "bf16-fp32q"):
        op: Any = ops.paged_decode_attention if ops is not None else cpu_op("paged_decode_attention")
        pools = [placed(torch.randn(shape).to(torch.bfloat16)) for _ in range(layers)]

        def layer(i: int) -> None:
            op(out, q, pools[i], tables, seq_lens, DIM**-0.5)
        value_scales = None
    elif kv_dtype == "read-pattern":
        read = native_library(READ_PATTERN_SOURCE, "-O3").read_pattern
        read.restype = ctypes.c_uint64
        read.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5 + [ctypes.c_int]
        pools = [placed(torch.randn(shape).to(torch.bfloat16)) for _ in range(layers)]

        def layer(i: int) -> None:
            read(pools[i].data_ptr(), tables.data_ptr(), seq_lens.data_ptr(), batch, tables.shape[1], KV_HEADS,
                 block_size, DIM, torch.get_num_threads())
        value_scales = None
    else:
        op = ops.paged_attention_quantized if ops is not None else cpu_op("paged_attention_quantized")
        kind = {"fp8": "fp8_e4m3", "int8-block": "int8"}.get(kv_dtype, kv_dtype)
        key_scales = torch.rand(KV_HEADS, DIM) / 50 + 0.01
        if kv_dtype == "int8-block":  # key scales per block, as without a calibration file (the default)
            key_scales = torch.rand(num_blocks, KV_HEADS, DIM) / 50 + 0.01
        value_scales = (torch.rand(num_blocks, KV_HEADS, block_size, 1) / 50 + 0.01) if kind == "int8" else None
        if kind == "int8":
            pools = [placed(torch.randint(-127, 128, shape, dtype=torch.int8)) for _ in range(layers)]
        elif kind == "int4":  # two codes a byte; (step, minimum) per channel of a block's keys, per value group
            pools = [placed(torch.randint(0, 256, (*shape[:3], DIM // 2), dtype=torch.uint8)) for _ in range(layers)]
            key_scales = (torch.rand(num_blocks, KV_HEADS, 2, DIM) / 50 + 0.01).half()
            value_scales = (torch.rand(num_blocks, KV_HEADS, block_size, DIM // 32, 2) / 50 + 0.01).half()
        else:
            pools = [placed(torch.randn(shape).to(torch.float8_e4m3fn).view(torch.uint8)) for _ in range(layers)]
        key_scales = placed(key_scales) if key_scales.dim() > 2 else key_scales  # per block: scattered reads
        value_scales = placed(value_scales) if value_scales is not None else None
        lut = fp8_table(kind) if kind.startswith("fp8") else None

        def layer(i: int) -> None:
            assert op(out, q, pools[i], KIND_CODES[kind], key_scales, value_scales, 0.02, lut, None, None, tables,
                      seq_lens, 1, DIM**-0.5)
    token_bytes: float = 2 * KV_HEADS * pools[0].shape[-1] * pools[0].element_size()
    if value_scales is not None:  # per token; int4's key tables are per block
        token_bytes += KV_HEADS * value_scales[0, 0, 0].numel() * value_scales.element_size()
    if kv_dtype == "int4":
        token_bytes += KV_HEADS * 2 * DIM * 2 / block_size
    if kv_dtype == "int8-block":
        token_bytes += KV_HEADS * DIM * 4 / block_size
    return layer, token_bytes


def decode_step(kv_dtype: str, block_size: int, batch: int, length: int, layers: int = LAYERS,
                scattered: bool = True) -> dict[str, float]:
    """Milliseconds per layer of decode attention, the K/V bytes it read and the rate; ``layers``
    pools, each read once per step (LAYERS of them: cold, from memory; one small one: hot, from cache)."""
    layer, token_bytes = attention_layers(kv_dtype, block_size, [length] * batch, layers, scattered)
    seconds = best_of(lambda: [layer(i) for i in range(layers)], 3 if layers > 1 else 200) / layers
    return {"ms_per_layer": 1e3 * seconds, "ns_per_token": 1e9 * seconds / (batch * length),
            "kv_bytes": batch * length * token_bytes,
            "gbps": batch * length * token_bytes / seconds / 1e9}


def interleaved(kv_dtypes: list[str], block_size: int, batch: int, length: int, rounds: int,
                warm: bool = False) -> list[dict[str, Any]]:
    """Every dtype's LAYERS cold pools built first, then ``rounds`` rounds of one step each, the
    dtypes in turn: ms per layer (median) and the median of the rounds' ratios to the first dtype,
    so the VM's drift falls on all alike (target 2's per-layer attention, without the model).
    ``warm``: each round also reads a dtype's first pool LAYERS times over (from the last-level
    cache where it fits): warm / cold near 1 says the kernel is compute-bound at this shape."""
    layers = {d: attention_layers(d, block_size, [length] * batch, LAYERS)[0] for d in kv_dtypes}
    times: dict[str, list[float]] = {d: [] for d in kv_dtypes}
    warm_times: dict[str, list[float]] = {d: [] for d in kv_dtypes}

    def step_ms(d: str, pools: range | list[int]) -> float:
        start = time.perf_counter()
        for i in pools:
            layers[d](i)
        return 1e3 * (time.perf_counter() - start) / LAYERS

    for _ in range(rounds):
        for d in kv_dtypes:
            layers[d](0)
            times[d].append(step_ms(d, range(LAYERS)))
            if warm:
                warm_times[d].append(step_ms(d, [0] * LAYERS))
    first = times[kv_dtypes[0]]
    rows = [{"kv_dtype": d, "block_size": block_size, "ms_per_layer": statistics.median(times[d]),
             "ratio": statistics.median(t / b for t, b in zip(times[d], first, strict=True)),
             "round_ms": times[d]} for d in kv_dtypes]
    if warm:
        for row, d in zip(rows, kv_dtypes, strict=True):
            row["warm_ms_per_layer"] = statistics.median(warm_times[d])
            row["warm_over_cold"] = statistics.median(w / c for w, c in zip(warm_times[d], times[d], strict=True))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-dtypes", default=",".join(DEFAULT_KV_DTYPES))
    parser.add_argument("--block-sizes", default="16,32,64,128")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=0,
                        help="compare the KV dtypes instead: their steps alternated for this many rounds")
    parser.add_argument("--warm", action="store_true",
                        help="with --rounds: also time each dtype's first pool read over and over (warm / cold)")
    args = parser.parse_args()
    unknown = sorted({page_choice(d)[0] for d in args.kv_dtypes.split(",")} - set(KV_DTYPES))
    if unknown:
        parser.error(f"--kv-dtypes: unknown {', '.join(unknown)} (choose from {', '.join(KV_DTYPES)})")
    torch.set_num_threads(args.threads)
    if cpu_op("paged_decode_attention") is None:
        raise SystemExit("the C++ ops are not available here")
    if args.rounds > 0:
        return compare_dtypes(args)
    reads = [sequential_read_gbps()]
    result: dict[str, Any] = {"cpu": cpu_name(), "threads": args.threads, "batch": args.batch,
                              "length": args.length, "runs": []}
    print(f"decode attention {args.batch} x {args.length}, {args.threads} threads "
          f"(sequential read at the start: {reads[0]:.1f} GB/s)")
    for kv_dtype in args.kv_dtypes.split(","):
        for block_size in (int(b) for b in args.block_sizes.split(",")):
            row = decode_step(kv_dtype, block_size, args.batch, args.length)
            result["runs"].append({"kv_dtype": kv_dtype, "block_size": block_size, **row})
            print(f"  {kv_dtype} block {block_size}: {row['ms_per_layer']:.3f} ms / layer", flush=True)
    # the denominator: the best sequential read of the run (this VM's speed moves between runs)
    reads.append(sequential_read_gbps())
    read = result["sequential_read_gbps"] = max(reads)
    result["sequential_read_samples_gbps"] = reads
    print(f"sequential read: {read:.1f} GB/s (best of {', '.join(f'{r:.1f}' for r in reads)})")
    print("| KV dtype | block size | ms / layer | GB/s of K/V | of sequential read |")
    print("|---|---|---|---|---|")
    for run in result["runs"]:
        print(f"| {run['kv_dtype']} | {run['block_size']} | {run['ms_per_layer']:.3f} | {run['gbps']:.1f} | "
              f"{run['gbps'] / read:.0%} |")
    # hot: one thread, one 2 x 512-token pool read again and again from cache: the kernel's compute
    torch.set_num_threads(1)
    print("\nhot pool (1 thread, 2 x 512 tokens, block 16, in cache):")
    for kv_dtype in args.kv_dtypes.split(","):
        row = decode_step(kv_dtype, 16, 2, 512, layers=1)
        result["hot_" + kv_dtype] = row
        print(f"| {kv_dtype} | {row['ns_per_token']:.1f} ns per token (3 KV heads, 9 query heads) | "
              f"{row['gbps']:.1f} GB/s |", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


def compare_dtypes(args: argparse.Namespace) -> None:
    dtypes = args.kv_dtypes.split(",")
    rows = []
    print(f"decode attention {args.batch} x {args.length}, {args.threads} threads, {args.rounds} rounds alternating")
    print("| block size | " + " | ".join(f"{d} ms / layer (vs {dtypes[0]})" for d in dtypes) + " |")
    print("|---" * (len(dtypes) + 1) + "|")
    for block_size in (int(b) for b in args.block_sizes.split(",")):
        found = interleaved(dtypes, block_size, args.batch, args.length, args.rounds, args.warm)
        rows += found
        cells = [f"{r['ms_per_layer']:.3f} ({r['ratio']:.2f}x" + (f"; warm {r['warm_over_cold']:.2f}x of cold)"
                                                                  if args.warm else ")") for r in found]
        print(f"| {block_size} | " + " | ".join(cells) + " |", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "batch": args.batch,
                                        "length": args.length, "rounds": args.rounds, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
