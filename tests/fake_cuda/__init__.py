"""The strict fake libcuda.so.1 (fake_libcuda.c beside this file): build it, and reach its test
controls from a process that runs on it.

A process runs on the fake when it starts with ``LD_LIBRARY_PATH`` naming the directory that
:func:`build` returns and ``VMALLOC_FAKE_CUDA=1`` (which un-skips the tests marked ``driver`` and
``fake_cuda``; see tests/conftest.py). tests/test_fake_cuda.py starts such a pytest run.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fake_libcuda.c"
ENV_FLAG = "VMALLOC_FAKE_CUDA"

ENTRY_POINTS = (
    "cuInit", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceTotalMem", "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuCtxSynchronize",
    "cuMemAddressReserve", "cuMemAddressFree", "cuMemGetAllocationGranularity", "cuMemCreate",
    "cuMemRelease", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemsetD8", "cuMemcpyDtoH",
    "cuStreamCreate", "cuStreamDestroy", "cuStreamGetCtx", "cuEventCreate", "cuEventRecord",
    "cuEventQuery", "cuEventSynchronize", "cuEventDestroy", "cuDeviceCanAccessPeer")

# CUresult values the tests inject or expect
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_DEINITIALIZED = 4
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_UNKNOWN = 999


def active() -> bool:
    """True in a process started to run on the fake driver."""
    return os.environ.get(ENV_FLAG) == "1"


def compiler() -> Optional[str]:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def build(out_dir: Path) -> Path:
    """Compile the fake into out_dir/<hash of the source>/libcuda.so.1 (reused while the source is
    unchanged); returns that directory, the one to put on LD_LIBRARY_PATH."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (CC, cc, gcc, clang) to build the fake libcuda with")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    where = Path(out_dir) / digest
    lib = where / "libcuda.so.1"
    if not lib.exists():
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f".libcuda.so.1.{os.getpid()}"
        cmd = [cc, "-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
               "-fvisibility=hidden", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(SOURCE),
               "-lpthread"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the fake libcuda failed ({' '.join(cmd)}):\n{done.stderr}")
        os.replace(tmp, lib)
    return where


class FakeDriver:
    """The test controls of the fake loaded in this process (the library vmalloc dlopens)."""

    def __init__(self) -> None:
        if not active():
            raise RuntimeError(f"not running on the fake libcuda ({ENV_FLAG}=1 is not set)")
        self.lib = ctypes.CDLL("libcuda.so.1")
        if not hasattr(self.lib, "fakecuda_get"):
            raise RuntimeError("libcuda.so.1 on this process's path is a real driver, not the fake")
        self.lib.fakecuda_get.restype = ctypes.c_longlong
        self.lib.fakecuda_get.argtypes = [ctypes.c_char_p]
        self.lib.fakecuda_inject.argtypes = [ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_int,
                                             ctypes.c_ulonglong]
        self.lib.fakecuda_stream_hold.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.lib.fakecuda_stream_use.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        self.lib.fakecuda_violation.restype = ctypes.c_char_p
        self.lib.fakecuda_violation.argtypes = [ctypes.c_longlong]
        self.lib.fakecuda_reclaim.restype = ctypes.c_longlong
        self.lib.fakecuda_reclaim.argtypes = [ctypes.c_ulonglong]

    def get(self, what: str) -> int:
        v = int(self.lib.fakecuda_get(what.encode()))
        if v < 0:
            raise ValueError(f"what: the fake counts no {what!r}")
        return v

    def calls(self) -> Dict[str, int]:
        """Calls so far of each driver entry point (names without the _v2 suffix)."""
        return {n: self.get(f"calls:{n}") for n in ENTRY_POINTS if self.get(f"calls:{n}")}

    def inject(self, fn: str, nth: int, result: int, count: int = 1) -> None:
        """The nth next call of driver function `fn` ("cuMemMap", ..., or "any") fails with
        `result`, and so do the count - 1 calls after it (count 0: all of them); nth 0 disarms."""
        self.lib.fakecuda_inject(fn.encode(), nth, result, count)

    def disarm(self) -> None:
        """Undo inject() and deinit(): the driver answers normally again."""
        self.inject("any", 0, 0)
        self.revive()

    def deinit(self) -> None:
        """The driver shuts down, as at process exit under the CUDA runtime's teardown: every
        entry point returns CUDA_ERROR_DEINITIALIZED (not a violation) until revive()."""
        self.lib.fakecuda_deinit()

    def revive(self) -> None:
        """Undo deinit() (tests/conftest.py does it after every test)."""
        self.lib.fakecuda_revive()

    def serial(self) -> int:
        """The creation serial of the newest driver object: reclaim() takes what comes after."""
        return self.get("serial")

    def reclaim(self, since: int) -> int:
        """Destroy every mapping, handle, reservation, event and stream created after serial
        `since`, as the real driver does at exit (what a test that shut it down leaked); context
        references stay. Returns how many objects went."""
        return int(self.lib.fakecuda_reclaim(since))

    def hold(self, stream: int, held: bool = True) -> None:
        """Keep the events recorded on `stream` pending (its work still running), or let them go."""
        if self.lib.fakecuda_stream_hold(ctypes.c_void_p(stream), int(held)) != 0:
            raise ValueError(f"stream: {stream:#x} is not a live stream of the fake")

    def use(self, stream: int, ptr: int, n: int) -> None:
        """Queue device work on `stream` (0: the default stream) that reads and writes
        [ptr, ptr + n): pending while the stream is held; unmapping it before then is a
        violation."""
        if self.lib.fakecuda_stream_use(ctypes.c_void_p(stream), ptr, n) != 0:
            raise ValueError(f"use: stream {stream:#x} or [{ptr:#x}, +{n}) refused (see the violation)")

    def violations(self) -> List[str]:
        n = self.get("violations")
        return [(self.lib.fakecuda_violation(i) or b"").decode() for i in range(min(n, 64))]
