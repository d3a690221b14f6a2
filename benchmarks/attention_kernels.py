"""The C++ attention kernels alone: prefill kernel vs torch SDPA on the same causal problem
(bf16 also with the AMX tile path off, where the CPU has AMX), and the decode kernel's K/V read
bandwidth with the pool cold (30 layer pools, as in a step).

    python benchmarks/attention_kernels.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.model.cpu_kernels import cpu_op

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16  # the default model's attention shape


def timed(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def prefill(dtype: torch.dtype, batch: int, length: int, label: str = "prefill") -> None:
    op = cpu_op("paged_prefill_attention")
    width = -(-length // BLOCK)
    pool = torch.randn(batch * width + 1, 2 * KV_HEADS, BLOCK, DIM).to(dtype)
    tables = (torch.randperm(batch * width) + 1).view(batch, width)
    lens = torch.full((batch,), length)
    q = torch.randn(batch * length, HEADS, DIM).to(dtype)
    out = torch.empty_like(q)
    kernel = timed(lambda: op(out, q, pool, tables, lens, length, DIM**-0.5))
    qs = q.view(batch, length, HEADS, DIM).transpose(1, 2)
    k = torch.randn(batch, KV_HEADS, length, DIM).to(dtype)
    v = torch.randn(batch, KV_HEADS, length, DIM).to(dtype)
    sdpa = timed(lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True))
    print(f"| {label} | {str(dtype)[6:]} | {batch} x {length} | {1e3 * kernel:.2f} ms | {1e3 * sdpa:.2f} ms "
          f"| {sdpa / kernel:.2f}x |")


def decode_cold(dtype: torch.dtype, batch: int, length: int) -> None:
    op = cpu_op("paged_decode_attention")
    per = -(-length // BLOCK)
    layers = [torch.randn(batch * per * 2 + 1, 2 * KV_HEADS, BLOCK, DIM).to(dtype) for _ in range(30)]
    tables = (torch.randperm(batch * per * 2)[: batch * per] + 1).view(batch, per)
    lens = torch.full((batch,), length)
    q = torch.randn(batch, HEADS, DIM).to(dtype)
    out = torch.empty_like(q)

    def step() -> None:
        for pool in layers:
            op(out, q, pool, tables, lens, DIM**-0.5)

    per_layer = timed(step, 3) / len(layers)
    read = batch * length * 2 * KV_HEADS * DIM * layers[0].element_size()
    print(f"| decode (cold pool) | {str(dtype)[6:]} | {batch} x {length} | {1e3 * per_layer:.3f} ms/layer | "
          f"{read / per_layer / 1e9:.1f} GB/s of K/V | |")


def main() -> None:
    torch.set_num_threads(2)
    if cpu_op("paged_prefill_attention") is None:
        raise SystemExit("the C++ ops are not available here")
    print("| kernel | dtype | sequences x tokens | kvserve | torch SDPA | speed-up |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for batch, length in ((1, 1000), (16, 128)):
            prefill(dtype, batch, length)
    set_amx = cpu_op("set_amx")
    for amx in (True, False) if set_amx(True) else (False,):  # bf16 on AMX tiles, then on AVX512-BF16
        set_amx(amx)
        for batch, length in ((1, 1000), (1, 4096)):
            prefill(torch.bfloat16, batch, length, "prefill, AMX" if amx else "prefill, no AMX")
    set_amx(True)
    for dtype in (torch.float32, torch.bfloat16):
        for batch, length in ((32, 150), (64, 700)):
            decode_cold(dtype, batch, length)


if __name__ == "__main__":
    main()
