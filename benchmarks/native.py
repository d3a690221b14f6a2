"""C++ compiled on the spot for measurements that need exact instructions or access patterns,
not kvserve's kernels (dot-product peaks, the decode read pattern): g++ -march=native, loaded
through ctypes."""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path


def native_library(source: str, opt: str = "-O2") -> ctypes.CDLL:
    """``source`` built as a shared library with OpenMP and loaded (the file is removed once loaded)."""
    with tempfile.TemporaryDirectory() as tmp:
        path, library = Path(tmp) / "native.cpp", Path(tmp) / "native.so"
        path.write_text(source)
        subprocess.run(["g++", opt, "-march=native", "-fopenmp", "-shared", "-fPIC", str(path), "-o", str(library)],
                       check=True)
        return ctypes.CDLL(str(library))
