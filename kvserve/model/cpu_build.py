"""Builds the C++ CPU ops of csrc/ once per instruction-set level, each into its own Python
extension module, cached on disk.

Compiling needs no CPU support, so every level builds on any x86-64 host; only loading one needs
a CPU that runs it. A build is named by everything that shapes it (the sources, the level's flags,
torch, Python and the compiler), so a changed source builds beside, never over, a module another
process has loaded. A failed build is remembered under the same name (its log kept), so the next
process reports it at once instead of compiling again; a changed source, compiler or torch is a
new name and is tried afresh.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SOURCES = Path(__file__).with_name("csrc")
ON_X86 = platform.machine().lower() in ("x86_64", "amd64")
_V3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"})  # x86-64-v3 (abm: lzcnt)
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_AVX512 = _V4 | {"avx512_bf16", "avx512_vnni", "avx512vbmi"}


@dataclass(frozen=True, slots=True)
class IsaLevel:
    """One build of the ops: the compiler flags it is built with, and the CPU flags (as
    /proc/cpuinfo names them) a CPU needs to run it. Each level runs on every CPU above it."""

    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]


LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("portable", ("-march=x86-64",) if ON_X86 else (), frozenset()),
    IsaLevel("avx2", ("-march=x86-64-v3",), _V3),
    # the AVX-512 kernels use BF16 dot products, VNNI and VBMI's byte permutes (Zen 4/5, Xeons
    # since Sapphire Rapids); an AVX-512 CPU without them runs the avx2 build
    IsaLevel("avx512", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi"), _AVX512),
    IsaLevel("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi", "-mamx-tile",
                     "-mamx-bf16", "-mamx-int8"), _AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}),
) if ON_X86 else (IsaLevel("portable", (), frozenset()),)
LEVEL_NAMES = tuple(level.name for level in LEVELS)
COMMON_CFLAGS = ("-O3", "-fopenmp", "-ffast-math", "-fPIC", "-std=c++20", "-fvisibility=hidden")


class CpuOpsBuildError(RuntimeError):
    """A level's ops did not build; the message ends with the compiler's output."""


def level(name: str) -> IsaLevel:
    """The level called ``name`` (ValueError naming the choices otherwise)."""
    for candidate in LEVELS:
        if candidate.name == name:
            return candidate
    raise ValueError(f"unknown ISA level {name!r}: choose one of {', '.join(LEVEL_NAMES)}")


def cache_root() -> Path:
    """Where builds are kept: $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve or ~/.cache/kvserve."""
    root = os.environ.get("KVSERVE_CACHE_DIR")
    if root:
        return Path(root) / "cpu_ops"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvserve" / "cpu_ops"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _compiler_version() -> str:
    try:
        return subprocess.run([_compiler(), "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "no compiler"


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile, link) flags of an extension module against this torch and Python."""
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    compile_flags = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                     "-DTORCH_API_INCLUDE_EXTENSION_H", *(f for path in includes for f in ("-isystem", path))]
    link_flags = ["-shared", "-fopenmp", *(f"-L{path}" for path in library_paths()),
                  "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
    return compile_flags, link_flags


def module_name(isa: IsaLevel) -> str:
    """The build's module name: the level and a digest of everything that shapes the build."""
    import torch

    digest = hashlib.sha256()
    for part in (*isa.cflags, *COMMON_CFLAGS, torch.__version__, sys.version, _compiler_version()):
        digest.update(part.encode() + b"\0")
    for file in sorted(SOURCES.glob("*.[ch]*")):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return f"kvserve_ops_{isa.name}_{digest.hexdigest()[:12]}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` between processes: the OS drops it when its holder dies, so
    a build killed midway never leaves a lock to wait on forever."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(command: list[str]) -> str | None:
    """None where ``command`` succeeded, else the command and what it printed."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        return f"{' '.join(command)}\n{exc}"
    return None if done.returncode == 0 else f"{' '.join(command)}\n{done.stdout}{done.stderr}"


def _first_error(log: str) -> str:
    """The compiler's first complaint in a build log (its command line left out), briefly."""
    lines = log.split("\n", 1)[-1].splitlines()
    return "\n".join(lines[:12])


def build_state(isa: IsaLevel) -> str:
    """"built", "build failed" or "not built" (in this cache, for these sources)."""
    folder = cache_root() / module_name(isa)
    if (folder / f"{folder.name}.so").exists():
        return "built"
    return "build failed" if (folder / "FAILED").exists() else "not built"


def build(isa: IsaLevel, jobs: int | None = None) -> Path:
    """The level's compiled module (built here unless cached), or CpuOpsBuildError. The sources
    compile in parallel (``jobs`` at a time, default one per core)."""
    name = module_name(isa)
    folder = cache_root() / name
    library, failed = folder / f"{name}.so", folder / "FAILED"
    with _locked(cache_root() / f"{name}.lock"):
        if library.exists():
            return library
        if failed.exists():
            raise CpuOpsBuildError(f"the {isa.name} build failed before (log: {failed}; delete it to retry):\n"
                                   + _first_error(failed.read_text()))
        folder.mkdir(parents=True, exist_ok=True)
        compile_flags, link_flags = _torch_flags()
        flags = [*COMMON_CFLAGS, *isa.cflags, f"-DTORCH_EXTENSION_NAME={name}", *compile_flags]
        sources = sorted(SOURCES.glob("*.cpp"))
        objects = [folder / f"{source.stem}.o" for source in sources]
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            errors = [e for e in pool.map(lambda s, o: _run([_compiler(), *flags, "-c", str(s), "-o", str(o)]),
                                          sources, objects) if e]
        partial = library.with_suffix(".so.partial")
        if not errors:
            error = _run([_compiler(), *map(str, objects), *link_flags, "-o", str(partial)])
            errors = [error] if error else []
        if errors:
            failed.write_text("\n".join(errors))
            raise CpuOpsBuildError(f"the {isa.name} build of the C++ CPU ops failed (log: {failed}):\n"
                                   + _first_error(errors[0]))
        partial.rename(library)  # whole or absent: another process never loads half a library
        for obj in objects:
            obj.unlink()
        return library
