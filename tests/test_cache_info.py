"""cuDNN's autotuner (cudnn.benchmark) asks the current CUDA allocator's cacheInfo for its largest
free block; PyTorch's pluggable allocator raises there, and vmalloc answers it by giving its
allocator object a copy of CUDAPluggableAllocator's vtable (csrc/bind/torch_cache_info.cpp).

On the CPU the whole mechanism runs against two small libraries built here under PyTorch's names
(``libc10_cuda.so`` with the current-allocator global, ``libtorch_cuda.so`` with a class
``torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator`` whose cacheInfo throws), called
by a virtual call the compiler lays out. The same against the real libtorch_cuda (torch with CUDA,
no device needed) where it is installed: `scripts/gpu-stack-tests` and the GPU machines."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _cxx import build_library
from _subproc import HOST_REGISTRY, python_env
from vmalloc import Allocator

MiB = 1 << 20

# PyTorch's names, PyTorch's shapes: DeviceIndex is int8_t; cacheInfo sits between other
# virtuals, so its slot is not the first; the destructor is virtual.
FAKE_C10_CUDA = r"""
#include <atomic>
namespace c10 { namespace cuda { namespace CUDACachingAllocator {
std::atomic<void*> allocator{nullptr};
} } }
"""

FAKE_TORCH_CUDA = r"""
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
namespace c10 {
using DeviceIndex = int8_t;
namespace cuda { namespace CUDACachingAllocator { extern std::atomic<void*> allocator; } }
}
extern "C" int destroyed;
namespace torch { namespace cuda { namespace CUDAPluggableAllocator {
struct Base {
  virtual ~Base();
  virtual void* raw_alloc(size_t n);
};
Base::~Base() {}
void* Base::raw_alloc(size_t) { return nullptr; }

class CUDAPluggableAllocator : public Base {
 public:
  ~CUDAPluggableAllocator() override;
  void* raw_alloc(size_t n) override;
  virtual void emptyCache();
  virtual void cacheInfo(c10::DeviceIndex device, size_t* largestBlock);
  virtual int recordStream();
};
CUDAPluggableAllocator::~CUDAPluggableAllocator() { ++destroyed; }
void* CUDAPluggableAllocator::raw_alloc(size_t) { return nullptr; }
void CUDAPluggableAllocator::emptyCache() {}
void CUDAPluggableAllocator::cacheInfo(c10::DeviceIndex, size_t*) {
  throw std::runtime_error("CUDAPluggableAllocator does not yet support cacheInfo");
}
int CUDAPluggableAllocator::recordStream() { return 42; }

struct Derived : CUDAPluggableAllocator {};   // not what vmalloc.enable() installs
} } }

using torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using torch::cuda::CUDAPluggableAllocator::Derived;
namespace cur = c10::cuda::CUDACachingAllocator;

extern "C" {
int destroyed = 0;   // destructor calls
void make_current(int derived) {
  cur::allocator.store(derived ? new Derived : new CUDAPluggableAllocator);
}
long long cache_info(int device) {   // what PyTorch's cacheInfo(device, &largest) does
  size_t largest = 7;
  try {
    static_cast<CUDAPluggableAllocator*>(cur::allocator.load())->cacheInfo(
        static_cast<c10::DeviceIndex>(device), &largest);
  } catch (const std::exception&) {
    return -1;
  }
  return static_cast<long long>(largest);
}
int other_virtual() { return static_cast<CUDAPluggableAllocator*>(cur::allocator.load())->recordStream(); }
void destroy_current() { delete static_cast<CUDAPluggableAllocator*>(cur::allocator.exchange(nullptr)); }
}
"""


@pytest.fixture(scope="module")
def fake_torch_libs(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("fake_torch")
    # built, not loaded here: only the subprocess may see libraries under PyTorch's names
    build_library(where, "libc10_cuda", FAKE_C10_CUDA, cflags=["-Wl,-soname,libc10_cuda.so"],
                  load=False)
    build_library(where, "libtorch_cuda", FAKE_TORCH_CUDA,
                  cflags=["-Wl,-soname,libtorch_cuda.so"],
                  libs=[str(where / "libc10_cuda.so"), f"-Wl,-rpath,{where}"], load=False)
    return where


def run(script: str, tmp_path: Path) -> str:
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
    return r.stdout


def test_cache_info_answers_through_the_vtable(fake_torch_libs, tmp_path):
    run(HOST_REGISTRY + f"""
import ctypes
libs = {str(fake_torch_libs)!r}
ctypes.CDLL(libs + "/libc10_cuda.so", mode=ctypes.RTLD_GLOBAL)
t = ctypes.CDLL(libs + "/libtorch_cuda.so", mode=ctypes.RTLD_GLOBAL)
t.cache_info.restype = ctypes.c_longlong
MiB = 1 << 20

why = core._torch_install_cache_info()
assert why == "PyTorch has no current CUDA allocator", why
t.make_current(0)
assert t.cache_info(0) == -1                      # PyTorch's own cacheInfo raises
assert core._torch_install_cache_info() == ""
core._torch_set_budget(0, 64 * MiB)
a = core._torch_allocator(0, True)
assert t.cache_info(0) == a.largest_available() == core._torch_largest_block(0) == 64 * MiB, (
    t.cache_info(0), a.largest_available())
p = a.malloc(10 * MiB, 0)                          # live: no longer available
assert t.cache_info(0) == 54 * MiB, t.cache_info(0)
a.free(p)                                          # cached: available again, no driver call
assert a.stats()["cached_bytes"] == 10 * MiB and t.cache_info(0) == 64 * MiB, t.cache_info(0)
assert t.other_virtual() == 42                     # the other slots are PyTorch's
assert core._torch_install_cache_info() == ""      # again: a no-op
t.destroy_current()                                # the virtual destructor through the copy
assert ctypes.c_int.in_dll(t, "destroyed").value == 1

t.make_current(1)                                  # a subclass: its vtable is not PyTorch's
why = core._torch_install_cache_info()
assert why == "PyTorch's current CUDA allocator is not a CUDAPluggableAllocator", why
assert t.cache_info(0) == -1                       # left alone
t.make_current(0)                                  # a second plain object gets it too
assert core._torch_install_cache_info() == "" and t.cache_info(0) == 64 * MiB
print("OK")
""", tmp_path)


def test_an_allocator_global_of_another_type_is_refused(tmp_path):
    """A variable's mangled name does not say its type: a PyTorch whose current-allocator
    global is not one pointer (a wrapper, a shared_ptr) is refused, not read through."""
    # the same name, two words wide; libtorch_cuda links to it by name all the same
    wide = FAKE_C10_CUDA.replace("std::atomic<void*> allocator{nullptr};",
                                 "struct Wide { std::atomic<void*> p; void* more; };\n"
                                 "Wide allocator{};")
    assert wide != FAKE_C10_CUDA
    build_library(tmp_path, "libc10_cuda", wide, cflags=["-Wl,-soname,libc10_cuda.so"],
                  load=False)
    build_library(tmp_path, "libtorch_cuda", FAKE_TORCH_CUDA,
                  cflags=["-Wl,-soname,libtorch_cuda.so"],
                  libs=[str(tmp_path / "libc10_cuda.so"), f"-Wl,-rpath,{tmp_path}"], load=False)
    run(HOST_REGISTRY + f"""
import ctypes
ctypes.CDLL({str(tmp_path)!r} + "/libc10_cuda.so", mode=ctypes.RTLD_GLOBAL)
t = ctypes.CDLL({str(tmp_path)!r} + "/libtorch_cuda.so", mode=ctypes.RTLD_GLOBAL)
t.make_current(0)
why = core._torch_install_cache_info()
assert why == "c10::cuda::CUDACachingAllocator::allocator is not one pointer in this PyTorch", why
assert t.cache_info(0) == -1                       # left alone
print("OK")
""", tmp_path)


def test_without_torch_cuda_it_says_so(tmp_path):
    # a CPU build of torch loads no libtorch_cuda.so (this process may import torch: run apart)
    run(HOST_REGISTRY + """
why = core._torch_install_cache_info()
assert "libtorch_cuda.so" in why and "not loaded" in why, why
print("OK")
""", tmp_path)


def test_benchmark_guard_follows_the_answer(tmp_path):
    """Where cacheInfo is answered cudnn.benchmark stays settable; where not, it is kept off
    with a warning that says why."""
    pytest.importorskip("torch")
    run(HOST_REGISTRY + """
import warnings, torch
from vmalloc.pluggable import shims
reg.cache_info_missing = "the reason here"
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ta.install_shims(torch)
    torch.backends.cudnn.benchmark = True
assert torch.backends.cudnn.benchmark is False
assert any("the reason here" in str(x.message) for x in w), [str(x.message) for x in w]
print("OK")
""", tmp_path)
    run(HOST_REGISTRY + """
import warnings, torch
reg.cache_info_missing = ""
with warnings.catch_warnings():
    warnings.simplefilter("error")
    ta.install_shims(torch)
    torch.backends.cudnn.benchmark = True
assert torch.backends.cudnn.benchmark is True
print("OK")
""", tmp_path)


def test_largest_available_counts_cache_budget_and_device():
    a = Allocator("host", chunk_size=MiB, budget=16 * MiB)
    assert a.largest_available() == 16 * MiB
    p = a.malloc(3 * MiB + 1)                      # 4 chunks
    assert a.largest_available() == 12 * MiB
    a.free(p)
    assert a.largest_available() == 16 * MiB      # cached chunks serve any request
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.largest_available()
    free = Allocator("host", chunk_size=MiB)       # no budget: the machine's free memory
    assert 0 < free.largest_available() <= free.total_memory
    free.close()


# --------------------------------------------------------------- the real libtorch_cuda
REAL = """
import torch, vmalloc
from vmalloc import torch_allocator as ta
core = ta.core()
core._torch_configure("host", 2 << 20, 64 << 20, -1)   # answers from the host backend
alloc = torch.cuda.memory.CUDAPluggableAllocator(core.__file__, "vmalloc_torch_malloc",
                                                 "vmalloc_torch_free")
torch.cuda.memory.change_current_allocator(alloc)       # no device needed
assert core._torch_install_cache_info() == ""
print("answer", CALLER.cache_info(0), core._torch_largest_block(0))
print("OK")
"""

CALLER = r"""
#include <c10/cuda/CUDACachingAllocator.h>
// PyTorch's own inline call, compiled against its headers: get()->cacheInfo(device, &largest)
extern "C" long long cache_info(int device) {
  size_t largest = 7;
  try {
    c10::cuda::CUDACachingAllocator::cacheInfo(static_cast<c10::DeviceIndex>(device), &largest);
  } catch (const std::exception&) {
    return -1;
  }
  return static_cast<long long>(largest);
}
"""


def test_real_torch_cuda_answers(tmp_path):
    """torch built with CUDA (its headers, libtorch_cuda and the CUDA runtime's headers): the
    real CUDAPluggableAllocator answers cacheInfo through PyTorch's own inline call."""
    torch = pytest.importorskip("torch")
    import glob
    import os
    from torch.utils.cpp_extension import include_paths, library_paths
    libdir = library_paths()[0]
    if not os.path.exists(os.path.join(libdir, "libtorch_cuda.so")):
        pytest.skip("torch is built without CUDA")
    site = os.path.dirname(os.path.dirname(torch.__file__))
    heads = [d for pattern in (os.path.join(site, "nvidia", "*", "include"),
                               os.path.join(site, "triton", "backends", "nvidia", "include"),
                               os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"),
                               "/usr/local/cuda*/include")
             for d in sorted(glob.glob(pattern))
             if os.path.exists(os.path.join(d, "cuda_runtime_api.h"))
             and os.path.exists(os.path.join(d, "crt", "host_config.h"))]
    if not heads:
        pytest.skip("no complete CUDA runtime headers (nvidia/*/include, triton, CUDA_HOME)")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    build_library(tmp_path, "caller", CALLER,
                  cflags=[f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{heads[0]}",
                          *[f"-I{p}" for p in include_paths()]],
                  libs=[f"-L{libdir}", "-lc10_cuda", "-lc10", f"-Wl,-rpath,{libdir}"], load=False)
    out = run("import ctypes\nCALLER = ctypes.CDLL(%r)\nCALLER.cache_info.restype = "
              "ctypes.c_longlong\n" % str(tmp_path / "caller.so") + REAL, tmp_path)
    got, want = (int(v) for v in out.split("answer")[1].split()[:2])
    assert got == want == 64 << 20, out
