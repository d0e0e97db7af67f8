"""The fake libcuda catches what it claims to: each misuse below, made through the driver API
directly, is answered with the driver's error and recorded as exactly one violation (a fake that
accepted it would let the cuda backend's tests pass vacuously).

Marked fake_cuda: runs in the pytest run of tests/test_fake_cuda.py.
"""
from __future__ import annotations

import ctypes
import os

import pytest

from fake_cuda import CUDA_ERROR_DEINITIALIZED, ENTRY_POINTS
from test_alloc_memory import CudaMemory

pytestmark = pytest.mark.fake_cuda

G = 2 << 20
u64 = ctypes.c_uint64


class Driver:
    """Raw driver calls with device 0's primary context current (device 1's on request)."""

    def __init__(self) -> None:
        self.mem = CudaMemory()
        self.cu = self.mem.cu
        self.mem._current()

    def reserve(self, size: int) -> int:
        p = u64()
        assert self.cu.cuMemAddressReserve(ctypes.byref(p), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                           u64(0), u64(0)) == 0
        return p.value

    def create(self, size: int, device: int = 0) -> int:
        prop = (ctypes.c_int * 8)()      # type, handle types, location {type, id}, ...
        prop[0], prop[1], prop[2], prop[3] = 1, 0, 1, device
        h = u64()
        assert self.cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), prop, u64(0)) == 0
        return h.value

    def map(self, va: int, size: int, h: int) -> int:
        return self.cu.cuMemMap(u64(va), ctypes.c_size_t(size), ctypes.c_size_t(0), u64(h), u64(0))

    def access(self, va: int, size: int, device: int = 0) -> int:
        desc = (ctypes.c_int * 3)(1, device, 3)   # {location {device, id}, read-write}
        return self.cu.cuMemSetAccess(u64(va), ctypes.c_size_t(size), desc, ctypes.c_size_t(1))

    def unmap(self, va: int, size: int) -> int:
        return self.cu.cuMemUnmap(u64(va), ctypes.c_size_t(size))

    def release(self, h: int) -> int:
        return self.cu.cuMemRelease(u64(h))

    def free(self, va: int, size: int) -> int:
        return self.cu.cuMemAddressFree(u64(va), ctypes.c_size_t(size))

    def mapped(self, size: int):
        va, h = self.reserve(size), self.create(size)
        assert self.map(va, size, h) == 0 and self.access(va, size) == 0
        return va, h

    def clean(self, va: int, size: int, h: int) -> None:
        assert self.unmap(va, size) == 0 and self.release(h) == 0 and self.free(va, size) == 0


@pytest.fixture
def drv() -> Driver:
    return Driver()


def test_a_partial_unmap(fake, drv):
    va, h = drv.mapped(2 * G)
    fake.expected_violations = 1
    assert drv.unmap(va, G) != 0
    drv.clean(va, 2 * G, h)


def test_a_map_over_a_mapping_and_a_double_release(fake, drv):
    va, h = drv.mapped(G)
    h2 = drv.create(G)
    fake.expected_violations = 2
    assert drv.map(va, G, h2) != 0
    assert drv.release(h2) == 0 and drv.release(h2) != 0
    drv.clean(va, G, h)


def test_freeing_a_reservation_that_is_still_mapped(fake, drv):
    va, h = drv.mapped(G)
    fake.expected_violations = 1
    assert drv.free(va, G) != 0
    drv.clean(va, G, h)


def test_an_event_recorded_on_another_contexts_stream(fake, drv):
    other = CudaMemory(device=1)
    s1 = other.new_stream()
    drv.mem._current()
    e = ctypes.c_void_p()
    assert drv.cu.cuEventCreate(ctypes.byref(e), 2) == 0
    fake.expected_violations = 1
    assert drv.cu.cuEventRecord(e, ctypes.c_void_p(s1)) != 0
    assert drv.cu.cuEventDestroy_v2(e) == 0


def test_unmapping_memory_that_queued_work_uses(fake, drv):
    s = drv.mem.new_stream()
    va, h = drv.mapped(G)
    fake.hold(s)
    fake.use(s, va, 4096)
    fake.expected_violations = 1
    drv.clean(va, G, h)                  # the driver does it; the work would fault
    fake.hold(s, False)


def test_another_device_reading_memory_without_peer_access(fake, drv):
    va, h = drv.mapped(G)                # access for device 0 only
    other = CudaMemory(device=1)
    other._current()
    fake.expected_violations = 1
    with pytest.raises(ValueError):
        fake.use(0, va, 4096)            # a kernel of device 1
    drv.mem._current()
    desc = (ctypes.c_int * 6)(1, 0, 3, 1, 1, 3)   # devices 0 and 1, read-write
    assert drv.cu.cuMemSetAccess(u64(va), ctypes.c_size_t(G), desc, ctypes.c_size_t(2)) == 0
    other._current()
    fake.use(0, va, 4096)                # now granted
    drv.mem._current()
    drv.clean(va, G, h)


def test_memory_created_with_another_devices_context_current(fake, drv):
    other = CudaMemory(device=1)
    other._current()
    fake.expected_violations = 1
    with pytest.raises(AssertionError):
        drv.create(G, device=0)
    drv.mem._current()


def test_the_old_abi_names(fake, drv):
    n = ctypes.c_uint()
    fake.expected_violations = 2
    assert drv.cu.cuDeviceTotalMem(ctypes.byref(n), 0) != 0
    assert drv.cu.cuEventDestroy(ctypes.c_void_p(0)) != 0


def test_a_call_in_a_forked_child(fake, drv, tmp_path):
    report = tmp_path / "child.txt"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.environ["FAKECUDA_REPORT"] = str(report)   # not the run's report: this one is expected
        code = 1
        try:
            code = 0 if drv.cu.cuMemAddressFree(u64(0), ctypes.c_size_t(G)) != 0 else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "called in a forked child" in report.read_text()


def test_a_driver_shutting_down_answers_every_call_with_deinitialized(fake, drv):
    """fake.deinit(): every entry point returns CUDA_ERROR_DEINITIALIZED, changes nothing and
    records no violation (even for a misuse: that is the driver's state, not vmalloc's fault);
    revive() gives the driver back as it was."""
    va, h = drv.mapped(G)
    held = {k: fake.get(k) for k in ("reservations", "handles", "mappings", "events", "context_refs")}
    fake.deinit()
    assert fake.get("deinitialized") == 1
    for name in ENTRY_POINTS:
        fn = getattr(drv.cu, name + "_v2", None) or getattr(drv.cu, name)
        # the fake answers before it reads an argument, so zeros stand for every signature
        assert fn(*[ctypes.c_uint64(0)] * 6) == CUDA_ERROR_DEINITIALIZED, name
    assert drv.unmap(va, G) == drv.release(h) == drv.unmap(va + G, G) == CUDA_ERROR_DEINITIALIZED
    s = ctypes.c_char_p()
    assert drv.cu.cuGetErrorString(CUDA_ERROR_DEINITIALIZED, ctypes.byref(s)) == CUDA_ERROR_DEINITIALIZED
    assert {k: fake.get(k) for k in held} == held
    fake.revive()
    assert drv.cu.cuGetErrorName(CUDA_ERROR_DEINITIALIZED, ctypes.byref(s)) == 0
    assert s.value == b"CUDA_ERROR_DEINITIALIZED"
    drv.clean(va, G, h)
    fake.deinit()
    fake.disarm()                       # undoes deinit() too
    assert fake.get("deinitialized") == 0


def test_reclaim_takes_what_was_made_after_the_serial(fake, drv):
    """What a test that shut the driver down leaked, the fake destroys as the driver does at exit."""
    old_va, old_h = drv.mapped(G)
    held = {k: fake.get(k) for k in ("reservations", "handles", "mappings", "committed_bytes", "events",
                                     "streams")}
    mark = fake.serial()
    drv.mapped(2 * G)
    drv.mem.new_stream()
    e = ctypes.c_void_p()
    assert drv.cu.cuEventCreate(ctypes.byref(e), 2) == 0
    assert fake.reclaim(mark) == 5      # reservation, handle, mapping, stream, event
    assert {k: fake.get(k) for k in held} == held
    drv.clean(old_va, G, old_h)         # older objects are untouched
