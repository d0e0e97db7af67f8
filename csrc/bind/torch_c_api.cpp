// The C entry points PyTorch's CUDAPluggableAllocator calls, and the per-device registry of
// vmalloc allocators behind them (the one piece of process-wide state vmalloc keeps).
//
// What PyTorch does with them (torch/csrc/cuda/CUDAPluggableAllocator.cpp, torch 2.4 - 2.13;
// read from the sources, not verified on a GPU here):
//  * alloc  `void*(size_t size, int device, cudaStream_t stream)`: called for every CUDA tensor
//    with the current device and stream. The result is NOT checked for nullptr: a null return
//    becomes a tensor with a null data pointer. So we never return null for size > 0: running out
//    throws a C++ exception, which propagates through the op to Python. We throw PyTorch's own
//    c10::OutOfMemoryError when libc10 exports what that needs (so Python sees
//    torch.OutOfMemoryError, like the native allocator's OOM), else std::runtime_error
//    (RuntimeError, pytorch/pytorch#133280).
//  * free `void(void*, size_t size, int device, cudaStream_t stream)`: PyTorch keeps the
//    allocation-time size/device/stream and passes them back. Called from a DataPtr deleter, so it
//    must not throw.
//  * set_record_stream_fn `void(void*, cudaStream_t)`: Tensor.record_stream.
//  * set_reset_fn `void()`: torch.cuda.empty_cache().
//  * set_memory_fraction_fn `void(double, int)`: torch.cuda.set_per_process_memory_fraction.
//  * set_init_fn `void(int device_count)`: CUDA lazy initialisation.
// A size of 0 (empty tensors, pytorch/pytorch#159892) gets nullptr, as the native allocator does.
#include <cxxabi.h>
#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "alloc/allocator.hpp"

namespace nb = nanobind;

#define VMALLOC_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kMaxDevices = 64;

// One allocator per device, created on first use. Never destroyed: tensors may still be freed
// during interpreter teardown, after static destructors would have run (PyTorch leaks its
// allocator for the same reason).
struct Registry {
  std::mutex mutex;
  vmalloc::Config base;                       // backend, chunk_size, small_threshold
  std::array<size_t, kMaxDevices> budget{};   // per device; 0 = none
  std::array<std::atomic<vmalloc::Allocator*>, kMaxDevices> alloc{};
  bool trace = false;
  int device_count = 0;
  Registry() { base.backend = "cuda"; }
};

Registry& registry() {
  static Registry* r = new Registry();  // leaked on purpose, see above
  return *r;
}

vmalloc::Allocator* get(int device, bool create) {
  if (device < 0 || device >= kMaxDevices) {
    throw std::invalid_argument("vmalloc: device " + std::to_string(device) + " out of range [0, " +
                                std::to_string(kMaxDevices) + ")");
  }
  Registry& r = registry();
  vmalloc::Allocator* a = r.alloc[device].load(std::memory_order_acquire);
  if (a || !create) return a;
  std::lock_guard<std::mutex> lock(r.mutex);
  a = r.alloc[device].load(std::memory_order_relaxed);
  if (!a) {
    vmalloc::Config cfg = r.base;
    cfg.device = device;
    cfg.budget = r.budget[device];
    a = new vmalloc::Allocator(cfg);
    a->set_trace(r.trace);
    r.alloc[device].store(a, std::memory_order_release);
  }
  return a;
}

std::string fmt_bytes(size_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) { v /= 1024; ++u; }
  char buf[64];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", v, units[u]);
  return buf;
}

// ---- raising PyTorch's OutOfMemoryError without linking libtorch ----------------------------
// libc10 exports c10::OutOfMemoryError(SourceLocation, std::string) and its typeinfo. We build the
// object in exception storage with that constructor and throw it with __cxa_throw; its destructor
// is the first slot of its vtable (Itanium C++ ABI: std::exception's virtual destructor comes
// first, complete-object destructor before the deleting one).
struct C10SourceLocation {  // c10/util/StringUtil.h
  const char* function;
  const char* file;
  uint32_t line;
};
using OomCtor = void (*)(void*, C10SourceLocation, std::string);
constexpr size_t kExceptionStorage = 1024;  // >= sizeof(c10::Error) (about 200 bytes)

struct TorchOom {
  OomCtor ctor = nullptr;
  std::type_info* type = nullptr;
};

const TorchOom& torch_oom() {
  static TorchOom t = [] {
    TorchOom o;
    void* h = dlopen("libc10.so", RTLD_NOLOAD | RTLD_LAZY);  // only if torch already loaded it
    if (!h) return o;
    o.ctor = reinterpret_cast<OomCtor>(dlsym(
        h, "_ZN3c1016OutOfMemoryErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"));
    o.type = reinterpret_cast<std::type_info*>(dlsym(h, "_ZTIN3c1016OutOfMemoryErrorE"));
    if (!o.ctor || !o.type) o = TorchOom{};
    return o;
  }();
  return t;
}

[[noreturn]] void throw_oom(const std::string& msg) {
  const TorchOom& t = torch_oom();
  if (t.ctor) {
    void* exc = abi::__cxa_allocate_exception(kExceptionStorage);
    std::memset(exc, 0, kExceptionStorage);
    t.ctor(exc, C10SourceLocation{"vmalloc_torch_malloc", __FILE__, static_cast<uint32_t>(__LINE__)},
           msg);
    auto dtor = reinterpret_cast<void (*)(void*)>((*reinterpret_cast<void***>(exc))[0]);
    abi::__cxa_throw(exc, t.type, dtor);
  }
  throw std::runtime_error(msg);
}

}  // namespace

// ---- the entry points ----------------------------------------------------------------------

VMALLOC_EXPORT void* vmalloc_torch_malloc(size_t size, int device, void* stream) {
  if (size == 0) return nullptr;
  vmalloc::Allocator* a = get(device, true);
  try {
    return a->malloc(size, reinterpret_cast<uintptr_t>(stream));
  } catch (const vmalloc::OutOfMemory& e) {
    throw_oom("CUDA out of memory (vmalloc). Tried to allocate " + fmt_bytes(e.requested) +
              ". GPU " + std::to_string(device) + ": vmalloc holds " + fmt_bytes(e.in_use) +
              " of physical memory" + (e.budget ? " with a budget of " + fmt_bytes(e.budget) : "") +
              ". Free tensors (or raise VMALLOC_BUDGET / set_per_process_memory_fraction) and "
              "retry; vmalloc stays usable. Detail: " + e.what());
  }
}

VMALLOC_EXPORT void vmalloc_torch_free(void* ptr, size_t /*size*/, int device, void* /*stream*/) {
  if (!ptr) return;
  try {
    get(device, false)->free(ptr);
  } catch (const std::exception& e) {
    // called from a DataPtr deleter: throwing would terminate the process
    std::fprintf(stderr, "vmalloc: free(%p) on device %d failed: %s\n", ptr, device, e.what());
  } catch (...) {
    std::fprintf(stderr, "vmalloc: free(%p) on device %d failed\n", ptr, device);
  }
}

VMALLOC_EXPORT void vmalloc_torch_record_stream(void* ptr, void* stream) {
  if (!ptr) return;
  Registry& r = registry();
  for (int d = 0; d < kMaxDevices; ++d) {
    vmalloc::Allocator* a = r.alloc[d].load(std::memory_order_acquire);
    if (a && a->allocation_size(ptr) != 0) {
      a->record_stream(ptr, reinterpret_cast<uintptr_t>(stream));
      return;
    }
  }
  std::fprintf(stderr, "vmalloc: record_stream(%p): not a vmalloc allocation\n", ptr);
}

VMALLOC_EXPORT void vmalloc_torch_empty_cache() {
  Registry& r = registry();
  for (int d = 0; d < kMaxDevices; ++d) {
    if (vmalloc::Allocator* a = r.alloc[d].load(std::memory_order_acquire)) a->trim();
  }
}

VMALLOC_EXPORT void vmalloc_torch_memory_fraction(double fraction, int device) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw std::invalid_argument("vmalloc: memory fraction must be in [0, 1], got " + std::to_string(fraction));
  }
  vmalloc::Allocator* a = get(device, true);   // knows its device's memory size
  size_t budget = static_cast<size_t>(fraction * static_cast<double>(a->total_memory()));
  // vmalloc's budget 0 means "no cap": a fraction that rounds below one chunk (0.0 included)
  // would silently lift the limit instead of forbidding allocations, so refuse it
  if (budget < a->config().chunk_size) {
    throw std::invalid_argument("vmalloc: memory fraction " + std::to_string(fraction) + " gives " +
                                std::to_string(budget) + " bytes, less than one chunk (" +
                                std::to_string(a->config().chunk_size) + " bytes)");
  }
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.budget[device] = budget;
  }
  a->set_budget(budget);
}

VMALLOC_EXPORT void vmalloc_torch_init(int device_count) {
  registry().device_count = device_count;
}

// ---- Python side of the registry (vmalloc.torch_allocator) ----------------------------------

void bind_torch(nb::module_& m) {
  m.def("_torch_configure", [](const std::string& backend, size_t chunk_size, size_t budget, int device) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& a : r.alloc) {
      if (a.load() && (r.base.backend != backend || r.base.chunk_size != chunk_size)) {
        throw std::runtime_error("vmalloc: allocators already exist with another backend/chunk size");
      }
    }
    r.base.backend = backend;
    r.base.chunk_size = chunk_size;
    if (device < 0) {
      r.budget.fill(budget);
    } else {
      r.budget.at(static_cast<size_t>(device)) = budget;
    }
  }, nb::arg("backend"), nb::arg("chunk_size"), nb::arg("budget"), nb::arg("device"),
     "Settings for the per-device allocators PyTorch's entry points create lazily.");
  m.def("_torch_devices", [] {
    std::vector<int> out;
    for (int d = 0; d < kMaxDevices; ++d) if (registry().alloc[d].load()) out.push_back(d);
    return out;
  });
  m.def("_torch_allocator", [](int device, bool create) { return get(device, create); },
        nb::arg("device"), nb::arg("create") = false, nb::rv_policy::reference,
        "The registry's allocator of `device` (a vmalloc._core.Allocator that lives until exit), "
        "or None when that device has allocated nothing yet and create is False.");
  m.def("_torch_set_budget", [](int device, size_t budget) {
    Registry& r = registry();
    { std::lock_guard<std::mutex> lock(r.mutex); r.budget.at(device) = budget; }
    if (vmalloc::Allocator* a = get(device, false)) a->set_budget(budget);
  }, nb::call_guard<nb::gil_scoped_release>());
  m.def("_torch_trim", [] {
    size_t n = 0;
    for (auto& a : registry().alloc) if (auto* p = a.load()) n += p->trim();
    return n;
  });
  m.def("_torch_set_trace", [](bool on) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.trace = on;
    for (auto& a : r.alloc) if (auto* p = a.load()) p->set_trace(on);
  });
  m.def("_torch_throw_oom_for_test", [](const std::string& msg) { throw_oom(msg); },
        "Throws what an out-of-memory malloc throws (tests the c10::OutOfMemoryError path).");
  m.def("_torch_oom_kind", [] {
    return std::string(torch_oom().ctor ? "c10::OutOfMemoryError" : "std::runtime_error");
  });
  m.def("_torch_entry_points", [] {
    nb::dict d;
    d["vmalloc_torch_malloc"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_malloc);
    d["vmalloc_torch_free"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_free);
    d["vmalloc_torch_record_stream"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_record_stream);
    d["vmalloc_torch_empty_cache"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_empty_cache);
    d["vmalloc_torch_memory_fraction"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_memory_fraction);
    d["vmalloc_torch_init"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_init);
    return d;
  });
}
