"""CPU KV pools on 2 MB pages (Linux transparent huge pages), opt-in: ``KVSERVE_HUGE_PAGES=1``.

A decode step reads each sequence's blocks scattered through a pool of up to gigabytes. On
4 KB pages nearly every block read is a TLB miss (a page walk, nested under a VM); on 2 MB
pages one TLB entry covers hundreds of blocks. Most distributions set THP to ``madvise``, so a
region gets huge pages only when asked. Measured on a Zen 3 VM: decode attention over cold pools
0.92-1.03x the time, a 32 x 4,096 decode step 0.93x. But a pool's pages are first touched while
serving (blocks are zeroed as they are first handed out), and on that VM (Firecracker, whose host
backs guest memory on demand) a fresh 2 MB page cost ~16 ms at first touch against ~0.7 ms for 512
4 KB pages: a fresh engine's shared-prefix run took 27.4 s against 23.1 s. Hence off by default;
worth it where the host backs memory up front (bare metal) and for long-lived servers.

Packed weights go on 2 MB pages by default (``weights_on_huge_pages``; ``KVSERVE_HUGE_PAGES=0``
keeps them on 4 KB pages): every decode step streams all of them from memory, and on a Zen 5 VM
30 cold layers of SmolLM2's linears took 0.91x (int8) and 0.89x (bf16) the time on 2 MB pages.
Their pages are touched once, at load (~0.3 s for 200 MB on that VM).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

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


def first_huge_page(tensor: torch.Tensor) -> int:
    """The address of the first 2 MB page boundary in or at the start of ``tensor``'s bytes."""
    return -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back the whole 2 MB pages inside ``tensor``'s bytes with huge pages
    (madvise MADV_HUGEPAGE). Call it before the bytes are first touched: pages already faulted
    in stay 4 KB until khugepaged merges them. True when advised; False (and nothing changed)
    off CPU or Linux, under one whole huge page, or when madvise fails (a kernel without THP)."""
    libc = _libc()
    if libc is None or tensor.device.type != "cpu":
        return False
    first = first_huge_page(tensor)
    last = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    return libc.madvise(first, last - first, _MADV_HUGEPAGE) == 0


def empty_per_block(size: Sequence[int], dtype: torch.dtype, device: torch.device,
                    huge: bool | None = None) -> torch.Tensor:
    """torch.empty for a tensor indexed by block id (a pool or its per-block scales), advised onto
    huge pages where ``huge`` (None: ``KVSERVE_HUGE_PAGES=1``) and the CPU allow; its pages are
    still committed only as blocks are first written."""
    tensor = torch.empty(tuple(size), dtype=dtype, device=device)
    if huge is None:
        huge = os.environ.get("KVSERVE_HUGE_PAGES", "0") == "1"
    if huge:
        advise_huge_pages(tensor)
    return tensor


def weights_on_huge_pages(model: nn.Module) -> int:
    """Copy the packed weights of ``model``'s layers into one arena on 2 MB pages, each at a
    64-byte boundary: every module with ``movable_weights()`` (the names of its weight buffers
    that may move) has them replaced by views of the arena, then ``bind_weights()`` (it re-reads
    them). Returns the bytes moved: 0 where there are none, ``KVSERVE_HUGE_PAGES=0``, or huge
    pages cannot be advised (nothing changed then)."""
    places = [(module, name) for module in model.modules() if hasattr(module, "movable_weights")
              for name in cast(Any, module).movable_weights()]
    tensors = [getattr(module, name) for module, name in places]
    if not tensors or os.environ.get("KVSERVE_HUGE_PAGES") == "0" or _libc() is None or tensors[0].device.type != "cpu":
        return 0
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    # a fresh private mapping, not torch.empty: that may reuse free heap memory whose pages are
    # already there in 4 KB (measured: 16 of 128 MB on 2 MB pages after a model load)
    whole_pages = -(-sum(sizes) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # + one: room to start at a boundary
    region = mmap.mmap(-1, whole_pages + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    if not advise_huge_pages(arena):
        return 0
    offset = first_huge_page(arena) - arena.data_ptr()
    for (module, name), tensor, size in zip(places, tensors, sizes, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        view = arena[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        setattr(module, name, view)
        offset += size
    for module in {id(module): module for module, _ in places}.values():
        cast(Any, module).bind_weights()
    return sum(sizes)
