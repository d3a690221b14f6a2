"""The C++ CPU ops of csrc/paged_attention.cpp (paged decode attention, rotary + cache write),
compiled on first use.

Compiled with torch's cpp_extension (needs a C++ compiler and ninja; cached under
~/.cache/torch_extensions). If the build fails, or KVSERVE_NO_CPU_KERNEL=1 is set, callers fall
back to torch ops (gather + batched matmuls, index_copy_ for the cache write).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvserve")
_MODULE: Any = None
_TRIED = False


def paged_decode_kernel() -> Any | None:
    """The compiled ``paged_decode_attention`` function, or None where it is unavailable."""
    module = cpu_kernels()
    return None if module is None else module.paged_decode_attention


def rope_write_kernel() -> Any | None:
    """The compiled ``rope_and_write_kv`` function, or None where it is unavailable."""
    module = cpu_kernels()
    return None if module is None else module.rope_and_write_kv


def cpu_kernels() -> Any | None:
    """The compiled extension module (built on first call), or None where it cannot be built."""
    global _MODULE, _TRIED
    if _TRIED:
        return _MODULE
    _TRIED = True
    if os.environ.get("KVSERVE_NO_CPU_KERNEL") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        source = Path(__file__).with_name("csrc") / "paged_attention.cpp"
        logger.info("loading the fused CPU paged-attention kernel (compiled once, then cached)")
        module = load(
            name="kvserve_paged_attention",
            sources=[str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        _MODULE = module
    except Exception as exc:  # a missing compiler must not stop the engine
        logger.warning("fused CPU paged attention unavailable (%s); using the gather path", exc)
        _MODULE = None
    return _MODULE
