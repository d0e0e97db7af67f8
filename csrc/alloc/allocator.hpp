// vmalloc's native allocator: fixed-size physical chunks mapped back to back into contiguous
// virtual ranges (seed 003, section 4), plus a small-block sub-allocator for requests below
// `small_threshold`. This header is the C++ contract other parts build against (the PyTorch C
// entry points, the swap runtime): keep it stable; only add to it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace vmalloc {

struct Config {
  std::string backend = "host";        // "host" (memfd + mmap), "host-lazy" (no RAM until written)
                                       // or "cuda" (driver VMM API)
  size_t chunk_size = 2u << 20;        // bytes per physical chunk; a multiple of the granularity
  size_t budget = 0;                   // cap on physical bytes; 0 = none
  int device = 0;                      // CUDA device ordinal (ignored by the host backend)
  size_t small_threshold = 1u << 20;   // requests below this come from the small-block bins
  // --- additions (reuse policy knobs; the defaults are what measured best, see allocator.cpp) ---
  bool split_cached = true;   // serve k chunks from the tail of a larger cached mapped range
  bool prefer_remap = false;  // slow path: remap cached chunks before creating new ones (leaner, slower)
  bool merge_cached = true;   // a freed range joins the cached ranges right before and after it in VA
                              // (with split_cached only: a joined range is reused by splitting it)
  // Slow path without a budget: new chunks are created only while physical memory stays below
  // (1 + cache_slack) x the peak of chunks in use; past that, cached chunks are remapped first.
  // < 0: no such cap (the default: a caching allocator). With a budget, chunks are created up to
  // the budget first. prefer_remap overrides both (cache_slack = 0, budget or not).
  // The default is measured (issue 12, bench/results/cache_slack.json): on an H100 a remap costs
  // 44 us per 2 MiB chunk. Before cached ranges were joined (merge_cached) every finite slack's
  // remaps took 50-134% of some training step on the real traces recorded there. Joined, 0.5
  // remaps at most 2.7% of a step on them, for 13% less memory on one; but once a second stream
  // stops the joins, a cap thrashes on cycles the traces do not have (4, 2, 6 MiB malloc+free
  // in turn: 8.8 us a pair at 0.5 against 36 ns), so no cap stays the default.
  double cache_slack = -1.0;
  // Allocation-trace ring (set_trace): the most recent events kept; older ones are dropped and
  // counted (Stats::num_trace_dropped). 0 keeps none.
  size_t trace_capacity = 100000;
};

// Thrown when a request would take physical memory past the budget (after the pressure callback,
// if any, had its chance). The allocator stays usable.
struct OutOfMemory : std::runtime_error {
  size_t requested;  // bytes asked for by the caller
  size_t in_use;     // physical bytes held by the allocator when it gave up
  size_t budget;     // the budget in force
  OutOfMemory(const std::string& what, size_t requested_, size_t in_use_, size_t budget_)
      : std::runtime_error(what), requested(requested_), in_use(in_use_), budget(budget_) {}
};

// A snapshot of the counters. The first block is exactly the DESIGN.md `stats()` keys (bytes
// unless a count); the rest are extras for reports and benchmarks.
struct Stats {
  // --- DESIGN.md keys ---
  size_t requested_current = 0;       // bytes asked for by live allocations
  size_t requested_peak = 0;
  size_t mapped_current = 0;          // bytes of VA handed to live allocations (k * chunk_size for
                                      // large ones; the rounded block size for small ones)
  size_t mapped_peak = 0;
  size_t physical_current = 0;        // physical chunks held (in use + cached), bytes
  size_t physical_peak = 0;
  size_t internal_fragmentation = 0;  // mapped_current - requested_current
  uint64_t num_malloc = 0;
  uint64_t num_free = 0;
  uint64_t num_map = 0;               // chunk map operations (one per chunk)
  uint64_t num_unmap = 0;             // chunk unmap operations (one per chunk)
  uint64_t num_chunks_created = 0;    // physical chunks ever created
  size_t chunk_size = 0;
  // --- extras ---
  size_t budget = 0;                  // 0 = none
  size_t granularity = 0;             // device allocation granularity the chunk size respects
  uint64_t num_chunks_released = 0;   // physical chunks given back to the driver (trim/close)
  size_t cached_bytes = 0;            // physical bytes held but not backing a live allocation
  uint64_t num_live = 0;              // live allocations (small + large)
  uint64_t num_cache_hits = 0;        // range acquisitions (large mallocs and new small-block slabs)
                                      // served by a mapped cached range, no driver call
  uint64_t num_remaps = 0;            // range acquisitions that had to map chunks (slow path)
  uint64_t num_splits = 0;            // cache hits served from the tail of a larger cached range
  uint64_t num_merges = 0;            // cached ranges joined to a range freed next to them in VA
  uint64_t num_small_malloc = 0;      // mallocs served by the small-block bins
  uint64_t num_small_free = 0;
  size_t small_requested_current = 0; // requested bytes of live small allocations
  size_t small_pool_bytes = 0;        // physical bytes currently carved into small-block slabs
  uint64_t num_oom = 0;               // OutOfMemory thrown
  uint64_t num_pressure_calls = 0;    // pressure callback invocations
  uint64_t num_stream_waits = 0;      // times a cached range/chunk was held back by pending stream work
  uint64_t num_va_reserve = 0;        // VA spans reserved from the driver
  size_t va_reserved = 0;             // bytes of VA reserved
  double driver_seconds = 0;          // wall time spent in driver calls (create/map/unmap/release)
  uint64_t num_trace_dropped = 0;     // trace events dropped by the bounded ring (oldest first)
};

// One allocation-history event, in the project's trace format (brief contract 2):
// {"action": "alloc"|"free", "id", "size", "stream", "time"}; `addr` is extra (for snapshots).
struct TraceEvent {
  enum Action : uint8_t { kAlloc = 0, kFree = 1 };
  Action action;
  uint64_t id;       // pairs an alloc with its free
  size_t size;       // requested bytes (a free carries the size of its alloc)
  uintptr_t stream;  // the allocation stream
  double time;       // seconds since the allocator was constructed (steady clock)
  uintptr_t addr;    // the address handed out
  const char* action_name() const { return action == kAlloc ? "alloc" : "free"; }
};

class Allocator {
 public:
  // Throws std::invalid_argument for a bad config (unknown backend, chunk size not a multiple of
  // the granularity, budget below one chunk, ...) and std::runtime_error for driver failures
  // (with the driver's error string).
  explicit Allocator(const Config& cfg);
  ~Allocator();  // close()s
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // Returns device memory of at least `nbytes` (> 0) bytes, usable on `stream`. 256-byte aligned
  // (small) / chunk aligned (large). Throws OutOfMemory past the budget, std::invalid_argument for
  // nbytes == 0, std::runtime_error once closed, driver::DriverShutDown (a std::runtime_error)
  // once the CUDA driver is shutting down (process exit; record_stream and trim too).
  void* malloc(size_t nbytes, uintptr_t stream = 0);
  // Like malloc, but returns nullptr where malloc throws OutOfMemory, and never calls the pressure
  // callback (for callers holding a lock the callback may need: PyTorch's MemPool path). Other
  // errors (closed, nbytes == 0, driver failures) still throw.
  void* try_malloc(size_t nbytes, uintptr_t stream = 0);
  // Throws std::invalid_argument if `p` is not a live allocation (unknown or already freed).
  // While the CUDA driver is shutting down (process exit) it returns quietly and leaves `p` live:
  // the driver takes its memory with it.
  void free(void* p);
  // `p` is also used on `stream`: its memory is not reused until the work queued on `stream` up to
  // the free is complete (torch's record_stream).
  void record_stream(void* p, uintptr_t stream);
  // Give `device` read-write access to all memory this allocator has mapped and will map (one
  // process, several GPUs: a kernel or peer copy of `device` reading these tensors). False, with
  // nothing changed, when `device` has no peer-to-peer path to this allocator's device (and on
  // the host backend). Driver errors throw std::runtime_error.
  bool add_peer(int device);

  Stats stats() const;
  void reset_peak();                   // peaks := current values (torch.cuda.reset_peak_memory_stats)
  size_t trim();                       // release cached chunks to the driver; returns bytes released
  void set_budget(size_t bytes);       // 0 = none; never frees live memory
  // Asked before failing with OutOfMemory: `needed` bytes are missing. Return true if it freed
  // something (the allocator then retries once). Called without the allocator's lock held, so it
  // may call free()/malloc() on this allocator.
  void set_pressure_callback(std::function<bool(size_t needed)> cb);
  void set_trace(bool on);             // start/stop recording alloc/free events
  std::vector<TraceEvent> take_trace();  // the recorded events, oldest first (and clears them)
  void set_trace_capacity(size_t events);  // bound of the trace ring (Config::trace_capacity)
  void close();                        // return everything to the driver (and drop the pressure
                                       // callback); idempotent. Later calls throw std::runtime_error,
                                       // except stats(), debug_state(), config(), granularity(),
                                       // total_memory(), closed(), forked(), close() and
                                       // set_pressure_callback(nullptr) (nothing to drop).

  // --- additions beyond the contract ---
  const Config& config() const;
  size_t granularity() const;           // device allocation granularity (bytes)
  bool closed() const;
  size_t allocation_size(const void* p) const;  // requested bytes of a live allocation, 0 if unknown
  // (address, requested bytes) of every live allocation, by address: what a memory snapshot
  // lists, whenever its history began
  std::vector<std::pair<uintptr_t, size_t>> live_allocations() const;
  size_t total_memory() const;          // device memory (cuda) / machine RAM (host), bytes: for
                                        // memory fractions (torch.cuda.set_per_process_memory_fraction)
  // The largest malloc that succeeds now without the pressure callback: the cached chunks (any of
  // them serves any request) plus the whole chunks the budget and the device still allow (one
  // driver call: the device's free memory). What cuDNN's autotuner sizes its workspaces by.
  size_t largest_available();
  // True in a process forked after this allocator was built: it is dead there (every call but
  // close()/closed() throws; close() and the destructor release nothing of the parent's).
  bool forked() const;

  // --- test hooks ---
  // Make driver calls fail (host backend only; see driver::Driver::inject_fault).
  void inject_fault(const std::string& call, uint64_t nth, int err, uint64_t count = 1);
  struct DebugState {
    size_t committed_bytes = 0;      // the backend's own count of committed memory
    size_t mapped_bytes = 0;         // the backend's own count of mapped bytes
    uint64_t faults_fired = 0;
    size_t free_chunks = 0, cached_range_chunks = 0, slab_chunks = 0, chunks_held = 0;
    uint64_t close_block_visits = 0; // small blocks walked by close() (linear: one per block)
    size_t trace_events = 0;         // events held in the trace ring
  };
  DebugState debug_state() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Allocation granularity of a backend/device without building an allocator (the Python face uses
// it for error messages). Throws std::invalid_argument for an unknown backend.
size_t backend_granularity(const std::string& backend, int device);

}  // namespace vmalloc
