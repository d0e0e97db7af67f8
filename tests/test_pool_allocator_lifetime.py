"""vmalloc.pool()'s CUDAPluggableAllocator outlives the block. A torch.cuda.MemPool keeps only a
raw pointer to its allocator (torch/csrc/cuda/MemPool.cpp: no keep_alive) and PyTorch frees the
pool's segments through it after the block too (tensors made inside outlive it; empty_cache()
or the MemPool's destructor release their segments later): an allocator local to pool() was
destroyed at the end of the block, and those frees ran on a freed object. Driven without a GPU:
PyTorch's CUDA classes are stand-ins that record what pool() hands them."""
import subprocess
import sys

import pytest

from _subproc import python_env

pytest.importorskip("vmalloc._core")
pytest.importorskip("torch")

SCRIPT = r"""
import contextlib, gc, types, weakref
import torch, vmalloc
from vmalloc import torch_allocator as ta

made, pools, hooks = [], [], []

class Raw:   # what CUDAPluggableAllocator.allocator() returns: the C++ object's binding
    def __getattr__(self, name):
        if name.startswith("set_"):
            return lambda fn: hooks.append(name)
        raise AttributeError(name)

class PluggableAllocator:
    def __init__(self, path, alloc_fn, free_fn):
        assert (alloc_fn, free_fn) == ("vmalloc_torch_malloc_pool", "vmalloc_torch_free")
        self._raw = Raw()
        made.append(weakref.ref(self))
    def allocator(self):
        return self._raw

class MemPool:   # like torch's: keeps the raw allocator, not the Python object owning it
    def __init__(self, raw):
        pools.append(raw)

@contextlib.contextmanager
def use_mem_pool(pool, device=None):
    yield

torch._C._cuda_customAllocator = lambda *a: None
torch.cuda.is_available = lambda: True
torch.cuda._is_compiled, torch.cuda._device_count_nvml = (lambda: True), (lambda: 1)
torch.cuda.memory.CUDAPluggableAllocator = PluggableAllocator
torch.cuda.MemPool, torch.cuda.use_mem_pool = MemPool, use_mem_pool

for budget in ("64MiB", None):
    with vmalloc.pool(budget=budget):
        pass
gc.collect()
assert len(made) == 1, f"{len(made)} allocators for two pools"
alive = made[0]()
assert alive is not None, "pool()'s allocator was freed after the block; its MemPool still uses it"
assert pools == [alive.allocator()] * 2
assert ta.registry().pool_allocator is alive
from vmalloc.pluggable.registry import HOOKS
assert sorted(hooks) == sorted(HOOKS), hooks   # every hook, wired once
print("OK")
"""


def test_pool_allocator_lives_for_the_process(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=120, env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK"), r.stdout
