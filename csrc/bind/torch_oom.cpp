// Raising PyTorch's c10::OutOfMemoryError from vmalloc's C entry points without linking libtorch.
//
#include "bind/torch_oom.hpp"

#include <cxxabi.h>
#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <typeinfo>

namespace vmalloc {
namespace {

// Two ways, tried in this order (both checked on CPU by tests/test_torch_oom.py, which catches
// c10::OutOfMemoryError in C++ built against the installed torch):
//  1. constructor: libc10 exports c10::OutOfMemoryError(SourceLocation, std::string) (torch 2.13).
//  2. vtable: torch 2.11 declares the class with an inherited constructor (`using Error::Error`),
//     so no constructor symbol exists; only its vtable and typeinfo, emitted as weak symbols in
//     the libraries that use it (libc10_cuda.so, libtorch_cuda.so, libtorch_python.so). The class
//     adds no members, so we build a c10::Error with libc10's exported constructor and point its
//     vptr at OutOfMemoryError's vtable: the object is then exactly what `throw OutOfMemoryError`
//     makes. The typeinfo is read from the vtable itself (slot -1), so the two always agree.
// The object is built in exception storage and thrown with __cxa_throw; its destructor is the
// first slot of its vtable (Itanium C++ ABI: std::exception's virtual destructor comes first,
// complete-object destructor before the deleting one). A failed lookup is not cached: one made
// before torch's libraries are loaded (vmalloc imported first) must not stick.
// Mangled names are those of the C++11 string ABI (torch._C._GLIBCXX_USE_CXX11_ABI); where they do not
// resolve (a torch built with the old ABI), an OOM is a std::runtime_error (RuntimeError).
struct C10SourceLocation {  // c10/util/StringUtil.h
  const char* function;
  const char* file;
  uint32_t line;
};
using C10Ctor = void (*)(void*, C10SourceLocation, std::string);
constexpr size_t kExceptionStorage = 1024;  // >= sizeof(c10::Error) (about 200 bytes)

constexpr const char* kOomCtor =
    "_ZN3c1016OutOfMemoryErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";
constexpr const char* kErrorCtor =
    "_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";
constexpr const char* kOomTypeinfo = "_ZTIN3c1016OutOfMemoryErrorE";
constexpr const char* kOomVtable = "_ZTVN3c1016OutOfMemoryErrorE";
// where torch 2.4 - 2.13 emit OutOfMemoryError's vtable (weak, wherever the class is thrown)
constexpr std::array<const char*, 5> kVtableLibs = {
    "libc10.so", "libc10_cuda.so", "libtorch_cuda.so", "libtorch_python.so", "libtorch_cpu.so"};

struct TorchOom {
  C10Ctor ctor = nullptr;              // constructs the object in place
  void* const* vtable = nullptr;       // kVtable: address point to install as the vptr
  std::type_info* type = nullptr;
  const char* kind = "std::runtime_error";
};

void* loaded(const char* lib) { return dlopen(lib, RTLD_NOLOAD | RTLD_LAZY); }  // never loads

TorchOom lookup_constructor() {
  TorchOom o;
  void* h = loaded("libc10.so");
  if (!h) return o;
  o.ctor = reinterpret_cast<C10Ctor>(dlsym(h, kOomCtor));
  o.type = reinterpret_cast<std::type_info*>(dlsym(h, kOomTypeinfo));
  dlclose(h);  // drops the reference NOLOAD took; torch keeps the library loaded
  if (!o.ctor || !o.type) return TorchOom{};
  o.kind = "c10::OutOfMemoryError (constructor)";
  return o;
}

TorchOom lookup_vtable() {
  TorchOom o;
  void* c10 = loaded("libc10.so");
  if (!c10) return o;
  o.ctor = reinterpret_cast<C10Ctor>(dlsym(c10, kErrorCtor));
  dlclose(c10);
  if (!o.ctor) return TorchOom{};
  for (const char* lib : kVtableLibs) {
    void* h = loaded(lib);
    if (!h) continue;
    auto* vt = reinterpret_cast<void* const*>(dlsym(h, kOomVtable));
    dlclose(h);
    if (!vt || !vt[1]) continue;
    // Itanium vtable layout: [offset-to-top, typeinfo*, virtual functions...]; the vptr points
    // at the first virtual function
    o.vtable = vt + 2;
    o.type = static_cast<std::type_info*>(vt[1]);
    o.kind = "c10::OutOfMemoryError (vtable)";
    return o;
  }
  return TorchOom{};
}

std::mutex oom_mutex;
TorchOom oom_found;  // guarded by oom_mutex; set once a lookup succeeded

TorchOom torch_oom(OomPath path) {
  if (path == OomPath::kConstructor) return lookup_constructor();
  if (path == OomPath::kVtable) return lookup_vtable();
  std::lock_guard<std::mutex> lock(oom_mutex);
  if (!oom_found.ctor) {
    oom_found = lookup_constructor();
    if (!oom_found.ctor) oom_found = lookup_vtable();
  }
  return oom_found;
}

}  // namespace

const char* torch_oom_kind(OomPath path) { return torch_oom(path).kind; }

[[noreturn]] void throw_torch_oom(const std::string& msg, OomPath path) {
  const TorchOom t = torch_oom(path);
  if (t.ctor) {
    void* exc = abi::__cxa_allocate_exception(kExceptionStorage);
    std::memset(exc, 0, kExceptionStorage);
    t.ctor(exc, C10SourceLocation{"vmalloc_torch_malloc", __FILE__, static_cast<uint32_t>(__LINE__)},
           msg);
    if (t.vtable) *reinterpret_cast<void* const**>(exc) = t.vtable;
    auto dtor = reinterpret_cast<void (*)(void*)>((*reinterpret_cast<void***>(exc))[0]);
    abi::__cxa_throw(exc, t.type, dtor);
  }
  throw std::runtime_error(msg);
}

}  // namespace vmalloc
