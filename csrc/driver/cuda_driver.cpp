// CUDA backend: the driver's virtual memory management API (the same calls PyTorch's expandable
// segments use). libcuda.so.1 is opened with dlopen at the first construction, so the extension
// imports and the host backend works on machines without an NVIDIA driver; cuda.h comes from the
// toolkit or the nvidia-cuda-runtime wheel at build time (VMALLOC_HAVE_CUDA_H, see CMakeLists.txt).
//
// Unverified without a GPU in this project's CI: written from the CUDA driver API reference and
// PyTorch's c10/cuda/CUDACachingAllocator.cpp (ExpandableSegment) + c10/cuda/driver_api.h.
#include "driver/driver.hpp"

#ifndef VMALLOC_HAVE_CUDA_H

namespace vmalloc {
namespace driver {
std::unique_ptr<Driver> make_cuda_driver(int) {
  throw std::runtime_error(
      "backend 'cuda': this build of vmalloc was compiled without cuda.h (no CUDA toolkit and no "
      "nvidia-cuda-runtime wheel at build time); rebuild with one of them installed (and "
      "VMALLOC_REQUIRE_CUDA=1 so that a missing cuda.h stops the build), or use backend='host'");
}
size_t cuda_granularity(int device) { return make_cuda_driver(device)->granularity(); }
}  // namespace driver
}  // namespace vmalloc

#else

#include <cuda.h>
#include <dlfcn.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace vmalloc {
namespace driver {
namespace {

// Symbols are looked up by the name cuda.h maps them to (cuEventDestroy -> cuEventDestroy_v2, ...),
// so the table calls the same ABI versions a program compiled against this header would.
#define VMALLOC_STR2(x) #x
#define VMALLOC_STR(x) VMALLOC_STR2(x)
#define VMALLOC_CUDA_FUNCS(X)                                                                     \
  X(cuGetErrorString) X(cuGetErrorName) X(cuInit) X(cuDeviceGet) X(cuDeviceGetCount)              \
  X(cuDeviceGetAttribute)                                                                          \
  X(cuDeviceTotalMem) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxGetCurrent) \
  X(cuCtxSetCurrent) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease)    \
  X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemGetAllocationGranularity) X(cuEventCreate)   \
  X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) X(cuEventDestroy) X(cuDeviceCanAccessPeer)  \
  X(cuMemGetInfo) X(cuCtxSynchronize)

struct Api {
#define VMALLOC_DECLARE(name) decltype(&::name) name = nullptr;
  VMALLOC_CUDA_FUNCS(VMALLOC_DECLARE)
#undef VMALLOC_DECLARE
};

// Loaded once per process and never changed after: a read-only function table, not mutable state.
const Api& api() {
  static Api table;
  static std::string load_error;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = ::dlerror();
      load_error = std::string("backend 'cuda': cannot load libcuda.so.1 (") + (e ? e : "unknown error") +
                   "); is an NVIDIA driver installed? Use backend='host' on machines without a GPU";
      return;
    }
#define VMALLOC_LOAD(name)                                                                   \
  table.name = reinterpret_cast<decltype(table.name)>(::dlsym(lib, VMALLOC_STR(name)));     \
  if (!table.name && load_error.empty())                                                     \
    load_error = std::string("backend 'cuda': libcuda.so.1 lacks ") + VMALLOC_STR(name) +   \
                 " (driver too old for the virtual memory management API?)";
    VMALLOC_CUDA_FUNCS(VMALLOC_LOAD)
#undef VMALLOC_LOAD
  });
  if (!load_error.empty()) throw std::runtime_error(load_error);
  return table;
}

// cuStreamGetCtx, looked up on its own so that a driver without it (or a header that renamed it)
// costs only the cross-context case, not the whole backend. nullptr when absent.
using StreamGetCtxFn = CUresult (*)(CUstream, CUcontext*);
StreamGetCtxFn stream_get_ctx() {
  static StreamGetCtxFn fn = [] {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return lib ? reinterpret_cast<StreamGetCtxFn>(::dlsym(lib, "cuStreamGetCtx")) : nullptr;
  }();
  return fn;
}

std::string error_string(CUresult r) {
  const char* s = nullptr;
  const char* n = nullptr;
  try {
    if (api().cuGetErrorString(r, &s) != CUDA_SUCCESS) s = nullptr;
    if (api().cuGetErrorName(r, &n) != CUDA_SUCCESS) n = nullptr;
  } catch (...) {
  }
  std::string out = s ? s : "unknown error";
  out += " (";
  out += n ? n : "CUresult";
  out += " " + std::to_string(static_cast<int>(r)) + ")";
  return out;
}

// A call returned CUDA_ERROR_DEINITIALIZED: the driver is shutting down, for the whole process
// (every allocator's malloc then refuses, see Driver::check_not_shut_down).
[[noreturn]] void throw_shut_down(const char* what) {
  Driver::shut_down_seen.store(true, std::memory_order_relaxed);
  // Written out, not from cuGetErrorString: no driver call answers any more.
  throw DriverShutDown(std::string("vmalloc cuda backend: the CUDA driver is shutting down (") + what +
                       " returned CUDA_ERROR_DEINITIALIZED, 4): the process is exiting (the CUDA "
                       "runtime has been torn down), so no device memory can be allocated or used "
                       "any more");
}

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  if (r == CUDA_ERROR_DEINITIALIZED) throw_shut_down(what);
  std::string msg = std::string("vmalloc cuda backend: ") + what + " failed: " + error_string(r);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) throw DriverOutOfMemory(msg);
  throw std::runtime_error(msg);
}

CUmemAllocationProp chunk_props(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

// cuInit, then std::invalid_argument naming `device` unless this machine has it, and a
// runtime_error saying so where the device lacks the VMM API (its own calls would fail later
// with a bare CUDA_ERROR_NOT_SUPPORTED).
void init_and_check_device(const Api& a, int device) {
  check(a.cuInit(0), "cuInit");
  int count = 0;
  check(a.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (device < 0 || device >= count)
    throw std::invalid_argument("device: no CUDA device " + std::to_string(device) + " (this machine has " +
                                std::to_string(count) + ")");
  CUdevice dev = 0;
  check(a.cuDeviceGet(&dev, device), "cuDeviceGet");
  int vmm = 0;
  check(a.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
        "cuDeviceGetAttribute");
  if (!vmm)
    throw std::runtime_error(
        "vmalloc cuda backend: CUDA device " + std::to_string(device) +
        " does not support the driver's virtual memory management API (cuMemCreate, cuMemMap: "
        "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0 on a GPU older than Pascal "
        "or on a platform that does not expose it), which vmalloc is built on; run without "
        "vmalloc (VMALLOC=0)");
}

class CudaDriver final : public Driver {
 public:
  explicit CudaDriver(int device) : a_(api()), prop_(chunk_props(device)) {
    init_and_check_device(a_, device);
    check(a_.cuDeviceGet(&dev_, device), "cuDeviceGet");
    check(a_.cuMemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity");
    check(a_.cuDeviceTotalMem(&total_, dev_), "cuDeviceTotalMem");
    CUmemAccessDesc own{};
    own.location = prop_.location;
    own.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access_.push_back(own);
    // Last, so that no failure above leaves it retained. The primary context is the one the CUDA
    // runtime (and so PyTorch) uses on this device.
    check(a_.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
  }
  ~CudaDriver() override { drop_context(); }

  // close(): everything was unmapped and released; give back the events and the context too,
  // so that a closed allocator holds nothing of the driver's.
  void shutdown() noexcept override { drop_context(); }

  // One driver call, only once a call has seen the shutdown: the allocator's fast paths call none.
  void probe_shut_down() override {
    CUcontext c = nullptr;
    if (a_.cuCtxGetCurrent(&c) == CUDA_ERROR_DEINITIALIZED) throw_shut_down("cuCtxGetCurrent");
    shut_down_seen.store(false, std::memory_order_relaxed);  // it answers again (only a fake does)
  }

  const char* name() const override { return "cuda"; }
  size_t granularity() const override { return granularity_; }
  size_t total_memory() const override { return total_; }
  size_t free_memory() override {
    Ctx g(*this);
    g.check();
    size_t free = 0, total = 0;
    check(a_.cuMemGetInfo(&free, &total), "cuMemGetInfo");
    return free;
  }

  uintptr_t reserve(size_t size) override {
    Ctx g(*this);
    g.check();
    CUdeviceptr p = 0;
    check(a_.cuMemAddressReserve(&p, size, 0, 0, 0), "cuMemAddressReserve");
    return static_cast<uintptr_t>(p);
  }
  void unreserve(uintptr_t va, size_t size) override {
    Ctx g(*this);
    g.check();
    check(a_.cuMemAddressFree(static_cast<CUdeviceptr>(va), size), "cuMemAddressFree");
  }

  ChunkHandle create(size_t size) override {
    Ctx g(*this);
    g.check();
    CUmemGenericAllocationHandle h = 0;
    check(a_.cuMemCreate(&h, size, &prop_, 0), "cuMemCreate");
    return static_cast<ChunkHandle>(h);
  }
  void release(ChunkHandle h) override {
    Ctx g(*this);
    g.check();
    check(a_.cuMemRelease(static_cast<CUmemGenericAllocationHandle>(h)), "cuMemRelease");
  }

  void map(uintptr_t va, size_t size, ChunkHandle h) override {
    Ctx g(*this);
    g.check();
    check(a_.cuMemMap(static_cast<CUdeviceptr>(va), size, 0, static_cast<CUmemGenericAllocationHandle>(h), 0),
          "cuMemMap");
  }
  void set_access(uintptr_t va, size_t size) override {
    Ctx g(*this);
    g.check();
    check(a_.cuMemSetAccess(static_cast<CUdeviceptr>(va), size, access_.data(), access_.size()),
          "cuMemSetAccess");
  }
  bool add_peer(int device) override {
    for (const auto& d : access_)
      if (d.location.id == device) return true;
    init_and_check_device(a_, device);
    CUdevice peer = 0;
    check(a_.cuDeviceGet(&peer, device), "cuDeviceGet");
    int can = 0;  // can `peer` reach this device's memory?
    check(a_.cuDeviceCanAccessPeer(&can, peer, dev_), "cuDeviceCanAccessPeer");
    if (!can) return false;
    CUmemAccessDesc d{};
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = device;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access_.push_back(d);
    // cuDeviceCanAccessPeer may say yes where the grant itself fails (some PCIe, vGPU or IOMMU
    // setups): every later mapping would carry the peer and fail. Grant it once on a probe chunk
    // of our own first; the peer stays only if that worked.
    try {
      probe_access();
    } catch (...) {
      access_.pop_back();
      throw;
    }
    return true;
  }
  bool has_peer(int device) const override {
    for (size_t i = 1; i < access_.size(); ++i)
      if (access_[i].location.id == device) return true;
    return false;
  }
  void remove_peer(int device) override {
    for (size_t i = 1; i < access_.size(); ++i)  // [0] is this device
      if (access_[i].location.id == device) access_.erase(access_.begin() + static_cast<std::ptrdiff_t>(i--));
  }
  void synchronize() override {
    Ctx g(*this);
    g.check();
    check(a_.cuCtxSynchronize(), "cuCtxSynchronize");
  }
  void unmap(uintptr_t va, size_t size) override {
    Ctx g(*this);
    g.check();
    check(a_.cuMemUnmap(static_cast<CUdeviceptr>(va), size), "cuMemUnmap");
  }

  EventHandle record_event(uintptr_t stream) override {
    // cuEventRecord needs the event in the stream's own context (a tensor record_stream-ed onto
    // another device's stream): such a stream gets an event created in its context, not pooled.
    CUcontext sctx = ctx_;
    uintptr_t legacy = reinterpret_cast<uintptr_t>(CU_STREAM_LEGACY);
    uintptr_t per_thread = reinterpret_cast<uintptr_t>(CU_STREAM_PER_THREAD);
    if (stream != 0 && stream != legacy && stream != per_thread && stream_get_ctx()) {
      // (in our context: a free may come from a thread that never made one current, and
      // CUDA_ERROR_INVALID_CONTEXT is among cuStreamGetCtx's documented results)
      Ctx g(*this);
      g.check();
      check(stream_get_ctx()(reinterpret_cast<CUstream>(stream), &sctx), "cuStreamGetCtx");
    }
    if (sctx != ctx_) {
      Ctx g(*this, sctx);
      g.check();
      CUevent e = nullptr;
      check(a_.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
      CUresult r = a_.cuEventRecord(e, reinterpret_cast<CUstream>(stream));
      if (r != CUDA_SUCCESS) {
        a_.cuEventDestroy(e);
        check(r, "cuEventRecord");
      }
      foreign_events_.emplace(e, sctx);
      return reinterpret_cast<EventHandle>(e);
    }
    Ctx g(*this);
    g.check();
    CUevent e = nullptr;
    if (!event_pool_.empty()) {
      e = event_pool_.back();
      event_pool_.pop_back();
    } else {
      check(a_.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    }
    CUresult r = a_.cuEventRecord(e, reinterpret_cast<CUstream>(stream));
    if (r != CUDA_SUCCESS) {
      event_pool_.push_back(e);
      check(r, "cuEventRecord");
    }
    return reinterpret_cast<EventHandle>(e);
  }
  bool event_done(EventHandle e) override {
    if (e == 0) return true;
    Ctx g(*this);
    g.check();
    CUresult r = a_.cuEventQuery(reinterpret_cast<CUevent>(e));
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(r, "cuEventQuery");
    return true;
  }
  void event_wait(EventHandle e) override {
    if (e == 0) return;
    Ctx g(*this);
    g.check();
    check(a_.cuEventSynchronize(reinterpret_cast<CUevent>(e)), "cuEventSynchronize");
  }
  void event_destroy(EventHandle e) override {
    if (e == 0) return;
    auto it = foreign_events_.find(reinterpret_cast<CUevent>(e));
    if (it != foreign_events_.end()) {  // another context's event: destroyed there, not pooled
      Ctx g(*this, it->second);
      if (g.ok()) a_.cuEventDestroy(it->first);  // else its context is gone, and the event with it
      foreign_events_.erase(it);
      return;
    }
    event_pool_.push_back(reinterpret_cast<CUevent>(e));  // reused by record_event
  }

 private:
  // Maps one chunk of our own with the current access list, then undoes it all: a grant that
  // fails throws here, before any allocation depends on it. On a full device (no chunk to try
  // it on) the peer is kept untried, as it was before this probe.
  void probe_access() {
    Ctx g(*this);
    g.check();
    CUmemGenericAllocationHandle h = 0;
    CUresult r = a_.cuMemCreate(&h, granularity_, &prop_, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return;  // a full device: the peer stays, untried
    check(r, "cuMemCreate");
    CUdeviceptr va = 0;
    r = a_.cuMemAddressReserve(&va, granularity_, 0, 0, 0);
    const char* what = "cuMemAddressReserve";
    bool mapped = false;
    if (r == CUDA_SUCCESS) {
      what = "cuMemMap";
      r = a_.cuMemMap(va, granularity_, 0, h, 0);
      mapped = r == CUDA_SUCCESS;
    }
    if (mapped) {
      what = "cuMemSetAccess (granting the peer)";
      r = a_.cuMemSetAccess(va, granularity_, access_.data(), access_.size());
      a_.cuMemUnmap(va, granularity_);
    }
    if (va) a_.cuMemAddressFree(va, granularity_);
    a_.cuMemRelease(h);
    check(r, what);
  }

  // Destroys the events and releases the primary context, once. Best effort and silent: at
  // interpreter exit the driver may already be shutting down (every call then fails with
  // CUDA_ERROR_DEINITIALIZED, and the driver takes the events and the context with it).
  void drop_context() noexcept {
    if (!ctx_) return;
    {
      Ctx g(*this);
      if (g.ok())
        for (CUevent e : event_pool_) a_.cuEventDestroy(e);
    }
    event_pool_.clear();
    for (auto& fe : foreign_events_) {
      Ctx g(*this, fe.second);
      if (g.ok()) a_.cuEventDestroy(fe.first);
    }
    foreign_events_.clear();
    a_.cuDevicePrimaryCtxRelease(dev_);
    ctx_ = nullptr;
  }

  // Makes this device's primary context current for the duration of a call (the allocator may be
  // called from threads whose current context belongs to another device, or none).
  // ok() is false when the switch failed (a context destroyed under us): the calls that follow
  // would act in another context, so throwing paths check() it and noexcept paths skip them.
  struct Ctx {
    explicit Ctx(CudaDriver& d, CUcontext target = nullptr) : d_(d) {
      if (!target) target = d_.ctx_;
      CUresult r = d_.a_.cuCtxGetCurrent(&prev_);
      if (r != CUDA_SUCCESS) {
        result_ = r;
      } else if (prev_ != target) {
        call_ = "cuCtxSetCurrent";
        result_ = d_.a_.cuCtxSetCurrent(target);
        switched_ = result_ == CUDA_SUCCESS;
      }
    }
    ~Ctx() {
      if (switched_) d_.a_.cuCtxSetCurrent(prev_);
    }
    bool ok() const { return result_ == CUDA_SUCCESS; }
    void check() const {
      if (result_ == CUDA_ERROR_DEINITIALIZED) throw_shut_down(call_);
      vmalloc::driver::check(result_, "making the device's context current");
    }
    CudaDriver& d_;
    CUcontext prev_ = nullptr;
    CUresult result_ = CUDA_SUCCESS;
    const char* call_ = "cuCtxGetCurrent";  // the call that gave result_
    bool switched_ = false;
  };

  const Api& a_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUmemAllocationProp prop_;
  std::vector<CUmemAccessDesc> access_;  // this device, then the peers add_peer named
  size_t granularity_ = 0;
  size_t total_ = 0;
  std::vector<CUevent> event_pool_;
  std::unordered_map<CUevent, CUcontext> foreign_events_;  // events made in a stream's own context
};

}  // namespace

std::unique_ptr<Driver> make_cuda_driver(int device) { return std::make_unique<CudaDriver>(device); }

// Without a driver object: no primary context is retained (retaining the last reference would
// create a context on the GPU just to answer, and releasing it destroy it again).
size_t cuda_granularity(int device) {
  const Api& a = api();
  init_and_check_device(a, device);
  CUmemAllocationProp prop = chunk_props(device);
  size_t g = 0;
  check(a.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  return g;
}

}  // namespace driver
}  // namespace vmalloc

#endif  // VMALLOC_HAVE_CUDA_H
