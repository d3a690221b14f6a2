"""CPU KV pools on 2 MB pages (Linux transparent huge pages).

A decode step reads each sequence's blocks scattered through a pool of up to gigabytes. On
4 KB pages nearly every block read is a TLB miss (a page walk, nested under a VM); on 2 MB
pages one TLB entry covers hundreds of blocks. Most distributions set THP to ``madvise``, so a
region gets huge pages only when asked. Measured: decode attention 0.91-0.98x the time over
cold pools (docs/benchmarks.md, "Session 36"). ``KVSERVE_HUGE_PAGES=0`` keeps 4 KB pages (where
2 MB commits are unwanted, or to compare).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Sequence

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back the whole 2 MB pages inside ``tensor``'s bytes with huge pages
    (madvise MADV_HUGEPAGE). Call it before the bytes are first touched: pages already faulted
    in stay 4 KB until khugepaged merges them. True when advised; False (and nothing changed)
    off CPU or Linux, under one whole huge page, or when the kernel refuses (THP off)."""
    libc = _libc()
    if libc is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = (start + tensor.numel() * tensor.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    return libc.madvise(first, last - first, _MADV_HUGEPAGE) == 0


def empty_per_block(size: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty for a tensor indexed by block id (a pool or its per-block scales), on huge pages
    where the CPU allows; its pages are still committed only as blocks are first written."""
    tensor = torch.empty(tuple(size), dtype=dtype, device=device)
    if os.environ.get("KVSERVE_HUGE_PAGES", "1") != "0":
        advise_huge_pages(tensor)
    return tensor
