"""CUDA graph capture and ``torch.cuda.use_mem_pool`` under ``vmalloc.enable()`` are refused
loudly. Both ask the allocator for a private pool (``beginAllocateToPool``), which PyTorch's
pluggable allocator silently skips when no hook is set: vmalloc would then serve a graph's
allocations from its shared cache, and a replay could write into other tensors. vmalloc's hook
(``vmalloc_torch_begin_allocate_to_pool``) throws, and PyTorch calls it before capture begins.

On the CPU: the entry point is called from C++ with PyTorch's own argument types (a small
library built here), and ``enable()``'s wiring hands it to PyTorch. On a GPU: capture and
``use_mem_pool`` raise ``RuntimeError``, and the allocator keeps working."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from _cxx import build_library
from _subproc import python_env
from vmalloc import _core
from vmalloc.pluggable import register
from vmalloc.pluggable.registry import HOOKS

CALLER = r"""
#include <dlfcn.h>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <utility>

// PyTorch's FuncType for set_begin_allocate_to_pool (torch/csrc/cuda/Module.cpp), with
// cudaStream_t as void*: void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)
using Hook = void (*)(int, std::pair<unsigned long long, unsigned long long>,
                      std::function<bool(void*)>);

extern "C" int begin_pool(const char* core_so, char* out, size_t n) {
  void* h = dlopen(core_so, RTLD_NOW | RTLD_NOLOAD);
  if (!h) { std::snprintf(out, n, "dlopen: %s", dlerror()); return -1; }
  auto hook = reinterpret_cast<Hook>(dlsym(h, "vmalloc_torch_begin_allocate_to_pool"));
  if (!hook) { std::snprintf(out, n, "dlsym failed"); return -1; }
  try {
    hook(3, {7, 0}, [](void*) { return true; });
  } catch (const std::runtime_error& e) {
    std::snprintf(out, n, "%s", e.what());
    return 1;
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    so = build_library(tmp_path_factory.mktemp("pool"), "begin_pool", CALLER)
    so.begin_pool.restype = ctypes.c_int
    so.begin_pool.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    return so


def test_the_hook_refuses_with_the_device_the_pool_and_the_way_out(caller):
    buf = ctypes.create_string_buffer(2048)
    code = caller.begin_pool(os.fsencode(_core.__file__), buf, len(buf))
    msg = buf.value.decode()
    assert code == 1, msg
    for part in ("private memory pool", "GPU 3", "(7, 0)", "CUDA graph", "use_mem_pool",
                 "VMALLOC=0"):
        assert part in msg, (part, msg)


def test_enable_wires_the_hook():
    class Raw:   # the setters of torch._C._CUDAPluggableAllocator
        def __init__(self):
            self.got = {}

        def __getattr__(self, name):
            if name.startswith("set_"):
                return lambda address: self.got.__setitem__(name, address)
            raise AttributeError(name)

    raw = Raw()
    register._wire_hooks(_core, raw)
    assert raw.got["set_begin_allocate_to_pool"] == \
        _core._torch_entry_points()["vmalloc_torch_begin_allocate_to_pool"]
    assert set(raw.got) == set(HOOKS)


# Each request must raise. vmalloc's hook or PyTorch's own refusal may come first (recent
# PyTorch creates a pool for a capture without one, which a pluggable allocator cannot), so any
# RuntimeError passes; the messages are printed for the GPU session's log. A capture into a pool
# from graph_pool_handle() skips that creation: only vmalloc's hook stops it.
GPU_CASE = """
    import faulthandler; faulthandler.dump_traceback_later(120, exit=True)  # a hang: stacks
    import torch, vmalloc
    vmalloc.enable()
    x = torch.ones(1 << 20, device="cuda")

    def refused(what, start):
        try:
            start()
        except RuntimeError as e:
            print(f"{what}: refused: {e}".splitlines()[0])
            return
        raise AssertionError(f"{what} was not refused under vmalloc")

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        refused("capture", lambda: torch.cuda.CUDAGraph().capture_begin())
        refused("capture into graph_pool_handle()",
                      lambda: torch.cuda.CUDAGraph().capture_begin(torch.cuda.graph_pool_handle()))

    # refused on entry, before torch.cuda.graph makes its side stream current: a caller that
    # catches the error goes on on its own stream
    before = torch.cuda.current_stream()
    refused("torch.cuda.graph", lambda: torch.cuda.graph(torch.cuda.CUDAGraph()).__enter__())
    assert torch.cuda.current_stream() == before, "left on the graph's side stream"

    def use_pool():
        with torch.cuda.use_mem_pool(torch.cuda.MemPool()):
            pass
    refused("use_mem_pool", use_pool)
    y = x * 2                      # vmalloc still serves the process
    torch.cuda.synchronize()
    assert float(y.sum()) == 2 * (1 << 20)
    print("OK")
"""


@pytest.mark.gpu
def test_graph_capture_and_use_mem_pool_are_refused_on_a_gpu(tmp_path):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(GPU_CASE)], env=python_env(),
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=135)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
