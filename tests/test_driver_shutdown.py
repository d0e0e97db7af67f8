"""The CUDA driver shutting down under a live allocator. At process exit the CUDA runtime's
teardown can run while PyTorch still frees tensors (C++ statics, thread-locals, late garbage
collection); every driver call then returns CUDA_ERROR_DEINITIALIZED. free, close and the
destructor stay quiet (the driver takes the memory with it: not one stderr line, checked at the
file-descriptor level), malloc / trim / record_stream raise DriverShutDownError.

The fake_cuda tests run on the fake libcuda (tests/test_fake_cuda.py), whose fake.deinit() puts
the driver in that state; tests/conftest.py revives it after each test.
"""
from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys

import pytest

from _subproc import python_env
from fake_cuda import CUDA_ERROR_DEINITIALIZED
from test_alloc_memory import CudaMemory
from test_cuda_driver_contract import held_by_driver
from vmalloc import Allocator, DriverShutDownError, _core

KiB, MiB = 1 << 10, 1 << 20
G = 2 * MiB  # the fake's granularity
SHUTTING_DOWN = "the CUDA driver is shutting down"


def torch_entry_points():
    ep = _core._torch_entry_points()
    malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ep["vmalloc_torch_malloc"])
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ep["vmalloc_torch_free"])
    record = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(ep["vmalloc_torch_record_stream"])
    return malloc, free, record


@pytest.fixture
def mem() -> CudaMemory:
    return CudaMemory()  # retains device 0's primary context and makes it current here


@pytest.mark.fake_cuda
@pytest.mark.parametrize("nbytes", [3 * G, 4 * KiB], ids=["range", "small-block"])
def test_free_after_shutdown_is_silent_and_keeps_the_books(fake, mem, capfd, nbytes):
    """A block used on a second stream: its free records events, which the shut-down driver
    refuses. The free returns quietly and leaves the block live (leaked to the driver): the books
    stay consistent, as a driver that answers again (only a fake does) shows."""
    before = held_by_driver(fake)
    s1, s2 = mem.new_stream(), mem.new_stream()
    a = Allocator("cuda", chunk_size=G, small_threshold=MiB)
    p = a.malloc(nbytes, stream=s1)
    a.record_stream(p, s2)
    stats = a.stats()
    capfd.readouterr()
    fake.deinit()
    calls = fake.get("calls")
    a.free(p)
    assert fake.get("calls") > calls, "the free made no driver call: the test tested nothing"
    assert capfd.readouterr().err == ""
    assert a.stats() == stats            # still live: nothing counted as freed or reusable
    fake.revive()
    a.free(p)
    assert a.stats()["num_live"] == 0
    a.close()
    held = held_by_driver(fake)
    held["streams"] -= 2
    assert held == before


@pytest.mark.fake_cuda
def test_torch_free_after_shutdown_is_silent(fake, mem, capfd):
    """PyTorch's free entry point (a DataPtr deleter at exit) on a tensor recorded on a second
    stream: no stderr line, no crash."""
    _core._torch_configure("cuda", G, 0, -1)
    malloc, free, record = torch_entry_points()
    s = mem.new_stream()
    p = malloc(5 * MiB, 0, s)
    record(p, mem.new_stream())
    a = _core._torch_allocator(0)
    capfd.readouterr()
    fake.deinit()
    calls = fake.get("calls")
    free(p, 5 * MiB, 0, s)
    assert fake.get("calls") > calls
    assert capfd.readouterr().err == ""
    fake.revive()
    assert a.allocation_size(p) == 5 * MiB   # left to the driver, the books kept
    free(p, 5 * MiB, 0, s)
    assert a.allocation_size(p) == 0
    _core._torch_trim()                  # the registry lives on: leave it holding nothing


def busy_allocator(mem: CudaMemory, fake) -> Allocator:
    """An allocator holding a live range, a live small block, a range cached behind an event
    still pending on a held stream, and a deferred small block."""
    s, s2 = mem.new_stream(), mem.new_stream()
    a = Allocator("cuda", chunk_size=G, small_threshold=MiB)
    a.malloc(3 * G, stream=s)
    a.malloc(4 * KiB, stream=s)
    cached, deferred = a.malloc(2 * G, stream=s), a.malloc(8 * KiB, stream=s)
    a.record_stream(deferred, s2)
    fake.hold(s)
    a.free(cached)
    a.free(deferred)
    return a


@pytest.mark.fake_cuda
def test_close_after_shutdown_is_silent(fake, mem, capfd):
    mark, before = fake.serial(), held_by_driver(fake)
    a = busy_allocator(mem, fake)
    capfd.readouterr()
    fake.deinit()
    calls = fake.get("calls")
    a.close()
    assert a.closed
    a.close()
    assert fake.get("calls") > calls     # it tried each call (quietly)
    with pytest.raises(DriverShutDownError, match=SHUTTING_DOWN):
        Allocator("cuda", chunk_size=G)  # a new one cannot even start
    assert capfd.readouterr().err == ""
    fake.revive()
    # what the real driver takes with it at exit: everything the allocator made, and its
    # reference to the primary context (mem's own keeps the context alive)
    assert fake.reclaim(mark) > 0
    assert mem.cu.cuDevicePrimaryCtxRelease_v2(0) == 0
    assert held_by_driver(fake) == before


@pytest.mark.fake_cuda
def test_the_destructor_after_shutdown_is_silent(fake, mem, capfd):
    mark, before = fake.serial(), held_by_driver(fake)
    a = busy_allocator(mem, fake)
    capfd.readouterr()
    fake.deinit()
    calls = fake.get("calls")
    del a
    gc.collect()
    assert fake.get("calls") > calls     # the destructor ran, and tried
    assert capfd.readouterr().err == ""
    fake.revive()
    fake.reclaim(mark)
    assert mem.cu.cuDevicePrimaryCtxRelease_v2(0) == 0
    assert held_by_driver(fake) == before


@pytest.mark.fake_cuda
def test_malloc_after_shutdown_raises_the_clear_error(fake, mem):
    before = held_by_driver(fake)
    s = mem.new_stream()
    a = Allocator("cuda", chunk_size=G, small_threshold=MiB)
    a.free(a.malloc(3 * G))              # cached: its reuse needs no driver call
    q = a.malloc(4 * KiB)
    fake.deinit()
    with pytest.raises(DriverShutDownError, match=SHUTTING_DOWN) as err:
        a.malloc(5 * G)                  # new chunks: cuMemCreate answers the shutdown
    assert not isinstance(err.value, MemoryError)   # not an OutOfMemoryError
    # once vmalloc has seen it, neither the cache nor a slab serves a request: their memory
    # goes with the driver
    for call in (lambda: a.malloc(3 * G), lambda: a.malloc(100), lambda: a.trim(),
                 lambda: a.record_stream(q, s)):
        with pytest.raises(DriverShutDownError, match=SHUTTING_DOWN):
            call()
    assert a.stats()["num_live"] == 1
    fake.revive()
    a.free(a.malloc(3 * G))              # consistent: it works again once the driver answers
    a.free(q)
    a.close()
    held = held_by_driver(fake)
    held["streams"] -= 1
    assert held == before


@pytest.mark.fake_cuda
def test_a_shutdown_at_the_address_reservation_is_not_out_of_memory(fake, mem):
    """The shutdown arriving between the chunks' creation and the address reservation: the
    reservation's failure means "out of address space" otherwise, here it is the shutdown."""
    before = held_by_driver(fake)
    with Allocator("cuda", chunk_size=G) as a:
        fake.inject("cuMemAddressReserve", 1, CUDA_ERROR_DEINITIALIZED)
        with pytest.raises(DriverShutDownError, match="cuMemAddressReserve returned CUDA_ERROR_DEINITIALIZED"):
            a.malloc(3 * G)
        assert a.stats()["physical_current"] == 3 * G   # the chunks it made wait in the pool
        a.free(a.malloc(3 * G))          # the driver answers again: they serve the next malloc
    assert held_by_driver(fake) == before


def test_torch_free_of_a_pointer_no_vmalloc_allocator_made(capfd):
    """vmalloc_torch_free on a device the registry has no allocator for (another allocator's
    pointer, a wrong device): one stderr line naming the pointer and the device, not a crash."""
    _, free, _ = torch_entry_points()
    assert 63 not in _core._torch_devices()
    free(0x1234, 8, 63, None)
    err = capfd.readouterr().err
    assert "free(0x1234) on device 63" in err and "no allocator for device 63" in err


def test_failed_frees_are_said_three_times_then_counted(tmp_path):
    """A sticky CUDA error fails every later free: three lines in full, then the count at 10,
    100, ... (one line per tensor would bury the error that matters). In a fresh process: the
    count is the process's."""
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from test_driver_shutdown import torch_entry_points\n"
            "_, free, _ = torch_entry_points()\n"
            "for _ in range(120): free(0x1234, 8, 64, None)  # not a device vmalloc can have\n"
            % os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=python_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 5, r.stderr
    assert all("free(0x1234) on device 64 failed: vmalloc: device 64 out of range" in x
               for x in lines[:3])
    assert "further failed frees are counted" in lines[2]
    assert lines[3].startswith("vmalloc: 10 frees have failed (the last: free(0x1234) on device 64")
    assert lines[4].startswith("vmalloc: 100 frees have failed")
