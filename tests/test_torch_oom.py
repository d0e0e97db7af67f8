"""vmalloc's out-of-memory error is PyTorch's own c10::OutOfMemoryError, by both routes of
csrc/bind/torch_oom.cpp: the exported constructor (torch 2.13) and c10::Error's constructor with
OutOfMemoryError's vtable (torch 2.11, whose class has no constructor symbol). Checked by catching
the C++ type in a small library built against the installed torch's headers (a few seconds: it
includes only c10/util/Exception.h)."""
import ctypes
import os

import pytest

torch = pytest.importorskip("torch")   # loads libc10, whose OutOfMemoryError we throw
from _cxx import build_library  # noqa: E402
from vmalloc import _core  # noqa: E402

CATCHER = r"""
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <cstring>
#include <string>

// Calls vmalloc's test entry point and says which C++ type caught what it threw.
extern "C" int catch_oom(const char* core_so, int path, char* out, size_t n) {
  void* h = dlopen(core_so, RTLD_NOW | RTLD_NOLOAD);
  if (!h) { std::snprintf(out, n, "dlopen: %s", dlerror()); return -1; }
  auto fn = reinterpret_cast<void (*)(const char*, int)>(dlsym(h, "vmalloc_torch_throw_oom_for_test"));
  if (!fn) { std::snprintf(out, n, "dlsym failed"); return -1; }
  int code = 0;
  std::string what;
  try {
    fn("vmalloc test message", path);
  } catch (const c10::OutOfMemoryError& e) {
    code = 1; what = e.what_without_backtrace();
  } catch (const c10::Error& e) {
    code = 2; what = e.what();
  } catch (const std::exception& e) {
    code = 3; what = e.what();
  }
  std::snprintf(out, n, "%s", what.c_str());
  return code;
}
"""

CAUGHT = {1: "c10::OutOfMemoryError", 2: "c10::Error", 3: "std::exception", 0: "nothing"}


@pytest.fixture(scope="module")
def catcher(tmp_path_factory):
    from torch.utils.cpp_extension import include_paths, library_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libdir = library_paths()[0]
    so = build_library(tmp_path_factory.mktemp("oom"), "catch_oom", CATCHER,
                       cflags=[f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                               *[f"-I{p}" for p in include_paths()]],
                       libs=[f"-L{libdir}", "-lc10", f"-Wl,-rpath,{libdir}"])
    so.catch_oom.restype = ctypes.c_int
    so.catch_oom.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]

    def run(path: int):
        buf = ctypes.create_string_buffer(4096)
        code = so.catch_oom(os.fsencode(_core.__file__), path, buf, len(buf))
        assert code >= 0, buf.value.decode()
        return CAUGHT[code], buf.value.decode()
    return run


# torch 2.13 exports OutOfMemoryError's constructor; torch 2.11 (the GPU machines' torch) does
# not, and there vmalloc takes the vtable route
CONSTRUCTOR_EXPORTED = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


@pytest.mark.parametrize("path,route", [(1, "constructor"), (2, "vtable"), (0, None)])
def test_oom_is_caught_as_c10_out_of_memory_error(catcher, path, route):
    if route == "constructor" and not CONSTRUCTOR_EXPORTED:
        pytest.skip(f"torch {torch.__version__} exports no OutOfMemoryError constructor")
    kind = _core._torch_oom_kind(path)
    assert kind.startswith("c10::OutOfMemoryError"), kind
    if route:
        assert route in kind
    caught, what = catcher(path)
    assert caught == "c10::OutOfMemoryError", (caught, what)
    assert "vmalloc test message" in what


def test_auto_route_prefers_the_exported_constructor():
    want = "constructor" if CONSTRUCTOR_EXPORTED else "vtable"
    assert _core._torch_oom_kind(0) == f"c10::OutOfMemoryError ({want})"
    if CONSTRUCTOR_EXPORTED:
        assert _core._torch_oom_kind(1) == _core._torch_oom_kind(0)


def test_the_python_face_is_a_runtime_error_with_the_message():
    with pytest.raises(RuntimeError, match="vmalloc test message"):
        _core._torch_throw_oom_for_test("vmalloc test message")
