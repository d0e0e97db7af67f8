"""The per-device registry behind PyTorch's entry points, driven on the host backend (no GPU):
the exported C functions, vmalloc.stats(), the torch._C stats shims and the snapshot history."""
import subprocess
import sys

import pytest

from _subproc import python_env

pytest.importorskip("vmalloc._core")

SCRIPT = r"""
import ctypes, types
import vmalloc
from vmalloc import torch_allocator as ta
from vmalloc.replay import from_snapshot

MiB = 1 << 20
core = ta._core()
core._torch_configure("host", 64 << 10, 0, -1)     # what enable() does, on the host backend
reg = ta.registry()
reg.mode, reg.config = "global", {"chunk_size": 64 << 10, "budget": 0, "device": None}

lib = ctypes.CDLL(core.__file__)
malloc = lib.vmalloc_torch_malloc
malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
free = lib.vmalloc_torch_free
free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.vmalloc_torch_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
assert set(core._torch_entry_points()) == {"vmalloc_torch_malloc", "vmalloc_torch_free",
    "vmalloc_torch_record_stream", "vmalloc_torch_empty_cache", "vmalloc_torch_memory_fraction",
    "vmalloc_torch_init"}

assert ta.stats(3)["requested_current"] == 0            # a device that allocated nothing yet
assert malloc(0, 0, None) is None                        # empty tensors get nullptr
free(None, 0, 0, None)                                   # and freeing it is a no-op

# fake torch: the shims patch torch._C entry points
fake_C = types.SimpleNamespace(_cuda_memoryStats=None, _cuda_resetPeakMemoryStats=None,
    _cuda_resetAccumulatedMemoryStats=None, _cuda_memorySnapshot=None,
    _cuda_record_memory_history=None)
ta._install_shims(types.SimpleNamespace(_C=fake_C))
fake_C._cuda_record_memory_history("all", "all", "all", 1000)

p = malloc(3 * MiB, 0, ctypes.c_void_p(5))
q = malloc(1000, 0, None)
assert p and q
lib.vmalloc_torch_record_stream(p, ctypes.c_void_p(7))   # used on another stream
s = vmalloc.stats(0)
assert s["requested_current"] == 3 * MiB + 1000, s
assert s["mapped_current"] - s["requested_current"] < 2 * (64 << 10)     # Eq. 1, two allocations
nested = fake_C._cuda_memoryStats(0)
assert nested["allocated_bytes"]["all"]["current"] == 3 * MiB + 1000
assert nested["reserved_bytes"]["all"]["current"] == s["physical_current"]
assert nested["allocation"]["all"]["current"] == 2
assert nested["num_device_alloc"] == s["num_map"]
free(p, 3 * MiB, 0, ctypes.c_void_p(5))
free(q, 1000, 0, None)
free(ctypes.c_void_p(0x1234), 8, 0, None)                # unknown pointer: reported, no crash
assert ta.devices() == [0]
assert vmalloc.stats(0)["requested_current"] == 0
lib.vmalloc_torch_empty_cache()                           # torch.cuda.empty_cache()
assert vmalloc.stats(0)["physical_current"] == 0

# torch.cuda.set_per_process_memory_fraction(0.5, 0) -> a budget of half the memory
lib.vmalloc_torch_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
lib.vmalloc_torch_memory_fraction(0.5, 0)
total = core._torch_allocator(0).total_memory
assert vmalloc.stats(0)["budget"] == int(0.5 * total), (vmalloc.stats(0)["budget"], total)

snap = fake_C._cuda_memorySnapshot(None)
acts = [e["action"] for e in snap["device_traces"][0]]
assert acts == ["alloc", "alloc", "free_requested", "free_completed",
                "free_requested", "free_completed"], acts
t = from_snapshot(snap)
assert [(e.action, e.size) for e in t.events] == [("alloc", 3 * MiB), ("alloc", 1000),
                                                  ("free", 3 * MiB), ("free", 1000)]
rep = vmalloc.report(format="json")
assert rep["source"] == "vmalloc" and rep["histogram"] and rep["fragmentation"]["n_max"] == 2
assert rep["fragmentation"]["bound_eq2"] == 2 * (64 << 10)
fake_C._cuda_resetPeakMemoryStats(0)                      # torch.cuda.reset_peak_memory_stats()
s = vmalloc.stats(0)
assert s["physical_peak"] == s["physical_current"] and s["requested_peak"] == s["requested_current"]
fake_C._cuda_record_memory_history(None)
assert fake_C._cuda_memorySnapshot(None)["device_traces"] in ([], [[]])
print("OK")
"""


def test_registry_entry_points_and_shims_on_the_host_backend(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                       env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK")
    assert "not a live allocation" in r.stderr or "0x1234" in r.stderr


def test_torch_memory_stats_mapping():
    from vmalloc.torch_allocator import torch_memory_stats
    s = {"requested_current": 10, "requested_peak": 20, "physical_current": 64, "physical_peak": 128,
         "num_malloc": 5, "num_free": 3, "num_map": 4, "num_unmap": 2, "chunk_size": 32,
         "num_oom": 1, "small_requested_current": 4}
    n = torch_memory_stats(s)
    assert n["allocated_bytes"]["all"] == {"current": 10, "peak": 20, "allocated": 0, "freed": 0}
    assert n["allocated_bytes"]["small_pool"]["current"] == 4
    assert n["reserved_bytes"]["all"]["peak"] == 128 and n["segment"]["all"]["current"] == 2
    assert n["allocation"]["all"]["current"] == 2 and n["num_ooms"] == 1
