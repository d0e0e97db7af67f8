"""Build a small C++ shared library for a test (one that calls vmalloc's exported C entry points
the way PyTorch does, with PyTorch's own C++ types), and load it."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import pytest


def build_library(where: Path, name: str, source: str, cflags: Sequence[str] = (),
                  libs: Sequence[str] = (), load: bool = True) -> Optional[ctypes.CDLL]:
    """Compile ``source`` into ``where/name.so`` (C++17 with ``cflags``, linked with ``libs``,
    which come after the source, and -ldl) and load it (unless ``load`` is False: a library
    meant for a subprocess); skips the test where no C++ compiler is installed."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src, lib = Path(where) / f"{name}.cpp", Path(where) / f"{name}.so"
    src.write_text(source)
    cmd = [cxx, "-std=c++17", "-O0", "-shared", "-fPIC", *cflags, str(src), "-o", str(lib),
           *libs, "-ldl"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
    return ctypes.CDLL(str(lib)) if load else None
