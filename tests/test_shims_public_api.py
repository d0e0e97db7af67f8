"""The public PyTorch memory API the GPU tests call (tests/test_torch_gpu.py) answered by
vmalloc's shims, through the installed torch's own Python functions: ``torch.cuda.memory_allocated``
& co., ``reset_peak_memory_stats``, ``memory._record_memory_history`` (its keyword arguments
reach the shim positionally: ``clear_history`` is the fourth after ``enabled`` in torch 2.11 -
2.13), ``memory._dump_snapshot`` and ``memory_snapshot``. test_report_registry.py calls the
``torch._C`` entry points directly; this catches a torch whose public functions call them
differently (no GPU: the host backend stands in, CUDA is reported initialised on device 0)."""
import subprocess
import sys

import pytest

from _subproc import HOST_REGISTRY, python_env

pytest.importorskip("vmalloc._core")
pytest.importorskip("torch")

SCRIPT = HOST_REGISTRY + r"""
import pickle, sys
import torch, torch.cuda.memory as M

a = core._torch_allocator(0, True)
ta.install_shims(torch)
# no GPU here: the functions below see CUDA initialised, on device 0
M.is_initialized = lambda: True
M._get_device_index = lambda d, optional=False: 0 if d is None else int(getattr(d, "index", d) or 0)

M._record_memory_history(max_entries=1000)
p = a.malloc(3 << 20, 0)
q = a.malloc(1000, 0)
s = a.stats()
why = (dict(torch.cuda.memory_stats()), s)
assert torch.cuda.memory_allocated() == (3 << 20) + 1000, why
assert torch.cuda.memory_reserved() == s["physical_current"] >= 3 << 20, why
assert torch.cuda.max_memory_allocated() == (3 << 20) + 1000, why
assert torch.cuda.memory_stats()["num_device_alloc"] == s["num_map"], why
# every value is a number, as torch documents (loggers pass the dict on as metrics)
assert all(isinstance(v, int) for v in torch.cuda.memory_stats().values()), why
from vmalloc.pluggable.registry import device_index
assert device_index("cuda:0") == device_index(torch.device("cuda", 0)) == device_index(0) == 0
a.free(p)
torch.cuda.reset_peak_memory_stats()
assert torch.cuda.max_memory_allocated() == 1000, dict(torch.cuda.memory_stats())

path = sys.argv[1]
M._dump_snapshot(path)                       # _snapshot() -> _cuda_memorySnapshot(None)
snap = pickle.load(open(path, "rb"))
acts = [e["action"] for e in snap["device_traces"][0]]
assert acts == ["alloc", "alloc", "free_requested", "free_completed"], acts
assert [b["requested_size"] for b in snap["segments"]] == [1000], snap["segments"]
assert torch.cuda.memory_snapshot() == snap["segments"]     # (0, 0, include_traces) -> segments
M._record_memory_history(max_entries=1000, clear_history=True)   # passed positionally: 4th
assert M._snapshot()["device_traces"] in ([], [[]]), M._snapshot()["device_traces"]
M._record_memory_history(enabled=None)
a.free(q)
assert torch.cuda.memory_allocated() == 0
print("OK")
"""


def test_public_memory_api_reaches_the_shims(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "s.pickle")],
                       capture_output=True, text=True, timeout=120, env=python_env(),
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK"), r.stdout


STATS = HOST_REGISTRY + r"""
import torch, torch.cuda.memory as M

a = core._torch_allocator(0, True)
ta.install_shims(torch)
M.is_initialized = lambda: True
M._get_device_index = lambda d, optional=False: 0 if d is None else int(getattr(d, "index", d) or 0)
C = 64 << 10
ps = [a.malloc(3000, 0), a.malloc(3 << 20, 0), a.malloc(100, 0)]    # small, large, small
for p in ps[:2]:
    a.free(p)
s, st = a.stats(), torch.cuda.memory_stats()
why = (s, dict(st))
# the counts vmalloc keeps, per pool (c10's allocated/freed = cumulative increments/decrements)
for pool, cur, alloc, freed in (("all", 1, 3, 2), ("small_pool", 1, 2, 1), ("large_pool", 0, 1, 1)):
    for stat in ("allocation", "active"):
        got = [st[f"{stat}.{pool}.{k}"] for k in ("current", "allocated", "freed")]
        assert got == [cur, alloc, freed], (stat, pool, got, why)
assert st["reserved_bytes.all.allocated"] == s["num_chunks_created"] * C, why
assert st["reserved_bytes.all.freed"] == s["num_chunks_released"] * C, why
assert st["segment.all.allocated"] == s["num_chunks_created"], why
assert st["segment.all.peak"] == s["physical_peak"] // C, why
# the small-block slab: 64 KiB reserved in the small pool is one segment there
assert st["reserved_bytes.small_pool.current"] == C and st["segment.small_pool.current"] == 1, why
assert st["segment.large_pool.current"] == st["segment.all.current"] - 1, why
assert st["allocated_bytes.all.peak"] == s["requested_peak"] == (3 << 20) + 3100, why
assert st["allocated_bytes.small_pool.current"] == 100, why
# figures vmalloc does not keep are 0, never a copy of current passing for a peak
for k in ("allocated_bytes.large_pool.peak", "reserved_bytes.large_pool.peak",
          "reserved_bytes.small_pool.peak", "allocation.all.peak", "active.all.peak",
          "allocated_bytes.all.allocated"):
    assert st[k] == 0, (k, why)
assert "Allocations" in torch.cuda.memory_summary()       # renders: every key, all ints
print("OK")
"""


def test_memory_stats_report_the_counts_and_peaks_vmalloc_keeps(tmp_path):
    r = subprocess.run([sys.executable, "-c", STATS], capture_output=True, text=True,
                       timeout=120, env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
