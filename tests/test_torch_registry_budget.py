"""The per-device registry behind PyTorch's entry points: configuring it again (a second
``vmalloc.pool(budget=...)``) must reach the allocators it already made, not only later ones."""
import subprocess
import sys

from _subproc import python_env

SCRIPT = r"""
import ctypes
from vmalloc import torch_allocator as ta
core = ta._core()
C = 64 << 10
core._torch_configure("host", C, 0, -1)           # a first pool(): no budget
lib = ctypes.CDLL(core.__file__)
malloc = lib.vmalloc_torch_malloc_pool
malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
free = lib.vmalloc_torch_free
free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
free(malloc(C, 0, None), C, 0, None)              # device 0's allocator now exists
core._torch_configure("host", C, 4 * C, -1)       # a second pool(budget=4 chunks)
a = core._torch_allocator(0)
assert a.budget == 4 * C, a.budget
assert malloc(8 * C, 0, None) is None             # over the budget: null (pool mode)
core._torch_configure("host", C, 0, 0)            # pool(budget=None, device=0): no cap again
assert a.budget == 0, a.budget
p = malloc(8 * C, 0, None)
assert p, "no cap: 8 chunks fit"
free(p, 8 * C, 0, None)
print("OK")
"""


def test_configuring_again_reaches_the_existing_allocators(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=120, env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
