"""One layer's decode attention over a shared prefix: the decode kernel over whole tables
against cascade attention (shared part once + each sequence's own blocks, merged), bf16 pool,
SmolLM2's heads (9 query / 3 KV heads of 64), block size 16, 2 threads, hot (50 calls each).

    python benchmarks/cascade_kernel.py

Sets the runner's threshold (kvserve/engine/model_runner.py CASCADE_MIN_READS).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvserve.model.attention import Cascade, cascade_attention
from kvserve.model.cpu_kernels import cpu_op

BLOCK, KV_HEADS, HEADS, DIM, OWN = 16, 3, 9, 64, 60


def per_call_ms(fn: Callable[..., object], *args: object, calls: int = 50) -> float:
    fn(*args)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    torch.set_num_threads(2)
    decode = cpu_op("paged_decode_attention")
    assert decode is not None, "needs the C++ kernels"
    print("| queries | shared tokens | decode kernel | cascade | speed-up |\n|---|---|---|---|---|")
    for shared_blocks in (16, 32, 62, 250):
        for batch in (12, 16, 24, 32, 48):
            own_blocks = -(-OWN // BLOCK)
            pool = torch.randn(batch * own_blocks + shared_blocks + 1, 2 * KV_HEADS, BLOCK, DIM).to(torch.bfloat16)
            tables = torch.zeros(batch, shared_blocks + own_blocks, dtype=torch.long)
            tables[:, :shared_blocks] = torch.arange(1, shared_blocks + 1)
            tables[:, shared_blocks:] = (torch.randperm(batch * own_blocks) + shared_blocks + 1).view(batch, -1)
            lens = torch.full((batch,), shared_blocks * BLOCK + OWN)
            query = torch.randn(batch, HEADS, DIM).to(torch.bfloat16)
            out = torch.empty_like(query)
            cascade = Cascade(tables[:1, :shared_blocks], torch.tensor([shared_blocks * BLOCK]),
                              tables[:, shared_blocks:].contiguous(), lens - shared_blocks * BLOCK)
            plain = per_call_ms(decode, out, query, pool, tables, lens, DIM**-0.5)
            cascaded = per_call_ms(cascade_attention, out, query, pool, cascade, 1, DIM**-0.5)
            print(f"| {batch} | {shared_blocks * BLOCK} | {plain:.3f} ms | {cascaded:.3f} ms | "
                  f"{plain / cascaded:.2f}x |")


if __name__ == "__main__":
    main()
