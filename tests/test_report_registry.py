"""The per-device registry behind PyTorch's entry points, driven on the host backend (no GPU):
the exported C functions, vmalloc.stats(), the torch._C stats shims and the snapshot history."""
import subprocess
import sys

import pytest

from _subproc import HOST_REGISTRY, TORCH_ENTRY_POINTS, python_env

pytest.importorskip("vmalloc._core")

SCRIPT = TORCH_ENTRY_POINTS + r"""
from vmalloc.replay import from_snapshot

MiB = 1 << 20
lib.vmalloc_torch_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
assert set(core._torch_entry_points()) == {"vmalloc_torch_malloc", "vmalloc_torch_malloc_pool",
    "vmalloc_torch_free",
    "vmalloc_torch_record_stream", "vmalloc_torch_empty_cache", "vmalloc_torch_memory_fraction",
    "vmalloc_torch_init", "vmalloc_torch_begin_allocate_to_pool"}

assert ta.stats(3)["requested_current"] == 0            # a device that allocated nothing yet
assert malloc(0, 0, None) is None                        # empty tensors get nullptr
free(None, 0, 0, None)                                   # and freeing it is a no-op

# fake torch: the shims patch torch._C entry points
fake_C = types.SimpleNamespace(_cuda_memoryStats=None, _cuda_resetPeakMemoryStats=None,
    _cuda_resetAccumulatedMemoryStats=None, _cuda_memorySnapshot=None,
    _cuda_record_memory_history=None)
ta.install_shims(types.SimpleNamespace(_C=fake_C))
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

# vmalloc.pool()'s entry point: null past the budget, and no pressure callback (PyTorch holds its
# allocator mutex there; the callback would take the GIL)
pool_malloc = lib.vmalloc_torch_malloc_pool
pool_malloc.restype, pool_malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
core._torch_set_budget(1, 128 << 10)
a1 = core._torch_allocator(1, True)
calls = []
a1.set_pressure_callback(lambda need: calls.append(need) or False)
r = pool_malloc(64 << 10, 1, None)
assert r
assert pool_malloc(1 * MiB, 1, None) is None
assert calls == [] and a1.stats()["num_oom"] == 1 and a1.stats()["num_pressure_calls"] == 0
free(r, 64 << 10, 1, None)
a1.set_pressure_callback(None)

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
# one (empty) trace per device that has an allocator (0 and 1 here), as PyTorch lists them
assert fake_C._cuda_memorySnapshot(None)["device_traces"] == [[], []]
print("OK")
"""


def test_registry_entry_points_and_shims_on_the_host_backend(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                       env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK")
    assert "not a live allocation" in r.stderr or "0x1234" in r.stderr


SHIMS = HOST_REGISTRY + r"""
import types, warnings
import torch

a = core._torch_allocator(0, True)
total = a.total_memory
torch.cuda.get_device_properties = lambda d: types.SimpleNamespace(total_memory=total)
torch.backends.cudnn.benchmark = True            # set before vmalloc: turned off, with a warning
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ta.install_shims(torch)
    assert torch.backends.cudnn.benchmark is False
    torch.backends.cudnn.benchmark = True
    assert torch.backends.cudnn.benchmark is False
    with torch.backends.cudnn.flags(enabled=True, benchmark=True):
        assert torch.backends.cudnn.benchmark is False
assert any("cacheInfo" in str(x.message) for x in w), [str(x.message) for x in w]

C = torch._C
# torch.cuda.get_per_process_memory_fraction
assert C._cuda_getMemoryFraction(0) == 1.0                # no budget
core._torch_set_budget(0, total // 4)
assert abs(C._cuda_getMemoryFraction(0) - 0.25) < 1e-6

# torch.accelerator.memory_* (torch >= 2.8) read these entry points at call time
assert C._accelerator_isAllocatorInitialized()
p = a.malloc(3 << 20, 0)
st = C._accelerator_getDeviceStats(0)
assert st["allocated_bytes"]["all"]["current"] == 3 << 20
assert all(not isinstance(v, str) for v in st.values())   # memory_stats() flattens numbers only
a.free(p)
assert a.stats()["physical_current"] > 0
C._accelerator_emptyCache()                               # torch.accelerator.empty_cache()
assert a.stats()["physical_current"] == 0
C._accelerator_resetPeakStats(0)
assert a.stats()["physical_peak"] == 0
if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "memory_allocated"):
    import torch.accelerator.memory as am
    am._get_device_index = lambda d, optional=True: 0     # no CUDA here: pin the device index
    assert torch.accelerator.memory_allocated(0) == 0
    assert torch.accelerator.memory_stats(0)["num_device_alloc"] == a.stats()["num_map"]
print("OK")
"""


def test_shims_for_fraction_accelerator_and_cudnn_benchmark(tmp_path):
    r = subprocess.run([sys.executable, "-c", SHIMS], capture_output=True, text=True, timeout=120,
                       env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK")


def test_pool_without_cuda_says_so():
    pytest.importorskip("torch")
    import torch
    import vmalloc
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="vmalloc.pool: .*(without CUDA|no CUDA device)"):
        with vmalloc.pool():
            pass


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
