"""Read and write allocator memory from tests: byte patterns that prove allocations hold their own
contents. Host: numpy views of the mapped pages. CUDA: cuMemsetD8 / cuMemcpyDtoH through ctypes.

Imported by the allocator tests; the tests in this file check the helpers themselves.
"""
from __future__ import annotations

import ctypes
from typing import Iterator, Tuple

import numpy as np
import pytest

PROBE = 256  # bytes checked at each probe point


def probe_windows(n: int, stride: int) -> Iterator[Tuple[int, int]]:
    """(offset, length) windows covering the start, the end and every `stride` bytes of n bytes."""
    offsets = set(range(0, n, stride)) | {max(0, n - PROBE)}
    for off in sorted(offsets):
        yield off, min(PROBE, n - off)


class HostMemory:
    """Host backend: the allocation is CPU-addressable memory."""

    def view(self, ptr: int, n: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))

    def fill(self, ptr: int, n: int, byte: int) -> None:
        self.view(ptr, n)[:] = byte

    def intact(self, ptr: int, n: int, byte: int, stride: int) -> bool:
        v = self.view(ptr, n)
        return all(bool((v[o:o + k] == byte).all()) for o, k in probe_windows(n, stride))


class CudaMemory:
    """CUDA backend: device memory, reached through the driver with the primary context current.
    Driver calls only (no torch), so the same helper runs on a GPU and on the fake libcuda
    (tests/fake_cuda)."""

    def __init__(self, device: int = 0) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self._check(self.cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.ctx = ctypes.c_void_p()
        self._check(self.cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self._check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")

    def _check(self, r: int, what: str) -> None:
        if r != 0:
            raise RuntimeError(f"{what} failed with CUresult {r}")

    def _current(self) -> None:
        # Tests call from worker threads too, which have no current context of their own.
        self._check(self.cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def new_stream(self) -> int:
        """A stream of the primary context (the context vmalloc's allocator uses)."""
        self._current()
        s = ctypes.c_void_p()
        self._check(self.cu.cuStreamCreate(ctypes.byref(s), 0), "cuStreamCreate")
        return int(s.value)

    def fill(self, ptr: int, n: int, byte: int) -> None:
        self._current()
        self._check(self.cu.cuMemsetD8_v2(ctypes.c_uint64(ptr), ctypes.c_ubyte(byte), ctypes.c_size_t(n)),
                    "cuMemsetD8")
        self._check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def intact(self, ptr: int, n: int, byte: int, stride: int) -> bool:
        self._current()
        for off, k in probe_windows(n, stride):
            buf = (ctypes.c_uint8 * k)()
            self._check(self.cu.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(ptr + off), ctypes.c_size_t(k)),
                        "cuMemcpyDtoH")
            if not (np.frombuffer(buf, dtype=np.uint8) == byte).all():
                return False
        return True


def memory_for(backend: str):
    return HostMemory() if backend == "host" else CudaMemory()


def test_probe_windows_cover_both_ends():
    wins = list(probe_windows(10_000, 4096))
    assert wins[0] == (0, PROBE)
    assert wins[-1] == (10_000 - PROBE, PROBE)
    assert (4096, PROBE) in wins and (8192, PROBE) in wins
    assert list(probe_windows(10, 4096)) == [(0, 10)]


def test_host_memory_detects_a_changed_byte():
    buf = (ctypes.c_uint8 * 8192)()
    mem = HostMemory()
    mem.fill(ctypes.addressof(buf), 8192, 7)
    assert mem.intact(ctypes.addressof(buf), 8192, 7, 4096)
    buf[4100] = 8
    assert not mem.intact(ctypes.addressof(buf), 8192, 7, 4096)
    with pytest.raises(AssertionError):
        assert mem.intact(ctypes.addressof(buf), 8192, 7, 4096)
