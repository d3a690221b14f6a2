"""The C++ CPU ops of csrc/ (paged attention over float and quantized pools, rotary + cache
write, residual add + RMSNorm, SwiGLU's silu-and-mul, int8 linear layers), compiled on first use.

Compiled with torch's cpp_extension (needs a C++ compiler and ninja; cached under
~/.cache/torch_extensions). If the build fails, or KVSERVE_NO_CPU_KERNEL=1 is set, callers fall
back to torch ops (gather + batched matmuls, index_copy_ for the cache write, F.rms_norm, F.silu).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvserve")
_MODULE: Any = None
STALE_LOCK_S = 600
_TRIED = False


def cpu_op(name: str) -> Any | None:
    """The compiled op ``name`` (paged_decode_attention, rope_and_write_kv, add_rms_norm,
    silu_and_mul), or None where the extension is unavailable."""
    module = cpu_kernels()
    return None if module is None else getattr(module, name)


def _cpu_fingerprint() -> str:
    """Short hash of this CPU's model and feature flags. The ops are built with -march=native, so
    a build cached for one CPU must not be loaded on another (illegal instructions)."""
    text = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                text += line
            if line.startswith("flags"):
                break
    except OSError:
        text += platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _remove_stale_build_lock(name: str) -> None:
    """torch waits forever on a build lock left by a process killed mid-compile; a build takes
    about a minute, so a lock older than STALE_LOCK_S is removed (with a warning)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing a stale C++ build lock %s (left by an interrupted build)", lock)
            lock.unlink()
    except (ImportError, OSError):  # a private torch helper: never let it stop the engine
        pass


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

        folder = Path(__file__).with_name("csrc")
        sources = sorted(folder.glob("*.cpp"))
        logger.info("loading the C++ CPU ops (compiled once, then cached)")
        # the sources' path and content (headers included) in the name: a changed source or another
        # checkout builds beside, never over, a library another running process has loaded (and two
        # checkouts do not rebuild each other's)
        digest = hashlib.sha256(str(folder.resolve()).encode())
        for file in sorted(folder.glob("*.[ch]*")):
            digest.update(file.name.encode() + file.read_bytes())
        name = f"kvserve_cpu_ops_{_cpu_fingerprint()}_{digest.hexdigest()[:8]}"
        _remove_stale_build_lock(name)
        module = load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        _MODULE = module
    except Exception as exc:  # a missing compiler must not stop the engine
        logger.warning("C++ CPU ops unavailable (%s); using torch ops (gather path for attention)", exc)
        _MODULE = None
    return _MODULE
