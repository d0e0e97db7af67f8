// The allocator's view of a device: reserve virtual address space, create physical chunks, map a
// chunk at an address, and order work with events. Two backends implement it:
//   cuda  the CUDA driver VMM API (cuMemAddressReserve / cuMemCreate / cuMemMap / ...), libcuda.so.1
//         opened with dlopen at first use so the module imports on machines without a GPU;
//   host  one memfd whose chunk-sized slots are the "physical chunks", mapped with
//         mmap(MAP_FIXED|MAP_SHARED) into ranges reserved with PROT_NONE: the same VMM semantics
//         with real page mappings, so every test without a GPU exercises the allocator for real.
// Backends are not thread-safe; the allocator serializes all calls under its lock.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace vmalloc {
namespace driver {

using ChunkHandle = uint64_t;  // a physical chunk (CUmemGenericAllocationHandle / memfd slot + 1)
using EventHandle = uintptr_t; // a recorded event; 0 = trivially complete (host backend)

// The device (or the host) has no memory left for a new chunk: the allocator reclaims cached chunks
// and retries before it reports OutOfMemory.
struct DriverOutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The driver is shutting down (CUDA_ERROR_DEINITIALIZED: the CUDA runtime's teardown at process
// exit while C++ statics, thread-locals or late garbage collection still free tensors). No call
// succeeds again, and the driver takes all the process's device memory with it: the paths that
// must not throw (free, close, the destructor) leak quietly; the others raise this.
struct DriverShutDown : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Driver {
 public:
  virtual ~Driver() = default;
  virtual const char* name() const = 0;
  // Physical chunk sizes and mapped addresses must be multiples of this.
  virtual size_t granularity() const = 0;
  // Total memory of the device (cuda) or of the machine (host), bytes: for reports.
  virtual size_t total_memory() const = 0;
  // Memory the device could still give now (cuMemGetInfo's free bytes; host: free RAM), bytes.
  virtual size_t free_memory() = 0;

  // Reserve `size` bytes of virtual address space (inaccessible until mapped).
  virtual uintptr_t reserve(size_t size) = 0;
  virtual void unreserve(uintptr_t va, size_t size) = 0;

  // Create / release one physical chunk of `size` bytes. create throws DriverOutOfMemory when the
  // device is full. Every create of one driver must use the same size.
  virtual ChunkHandle create(size_t size) = 0;
  virtual void release(ChunkHandle h) = 0;

  // Map chunk `h` (of `size` bytes) at `va` inside a reservation. The memory is accessible only
  // after set_access over the mapped range (one call may cover several chunks mapped back to back).
  virtual void map(uintptr_t va, size_t size, ChunkHandle h) = 0;
  virtual void set_access(uintptr_t va, size_t size) = 0;
  // Undo one map() (exactly the range one map() covered); the address stays reserved.
  virtual void unmap(uintptr_t va, size_t size) = 0;
  // From now on set_access also gives `device` read-write access (a process whose kernels on
  // one GPU read another GPU's memory: mapped memory is accessible only to the devices named).
  // False when `device` has no peer-to-peer path to this one. The host backend has no devices.
  virtual bool add_peer(int /*device*/) { return false; }
  // Undo add_peer (granting it to what is mapped failed): later set_access calls leave it out.
  virtual void remove_peer(int /*device*/) {}
  virtual bool has_peer(int /*device*/) const { return false; }
  // Wait for all work queued on the device (close(): nothing is unmapped under a running kernel).
  virtual void synchronize() {}

  // Events order host decisions after device work: record on a stream, then query or wait.
  virtual EventHandle record_event(uintptr_t stream) = 0;
  virtual bool event_done(EventHandle e) = 0;
  virtual void event_wait(EventHandle e) = 0;
  virtual void event_destroy(EventHandle e) = 0;

  // Throws DriverShutDown when a call of this process has seen the driver shutting down (and it
  // still is): for the paths that may succeed without any driver call (a malloc from the cache).
  // One relaxed load on those fast paths; the backend is asked only once the flag is set.
  void check_not_shut_down() {
    if (shut_down_seen.load(std::memory_order_relaxed)) probe_shut_down();
  }
  // Set by a backend when one of its calls found the driver shutting down (cuda_driver.cpp).
  static inline std::atomic<bool> shut_down_seen{false};

  // The flag is set: throw DriverShutDown if the driver still is shutting down, else clear it.
  virtual void probe_shut_down() { shut_down_seen.store(false, std::memory_order_relaxed); }

  // close(): everything was unmapped and released (or tried to be); drop what the backend still
  // holds (the host backend closes its memfd, which frees any chunk a failed release left
  // committed). No driver call follows except granularity()/total_memory(). Never throws.
  virtual void shutdown() noexcept {}

  // --- test hooks (host backend; others throw std::invalid_argument) ---
  // The `nth` next call of `call` (1 = the very next one) and the `count` - 1 calls after it
  // (count 0: every call from then on) fail as if the system call had returned errno `err`.
  // `call`: create, release, map, unmap, reserve, unreserve, record, or any (every kind counts).
  // nth = 0 disarms `call`.
  virtual void inject_fault(const std::string& call, uint64_t nth, int err, uint64_t count);
  struct Usage {
    size_t committed_bytes = 0;  // physical memory the backend holds (host: the memfd's blocks)
    size_t mapped_bytes = 0;     // bytes currently mapped by map() and not unmapped
    uint64_t faults_fired = 0;   // injected faults that fired
  };
  virtual Usage usage() const { return {}; }
};

// "host", "host-lazy" or "cuda"; std::invalid_argument naming `backend` for anything else. The
// cuda backend throws std::runtime_error when it was compiled without cuda.h or the driver cannot
// be loaded.
std::unique_ptr<Driver> make_driver(const std::string& backend, int device);

std::unique_ptr<Driver> make_host_driver(bool commit = true);  // false: host-lazy
std::unique_ptr<Driver> make_cuda_driver(int device);

// Granularity without creating chunks (the host page size; the CUDA minimum granularity).
size_t host_granularity();
size_t cuda_granularity(int device);

}  // namespace driver
}  // namespace vmalloc
