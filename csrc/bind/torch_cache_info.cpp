// CUDAAllocator::cacheInfo for vmalloc's CUDAPluggableAllocator, without linking libtorch.
//
// cuDNN's autotuner (torch.backends.cudnn.benchmark = True) sizes the workspaces it times by the
// current CUDA allocator's largest free block: c10::cuda::CUDACachingAllocator::cacheInfo
// (aten/src/ATen/native/cudnn/Conv_v8.cpp get_available_workspace, Conv_v7.cpp
// getMaxWorkspaceSize), a virtual call on the allocator object. PyTorch's pluggable allocator
// offers no hook for it and throws there, so with vmalloc every autotuned convolution raised.
//
// The object enable() installs gets its own copy of CUDAPluggableAllocator's vtable, whose
// cacheInfo slot points here. Nothing about the layout is assumed (torch 2.4 - 2.13 differ):
//  * the vtable and CUDAPluggableAllocator::cacheInfo are found by their exported symbols in
//    libtorch_cuda.so, the vtable's length by its symbol's size (dladdr1);
//  * the slot is the one entry of the vtable equal to cacheInfo's address;
//  * the object is c10::cuda::CUDACachingAllocator::allocator (libc10_cuda.so), and its vptr must
//    point into that very vtable (a plain CUDAPluggableAllocator, not a subclass).
// Anything else found changes nothing and says why (vmalloc then keeps cudnn.benchmark off). The
// copy lives until exit (the object may be destroyed as late as that); other objects of the
// class (vmalloc.pool()'s) keep PyTorch's vtable.
#include "bind/torch_cache_info.hpp"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace vmalloc {
namespace {

constexpr const char* kVtable = "_ZTVN5torch4cuda22CUDAPluggableAllocator22CUDAPluggableAllocatorE";
constexpr const char* kAllocator = "_ZN3c104cuda20CUDACachingAllocator9allocatorE";  // std::atomic<CUDAAllocator*>

std::atomic<LargestBlockFn> g_largest{nullptr};

// The member function as the ABI calls it: `this` first. c10::DeviceIndex has been int8_t, and
// int16_t / int before; each has its own mangled name, and the one found picks the matching
// function (a narrow argument's upper register bits are not defined).
template <class Device>
void cache_info(void* /*self*/, Device device, size_t* largest) {
  LargestBlockFn fn = g_largest.load(std::memory_order_acquire);
  if (largest) *largest = fn ? fn(static_cast<int>(device)) : 0;
}

struct Variant {
  const char* symbol;
  void* answer;
};
const Variant kVariants[] = {
    {"_ZN5torch4cuda22CUDAPluggableAllocator22CUDAPluggableAllocator9cacheInfoEaPm",
     reinterpret_cast<void*>(&cache_info<int8_t>)},
    {"_ZN5torch4cuda22CUDAPluggableAllocator22CUDAPluggableAllocator9cacheInfoEsPm",
     reinterpret_cast<void*>(&cache_info<int16_t>)},
    {"_ZN5torch4cuda22CUDAPluggableAllocator22CUDAPluggableAllocator9cacheInfoEiPm",
     reinterpret_cast<void*>(&cache_info<int>)},
};

// dlsym in a library only if it is already loaded (never loads one).
void* symbol_in(const char* lib, const char* name) {
  void* h = dlopen(lib, RTLD_NOLOAD | RTLD_LAZY);
  if (!h) return nullptr;
  void* p = dlsym(h, name);
  dlclose(h);  // drops the reference NOLOAD took; torch keeps the library loaded
  return p;
}

std::mutex install_mutex;
void** g_copy = nullptr;        // our vtable (guarded by install_mutex; never freed)
void* const* g_source = nullptr;  // the vtable it copies

}  // namespace

std::string install_cache_info(LargestBlockFn largest) {
  std::lock_guard<std::mutex> lock(install_mutex);
  auto* vt = static_cast<void* const*>(symbol_in("libtorch_cuda.so", kVtable));
  if (!vt) return "libtorch_cuda.so (PyTorch with CUDA) is not loaded, or has no CUDAPluggableAllocator";
  const Variant* v = nullptr;
  void* target = nullptr;
  for (const Variant& c : kVariants) {
    if ((target = symbol_in("libtorch_cuda.so", c.symbol))) {
      v = &c;
      break;
    }
  }
  if (!v) return "libtorch_cuda.so exports no CUDAPluggableAllocator::cacheInfo";
  auto* current = static_cast<std::atomic<void*>*>(symbol_in("libc10_cuda.so", kAllocator));
  if (!current) return "libc10_cuda.so has no c10::cuda::CUDACachingAllocator::allocator";
  // a variable's mangled name says nothing of its type: read it only if it is one pointer
  Dl_info info{};
  void* entry = nullptr;  // the symbol's ElfW(Sym)
  if (!dladdr1(current, &info, &entry, RTLD_DL_SYMENT) || !entry ||
      static_cast<const ElfW(Sym)*>(entry)->st_size != sizeof(void*) ||
      ELF64_ST_TYPE(static_cast<const ElfW(Sym)*>(entry)->st_info) != STT_OBJECT)
    return "c10::cuda::CUDACachingAllocator::allocator is not one pointer in this PyTorch";

  entry = nullptr;  // the vtable's ElfW(Sym)
  if (!dladdr1(vt, &info, &entry, RTLD_DL_SYMENT) || !entry || !info.dli_sname ||
      std::strcmp(info.dli_sname, kVtable) != 0)
    return "the size of CUDAPluggableAllocator's vtable is not in the symbol table";
  size_t n = static_cast<const ElfW(Sym)*>(entry)->st_size / sizeof(void*);
  size_t slot = 0, found = 0;
  for (size_t k = 2; k < n; ++k) {  // [offset-to-top, typeinfo, virtual functions...]
    if (vt[k] == target) {
      slot = k;
      ++found;
    }
  }
  if (found != 1)
    return "cacheInfo is in " + std::to_string(found) + " slots of CUDAPluggableAllocator's vtable (expected 1)";

  void* object = current->load(std::memory_order_acquire);
  if (!object) return "PyTorch has no current CUDA allocator";
  auto** vptr = reinterpret_cast<void**>(object);  // the object's first word
  const void* now = __atomic_load_n(vptr, __ATOMIC_ACQUIRE);
  if (g_copy && g_source == vt && now == static_cast<const void*>(g_copy + 2)) return "";
  if (now != static_cast<const void*>(vt + 2))
    return "PyTorch's current CUDA allocator is not a CUDAPluggableAllocator";
  if (!g_copy || g_source != vt) {
    g_copy = new void*[n];  // never freed: the object may be destroyed as late as exit
    std::memcpy(g_copy, vt, n * sizeof(void*));
    g_copy[slot] = v->answer;
    g_source = vt;
  }
  g_largest.store(largest, std::memory_order_release);
  __atomic_store_n(vptr, static_cast<void*>(g_copy + 2), __ATOMIC_RELEASE);
  return "";
}

}  // namespace vmalloc
