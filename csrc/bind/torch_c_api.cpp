// The C entry points PyTorch's CUDAPluggableAllocator calls, and the per-device registry of
// vmalloc allocators behind them (the one piece of process-wide state vmalloc keeps).
//
// What PyTorch does with them (torch/csrc/cuda/CUDAPluggableAllocator.cpp, torch 2.4 - 2.13;
// read from the sources, not verified on a GPU here):
//  * alloc  `void*(size_t size, int device, cudaStream_t stream)`: called for every CUDA tensor
//    with the current device and stream. The result is NOT checked for nullptr: a null return
//    becomes a tensor with a null data pointer. So we never return null for size > 0: running out
//    throws a C++ exception, which propagates through the op to Python: PyTorch's own
//    c10::OutOfMemoryError (Python sees torch.OutOfMemoryError, and cuDNN's engine fallback,
//    which catches only that type, picks a smaller workspace), built as described in torch_oom.cpp;
//    std::runtime_error (RuntimeError) only where torch's libraries are not loaded.
//    vmalloc.pool() mode uses vmalloc_torch_malloc_pool instead: there PyTorch's caching
//    allocator is the caller, checks for null (cudaErrorMemoryAllocation: it frees its cached
//    blocks, retries, then raises its own OOM) and holds its allocator mutex, so that entry point
//    returns null and never calls back into Python (no pressure callback: the GIL must be taken
//    before PyTorch's allocator lock, never after).
//  * free `void(void*, size_t size, int device, cudaStream_t stream)`: PyTorch keeps the
//    allocation-time size/device/stream and passes them back. Called from a DataPtr deleter, so it
//    must not throw. At process exit it may run after the CUDA runtime's teardown (C++ statics,
//    thread-locals, late garbage collection): the driver then answers CUDA_ERROR_DEINITIALIZED to
//    everything, and the free is quiet (Allocator::free leaves the memory to the driver), as
//    PyTorch's own allocator ignores cudaErrorCudartUnloading.
//  * set_record_stream_fn `void(void*, cudaStream_t)`: Tensor.record_stream.
//  * set_reset_fn `void()`: torch.cuda.empty_cache().
//  * set_memory_fraction_fn `void(double, int)`: torch.cuda.set_per_process_memory_fraction.
//  * set_init_fn `void(int device_count)`: CUDA lazy initialisation.
//  * cacheInfo (no hook; the virtual method throws): cuDNN's autotuner asks it. Answered by
//    torch_cache_info.cpp: the largest allocation vmalloc can serve now (largest_block below).
//  * set_begin_allocate_to_pool `void(int, MempoolId_t, std::function<bool(cudaStream_t)>)`: CUDA
//    graph capture (torch.cuda.graph, torch.compile's cudagraphs) and torch.cuda.use_mem_pool
//    send allocations to a private pool, whose memory must never serve anything else (a graph
//    replays into the addresses it captured). With no hook set PyTorch ignores the request, so
//    vmalloc would go on serving them from its shared cache and a replay could write into
//    another tensor's memory. vmalloc has no private pools: the hook refuses, before capture
//    begins (PyTorch calls it first), and Python sees a RuntimeError saying so.
// A size of 0 (empty tensors, pytorch/pytorch#159892) gets nullptr, as the native allocator does.
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "alloc/allocator.hpp"
#include "alloc/format_bytes.hpp"
#include "bind/torch_cache_info.hpp"
#include "bind/torch_oom.hpp"

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

// Mapped memory is readable only by the devices cuMemSetAccess names, and PyTorch's peer access
// (cudaDeviceEnablePeerAccess, which the pluggable allocator's enablePeerAccess calls) covers
// cudaMalloc memory only. So when a process allocates on a second GPU, every pair of its vmalloc
// GPUs gets access to each other's memory (as PyTorch's expandable segments add peers): kernels
// and peer copies of one GPU may read another's tensors (model parallel, device_map="auto").
// A pair that cannot be connected (no peer-to-peer path, a driver error) is said on stderr.
// Called under r.mutex, with `a` new.
void connect_peers(const Registry& r, vmalloc::Allocator* a, int device) {
  if (r.base.backend != "cuda") return;
  for (int d = 0; d < kMaxDevices; ++d) {
    vmalloc::Allocator* other = d == device ? nullptr : r.alloc[d].load(std::memory_order_relaxed);
    if (!other || other->closed()) continue;  // closed by the user (or dead in a forked child)
    // Each pair on its own: a failure leaves the others connected, and is said (never silent).
    std::string why;
    try {
      bool both = other->add_peer(device);
      if (!(a->add_peer(d) && both)) why = "they have no peer-to-peer path";
    } catch (const std::exception& e) {
      why = e.what();
    }
    if (!why.empty())
      std::fprintf(stderr,
                   "vmalloc: warning: GPUs %d and %d were not given access to each other's memory "
                   "(%s), so a kernel of one cannot read the other's vmalloc tensors directly; copy "
                   "them through the host, or use one process per GPU (torchrun).\n",
                   d, device, why.c_str());
  }
}

// The registry's allocator of a device, unless the user closed it (vmalloc.device_allocator(d)
// .close()): a closed allocator raises on every call, and the loops over all devices below
// (empty_cache, record_stream's owner search, tracing) must go on past it. In a forked child
// every allocator is dead, not closed by the user: that still raises, as it did.
vmalloc::Allocator* open_allocator(const Registry& r, int device) {
  vmalloc::Allocator* a = r.alloc[device].load(std::memory_order_acquire);
  return a && a->closed() && !a->forked() ? nullptr : a;
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
    connect_peers(r, a, device);
  }
  return a;
}

// cacheInfo's answer: what one allocation could get now without the pressure callback (so a
// workspace cuDNN merely tries does not make the swap runtime evict). 0 when asking fails: cuDNN
// then times only the algorithms that need no workspace and keeps that choice for the shape, so
// the failure is said once on stderr rather than left to show as a slow convolution.
size_t largest_block(int device) noexcept {
  static std::atomic<bool> said{false};
  const char* why = "unknown error";
  try {
    return get(device, true)->largest_available();
  } catch (const std::exception& e) {
    why = e.what();
  } catch (...) {
  }
  if (!said.exchange(true))
    std::fprintf(stderr, "vmalloc: cudnn.benchmark's workspace query (cacheInfo) failed on device "
                 "%d: %s; answering 0 bytes, so cuDNN times only algorithms without a workspace\n",
                 device, why);
  return 0;
}

}  // namespace

// ---- the entry points ----------------------------------------------------------------------

VMALLOC_EXPORT void* vmalloc_torch_malloc(size_t size, int device, void* stream) {
  if (size == 0) return nullptr;
  vmalloc::Allocator* a = get(device, true);
  try {
    return a->malloc(size, reinterpret_cast<uintptr_t>(stream));
  } catch (const vmalloc::OutOfMemory& e) {
    using vmalloc::format_bytes;
    vmalloc::throw_torch_oom("CUDA out of memory (vmalloc). Tried to allocate " + format_bytes(e.requested) +
              ". GPU " + std::to_string(device) + ": vmalloc holds " + format_bytes(e.in_use) +
              " of physical memory" + (e.budget ? " with a budget of " + format_bytes(e.budget) : "") +
              ". Free tensors (or raise VMALLOC_BUDGET / set_per_process_memory_fraction) and "
              "retry; vmalloc stays usable. Detail: " + e.what());
  }
}

// vmalloc.pool() mode (see the top of this file): null on OOM, no pressure callback, no throw.
VMALLOC_EXPORT void* vmalloc_torch_malloc_pool(size_t size, int device, void* stream) noexcept {
  if (size == 0) return nullptr;
  try {
    return get(device, true)->try_malloc(size, reinterpret_cast<uintptr_t>(stream));
  } catch (const std::exception& e) {
    // not an OOM (a driver error, a bad device): PyTorch reports null as out of memory, so say
    // what really happened here
    std::fprintf(stderr, "vmalloc: pool malloc(%zu) on device %d failed: %s\n", size, device, e.what());
  } catch (...) {
    std::fprintf(stderr, "vmalloc: pool malloc(%zu) on device %d failed\n", size, device);
  }
  return nullptr;
}

// A sticky CUDA error (a kernel's illegal address) fails every later free with the same error:
// the first three are said in full, then the count at 10, 100, 1000, ... failures, so that the
// error that matters is not buried under one line per tensor freed.
static void say_failed_free(void* ptr, int device, const char* what) noexcept {
  static std::atomic<unsigned long long> failed{0};
  unsigned long long n = ++failed;
  if (n <= 3) {
    std::fprintf(stderr, "vmalloc: free(%p) on device %d failed: %s%s\n", ptr, device, what,
                 n == 3 ? " (further failed frees are counted, said at 10, 100, 1000, ...)" : "");
    return;
  }
  unsigned long long p = 10;
  while (p < n) p *= 10;
  if (p == n) std::fprintf(stderr, "vmalloc: %llu frees have failed (the last: free(%p) on device %d: %s)\n",
                           n, ptr, device, what);
}

VMALLOC_EXPORT void vmalloc_torch_free(void* ptr, size_t /*size*/, int device, void* /*stream*/) {
  if (!ptr) return;
  try {
    vmalloc::Allocator* a = get(device, false);
    if (!a) {
      std::fprintf(stderr,
                   "vmalloc: free(%p) on device %d: vmalloc has no allocator for device %d, so this "
                   "is not a vmalloc allocation (another allocator's pointer, or the wrong device); "
                   "not freed\n",
                   ptr, device, device);
      return;
    }
    a->free(ptr);  // quiet when the driver is shutting down (Allocator::free handles it)
  } catch (const std::exception& e) {
    // called from a DataPtr deleter: throwing would terminate the process
    say_failed_free(ptr, device, e.what());
  } catch (...) {
    say_failed_free(ptr, device, "an exception that is not a std::exception");
  }
}

VMALLOC_EXPORT void vmalloc_torch_record_stream(void* ptr, void* stream) {
  if (!ptr) return;
  Registry& r = registry();
  for (int d = 0; d < kMaxDevices; ++d) {
    vmalloc::Allocator* a = open_allocator(r, d);
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
    if (vmalloc::Allocator* a = open_allocator(r, d)) a->trim();
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

// c10::cuda::MempoolId_t, and the stream filter the hook is handed (by value, as PyTorch's
// FuncType has it; a std::function's layout does not depend on its signature)
using MempoolId = std::pair<unsigned long long, unsigned long long>;
using StreamFilter = std::function<bool(void*)>;

VMALLOC_EXPORT void vmalloc_torch_begin_allocate_to_pool(int device, MempoolId pool,
                                                        StreamFilter /*filter*/) {
  throw std::runtime_error(
      "vmalloc: PyTorch asked for a private memory pool on GPU " + std::to_string(device) +
      " (pool id (" + std::to_string(pool.first) + ", " + std::to_string(pool.second) +
      ")): CUDA graph capture (torch.cuda.graph, torch.compile(mode=\"reduce-overhead\")) and "
      "torch.cuda.use_mem_pool need memory no other tensor may reuse, and vmalloc has no private "
      "pools, so it refuses rather than let a graph replay write into other tensors. Use "
      "torch.compile's default mode, or run without vmalloc (VMALLOC=0) for graph capture.");
}

// Test-only: throws what an OOM throws, by `path` (0 auto, 1 constructor, 2 vtable), for C++
// built against torch to catch (tests/test_torch_oom.py); Python cannot catch a C++ type.
VMALLOC_EXPORT void vmalloc_torch_throw_oom_for_test(const char* msg, int path) {
  if (path < 0 || path > 2) throw std::invalid_argument("path: expected 0, 1 or 2, got " + std::to_string(path));
  vmalloc::throw_torch_oom(msg, static_cast<vmalloc::OomPath>(path));
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
    // Allocators made by an earlier configuration (a previous vmalloc.pool()) take the new
    // budget too: they are the ones the next pool uses.
    for (int d = 0; d < kMaxDevices; ++d) {
      if (device >= 0 && d != device) continue;
      if (vmalloc::Allocator* a = r.alloc[d].load()) a->set_budget(r.budget[d]);
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
    for (int d = 0; d < kMaxDevices; ++d)
      if (auto* p = open_allocator(registry(), d)) n += p->trim();
    return n;
  });
  m.def("_torch_set_trace", [](bool on) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.trace = on;
    for (int d = 0; d < kMaxDevices; ++d)
      if (auto* p = open_allocator(r, d)) p->set_trace(on);
  });
  m.def("_torch_install_cache_info", [] { return vmalloc::install_cache_info(&largest_block); },
        "Make PyTorch's current CUDA allocator (vmalloc's CUDAPluggableAllocator) answer "
        "cacheInfo, for cudnn.benchmark: '' when done, else why not (nothing changed).");
  m.def("_torch_largest_block", [](int device) { return largest_block(device); }, nb::arg("device"),
        nb::call_guard<nb::gil_scoped_release>(), "What cacheInfo answers for `device` (bytes).");
  m.def("_torch_throw_oom_for_test", [](const std::string& msg) { vmalloc::throw_torch_oom(msg); },
        "Throws what an out-of-memory malloc throws (tests the c10::OutOfMemoryError path).");
  m.def("_torch_oom_kind", [](int path) { return std::string(vmalloc::torch_oom_kind(static_cast<vmalloc::OomPath>(path))); },
        nb::arg("path") = 0,
        "How an OOM is raised now: 'c10::OutOfMemoryError (constructor|vtable)' or "
        "'std::runtime_error' (torch not loaded). path: 0 = what malloc uses, 1 = only the "
        "exported constructor, 2 = only the c10::Error constructor + vtable (torch 2.11).");
  m.def("_torch_entry_points", [] {
    nb::dict d;
    d["vmalloc_torch_malloc"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_malloc);
    d["vmalloc_torch_malloc_pool"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_malloc_pool);
    d["vmalloc_torch_free"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_free);
    d["vmalloc_torch_record_stream"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_record_stream);
    d["vmalloc_torch_empty_cache"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_empty_cache);
    d["vmalloc_torch_memory_fraction"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_memory_fraction);
    d["vmalloc_torch_init"] = reinterpret_cast<uintptr_t>(&vmalloc_torch_init);
    d["vmalloc_torch_begin_allocate_to_pool"] =
        reinterpret_cast<uintptr_t>(&vmalloc_torch_begin_allocate_to_pool);
    return d;
  });
}
