"""The C++ CPU ops of csrc/ (paged attention over float and quantized pools, rotary + cache
write, residual add + RMSNorm, SwiGLU's silu-and-mul, int8 and bf16 linear layers), at the best
instruction-set level this CPU runs.

Each level (portable, avx2, avx512, amx: kvserve.model.cpu_build) is its own build, compiled on
first use and cached. ``KVSERVE_ISA=<level>`` caps the level (never above what the CPU runs);
``KVSERVE_NO_CPU_KERNEL=1`` runs the torch ops on purpose (gather + matmuls for attention,
index_copy_ for the cache write, F.rms_norm, F.silu). A build that fails is reported once, with
its log, and the engine runs the torch ops; ``active_isa()`` names what runs ("torch" then), and
the server reports it on /metrics and /v1/kv.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvserve.model.cpu_build import LEVELS, CpuOpsBuildError, IsaLevel, build, level

logger = logging.getLogger("kvserve")
TORCH_ONLY = "torch"  # active_isa() where no build of the ops runs
_LOADED: dict[str, Any] = {}  # level name -> its module, once imported
_ACTIVE: list[Any] = []  # [the module cpu_op reads] once chosen; [None]: torch ops


@functools.cache  # the CPU does not change under a process; every level check reads it
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


def missing_flags(isa: IsaLevel) -> list[str]:
    """The CPU flags ``isa`` needs that this CPU lacks (none: it runs here)."""
    return sorted(isa.cpu_flags - cpu_flags())


def runnable_levels() -> list[IsaLevel]:
    """The levels this CPU runs, lowest first."""
    return [isa for isa in LEVELS if not missing_flags(isa)]


def selected_level() -> IsaLevel | None:
    """The level to run: the best this CPU runs, capped by KVSERVE_ISA; None with
    KVSERVE_NO_CPU_KERNEL=1 (torch ops on purpose)."""
    if os.environ.get("KVSERVE_NO_CPU_KERNEL") == "1":
        return None
    runnable = runnable_levels()
    cap = os.environ.get("KVSERVE_ISA")
    if not cap:
        return runnable[-1]
    try:
        ceiling = LEVELS.index(level(cap))
    except ValueError as exc:
        raise ValueError(f"KVSERVE_ISA: {exc}") from None
    return [isa for isa in runnable if LEVELS.index(isa) <= ceiling][-1]


def load_level(isa: IsaLevel) -> Any:
    """The module of ``isa``'s build (built first where not cached). Raises CpuOpsBuildError where
    it does not build, RuntimeError where this CPU cannot run it."""
    if isa.name not in _LOADED:
        missing = missing_flags(isa)
        if missing:
            raise RuntimeError(f"this CPU cannot run the {isa.name} build of the ops (no {', '.join(missing)})")
        path = build(isa)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _LOADED[isa.name] = module
    return _LOADED[isa.name]


def cpu_kernels() -> Any | None:
    """The module of the selected level (loaded on first call), or None where the torch ops run."""
    if not _ACTIVE:
        isa = selected_level()
        module = None
        if isa is not None:
            logger.info("loading the %s build of the C++ CPU ops (compiled once, then cached)", isa.name)
            try:
                module = load_level(isa)
            except (CpuOpsBuildError, OSError, ImportError) as exc:
                logger.warning("the C++ CPU ops are unavailable, so the slower torch ops run instead: %s", exc)
        _ACTIVE.append(module)
    return _ACTIVE[0]


def active_isa() -> str:
    """The level whose ops run (portable, avx2, avx512, amx), or "torch" where none does."""
    module = cpu_kernels()
    return next((name for name, loaded in _LOADED.items() if loaded is module), TORCH_ONLY)


def ops_isa(device: torch.device) -> str:
    """What an engine on ``device`` runs its ops with: the C++ level on CPU ("torch" where none
    runs there), "none" on other devices (the CPU ops are not theirs)."""
    return active_isa() if device.type == "cpu" else "none"


def cpu_op(name: str) -> Any | None:
    """The compiled op ``name`` (paged_decode_attention, rope_and_write_kv, add_rms_norm, ...) of
    the running level, or None where the torch ops run."""
    module = cpu_kernels()
    return None if module is None else getattr(module, name)


@contextmanager
def use_isa(isa: str | IsaLevel) -> Iterator[Any]:
    """Run a level's ops (one of LEVELS by name, or any IsaLevel) inside the block: tests and
    benchmarks compare levels in one process. Ops already looked up keep their level: build
    models inside the block."""
    module = load_level(level(isa) if isinstance(isa, str) else isa)
    previous = cpu_kernels()
    _ACTIVE[0] = module
    try:
        yield module
    finally:
        _ACTIVE[0] = previous
