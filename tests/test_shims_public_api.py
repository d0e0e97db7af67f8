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
