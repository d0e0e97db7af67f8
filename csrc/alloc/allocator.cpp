// The allocator core (seed 003, section 4).
//
// Large requests (>= small_threshold) take k = ceil(n / chunk_size) physical chunks mapped back to
// back into one contiguous virtual range, so internal fragmentation per allocation is < chunk_size
// (Eq. 1) and any free chunk serves any request. A freed range stays mapped in a cache bucketed by
// chunk count, joined to the cached ranges right before and after it in VA (merge_cached, as
// PyTorch's caching allocator joins a segment's free neighbours: no driver call; a piece split off
// a cached range, freed, joins the rest again). Reuse paths, in the order tried (nnabla's
// VirtualCachingAllocator has four; these are the ones we keep, and why):
//   1. exact: a cached range with the same chunk count is handed back as is — no driver call.
//   2. split: the last k chunks of the smallest larger cached range are handed out and the rest
//      stays cached as a shorter mapped range — still no driver call. In the bench's policy table it
//      halves (or better) the maps per malloc at every setting of the other knobs with no more
//      physical memory (e.g. static trace under a budget 0.36 vs 0.86, dynamic 0.64 vs 1.71).
//   3. fresh mapping: k chunks from the free-chunk pool, newly created chunks, or chunks unmapped
//      from the tails of cached ranges (oldest first) are mapped into a new VA range. Which of
//      "create" and "remap cached" comes first is the memory/speed trade-off; the bench's policy
//      table (bench/results/alloc_micro.json, 2 MiB chunks, training-like traces) measured:
//        no cap (grow first, a caching allocator): 0 maps/malloc in steady state, physical peak
//          1.19x requested peak (static shapes) / 1.07x (dynamic); without joining cached
//          neighbours (merge_cached off) 1.47x / 2.8x, and 0.39 maps/malloc (dynamic);
//        remap first (prefer_remap, the paper's scheme): 1.03-1.06x, 0 steady maps/malloc
//          joined (0.38-0.63 without joining);
//        cache_slack 0.25 / 0.5: grow while physical <= 1.25 / 1.5 x peak chunks in use, then
//          remap: joined, the same as no cap on these single-stream traces.
//      On a GPU a remap is dear (44 us per 2 MiB chunk on an H100). Replayed, the real traces
//      recorded there spent 50-134% of a step remapping under every finite slack before cached
//      ranges were joined; joined, the single-stream ones need no remap at any slack >= 0.1, and
//      those with the swap runtime's second stream (nothing joined then) spend at most 2.7% of a
//      step at 0.5 for up to 13% less memory than no cap; but with nothing joined a cap thrashes
//      on a cycle of mixed sizes (8.8 us a malloc+free against 36 ns), so no cap is the default
//      (issue 12, bench/results/cache_slack.json).
//      With a budget, we grow up to the budget first: that memory is ours anyway.
//   nnabla's fourth path, growing a smaller cached range in place by mapping chunks into the VA
//   right after it, is not kept: it still maps the missing chunks one by one (the dominant cost of
//   path 3), it needs the neighbouring VA to be free (rare once spans are shared by many ranges),
//   and path 3 already reuses that range's chunks when the budget binds.
// Small requests come from SmallBins (one-chunk slabs carved with 512-byte rounding).
//
// Streams: a range or block is reused on the stream it was freed on without waiting (stream
// order covers it); another stream gets it only after events recorded on every stream that used it
// are complete. record_stream adds streams. On the host backend events are trivially complete but
// the bookkeeping is the same. Those events are RangeEvents' (range_events.hpp).
//
// Failures (every driver error, not only out-of-memory): each operation either completes or leaves
// the allocator as it was, with every chunk it holds counted once, in a place trim()/close() reach:
// chunks gathered for a mapping go back to the free pool, a range whose unmap fails keeps its
// still-mapped chunks (cached), a chunk whose release fails stays in the pool, free() records its
// events before it retires the pointer. trim() releases what it can and then reports the first
// error. close() and the destructor never throw, never allocate, and release everything (each
// driver call on its own; the host backend's shutdown frees what a failed release left).
// The driver shutting down (driver::DriverShutDown, at process exit) is the end, not a failure to
// recover from: free() leaves the pointer live and returns, close() and the destructor try every
// call quietly as always, and the driver takes the memory with it; malloc, trim and record_stream
// raise it (once any call has seen it, before they use the cache).
//
// fork(): an allocator belongs to the process that built it. An at-fork handler bumps a
// generation counter; in a child every call raises, close() and the destructor release nothing
// (the parent's chunks, memfd and handles are the parent's; the host backend's mappings are
// MADV_DONTFORK, so the child has none of them) and the bookkeeping is left to the child's exit.
//
// Thread safety: one mutex around all state. The critical sections are a few hundred nanoseconds
// on the fast paths (PyTorch's caching allocator also uses one mutex per device), the slow path's
// driver calls are serialized inside the driver anyway, and a single lock makes "never overlap,
// never leak" easy to see. The pressure callback runs without the lock so it may free memory.
#include "alloc/allocator.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#include <pthread.h>

#include "alloc/cache_buckets.hpp"
#include "alloc/format_bytes.hpp"
#include "alloc/ptr_map.hpp"
#include "alloc/quiet.hpp"
#include "alloc/range.hpp"
#include "alloc/range_events.hpp"
#include "alloc/small_bins.hpp"
#include "alloc/trace_ring.hpp"
#include "alloc/va_space.hpp"
#include "driver/driver.hpp"

namespace vmalloc {

using driver::ChunkHandle;
using driver::EventHandle;

namespace {

constexpr size_t kDefaultSpanBytes = size_t(64) << 30;  // VA per reservation (nothing committed)
constexpr size_t kMaxRequest = size_t(1) << 62;
constexpr size_t kMaxChunk = size_t(1) << 47;  // a 47-bit user address space: larger cannot be mapped

// Bumped in every forked child (pthread_atfork): an allocator built in another generation is dead.
std::atomic<uint64_t> g_fork_generation{0};
void on_fork_child() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }
void install_fork_handler() {
  static std::once_flag once;
  std::call_once(once, [] { ::pthread_atfork(nullptr, nullptr, on_fork_child); });
}

// A byte count with its peak: PyTorch's CUDACachingAllocator Stat, less the allocated/freed
// totals, which nothing here reports. The peak follows the current value up, and comes down to it
// only at reset_peak().
struct Stat {
  size_t current = 0;
  size_t peak = 0;
  void add(size_t n) {
    current += n;
    peak = std::max(peak, current);
  }
  void sub(size_t n) { current -= n; }
  void reset_peak() { peak = current; }
};

std::string hex(uintptr_t p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(p));
  return buf;
}

// Live-map values: a Range* or a Block* with the low bit set (both are heap objects, aligned).
inline uintptr_t tag_block(Block* b) { return reinterpret_cast<uintptr_t>(b) | 1u; }
inline bool is_block(uintptr_t v) { return v & 1u; }
inline Block* as_block(uintptr_t v) { return reinterpret_cast<Block*>(v & ~uintptr_t(1)); }
inline Range* as_range(uintptr_t v) { return reinterpret_cast<Range*>(v); }

// What a public call needs besides the lock (Allocator::Impl::Guard).
enum class Need {
  lock,    // the lock only (works on a closed allocator)
  open,    // not closed
  driver,  // not closed, and the driver not shutting down (malloc, record_stream): the cache would
           // otherwise serve them without a driver call
};

}  // namespace

struct Allocator::Impl {
  Config cfg;
  std::unique_ptr<driver::Driver> drv;
  size_t chunk = 0;
  size_t gran = 0;
  size_t small_limit = 0;  // requests below this (and fitting a slab) are small
  mutable std::mutex mu;
  std::unique_ptr<VaSpace> va;
  SmallBins small;

  std::vector<ChunkHandle> free_chunks;        // unmapped, safe for every stream
  size_t chunks_held = 0;                      // physical chunks created and not released
  CacheBuckets cache;                          // mapped cached ranges by chunk count
  // cached ranges by first address and by end address (merge_cached: a freed range's neighbours)
  // (open addressing, as `live`: the fast path allocates nothing)
  PtrMap cached_from, cached_to;
  Range* lru_head = nullptr;                   // oldest cached range
  Range* lru_tail = nullptr;
  size_t cached_range_chunks = 0;
  size_t slab_chunks = 0;
  size_t peak_in_use_chunks = 0;               // peak of chunks backing live ranges and slabs
  PtrMap live;                                 // address -> Range* | tagged Block*
  RangeEvents events;                          // what freed memory waits for before reuse

  // The reported byte counts with a peak: stats() copies them into the Stats keys of the same
  // names (st's own fields of those names stay unused).
  struct Sizes {
    Stat requested;  // asked for by live allocations
    Stat mapped;     // VA handed to live allocations
    Stat physical;   // physical chunks held: chunks_held * chunk
  } bytes;
  Stats st;          // every other counter
  bool closed = false;
  std::thread::id per_thread_caller;  // the first thread that passed the per-thread handle
  bool warned_per_thread = false;

  uint64_t fork_generation = g_fork_generation.load(std::memory_order_relaxed);
  size_t device_limit = 0;  // device memory (host: physical RAM); 0 = unknown
  std::string failure;      // why the current malloc attempt could not get memory (for OutOfMemory)

  bool trace_on = false;
  TraceRing trace{Config().trace_capacity};
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  std::function<bool(size_t)> pressure;
  uint64_t next_id = 1;

  // ---- driver calls, timed ----
  template <class F>
  auto timed(F&& f) -> decltype(f()) {
    struct T {
      Stats& st;
      std::chrono::steady_clock::time_point a = std::chrono::steady_clock::now();
      ~T() { st.driver_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count(); }
    } t{st};
    return f();
  }

  void note_stream(uintptr_t s) {
    events.note_stream(s);
    if (s == kPerThreadStream) note_per_thread_caller();
  }
  // The per-thread handle names a different stream in each thread, and vmalloc keys streams by
  // handle: from a second thread, memory freed by one thread can be reused by another before the
  // first one's queued work is done. Not silent: said once per allocator (README, "What does not
  // work with a pluggable allocator").
  void note_per_thread_caller() {
    std::thread::id me = std::this_thread::get_id();
    if (per_thread_caller == std::thread::id()) {
      per_thread_caller = me;
    } else if (me != per_thread_caller && !warned_per_thread) {
      warned_per_thread = true;
      std::fprintf(stderr,
                   "vmalloc: warning: the per-thread default stream handle (CU_STREAM_PER_THREAD, "
                   "e.g. CuPy's Stream.ptds) is used from several threads; each thread's is a "
                   "different stream that vmalloc cannot tell apart by its handle, so memory freed "
                   "in one thread may be reused in another before the first thread's queued work "
                   "is done. Use explicit streams (cudaStreamCreate, cupy.cuda.Stream()).\n");
    }
  }

  double now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  bool forked() const { return g_fork_generation.load(std::memory_order_relaxed) != fork_generation; }

  void record_trace(TraceEvent::Action a, uint64_t id, size_t size, uintptr_t stream, uintptr_t addr) {
    trace.push(TraceEvent{a, id, size, stream, now(), addr});
  }

  // ---- physical chunks ----
  void on_chunk_created() {
    ++chunks_held;
    ++st.num_chunks_created;
    bytes.physical.add(chunk);
  }
  void release_chunk(ChunkHandle h) {
    timed([&] { drv->release(h); });
    --chunks_held;
    ++st.num_chunks_released;
    bytes.physical.sub(chunk);
  }
  bool budget_allows_one_more() const { return cfg.budget == 0 || (chunks_held + 1) * chunk <= cfg.budget; }
  bool device_allows_one_more() const { return device_limit == 0 || (chunks_held + 1) * chunk <= device_limit; }

  // ---- the cache of mapped ranges ----
  // merge_cached needs split_cached: a joined range is reused by splitting pieces off (without
  // splits only exact sizes are hits, and joined sizes rarely recur: the cache would only grow)
  bool merging() const { return cfg.merge_cached && cfg.split_cached; }
  // (the maps may grow: a failure there is std::bad_alloc, as any allocation's)
  void cache_insert(Range* r) {
    cache.push(r);  // first: the one step here that may throw (a bucket growing)
    if (merging()) {  // (room made first: free() reserves it, the other callers took a key out)
      cached_from.insert(r->addr, reinterpret_cast<uintptr_t>(r));
      cached_to.insert(r->addr + r->k * chunk, reinterpret_cast<uintptr_t>(r));
    }
    r->lru_prev = lru_tail;
    r->lru_next = nullptr;
    (lru_tail ? lru_tail->lru_next : lru_head) = r;
    lru_tail = r;
    cached_range_chunks += r->k;
  }
  void cache_remove(Range* r) {
    if (merging()) {
      uintptr_t v = 0;
      cached_from.take(r->addr, v);
      cached_to.take(r->addr + r->k * chunk, v);
    }
    cache.erase(r);
    (r->lru_prev ? r->lru_prev->lru_next : lru_head) = r->lru_next;
    (r->lru_next ? r->lru_next->lru_prev : lru_tail) = r->lru_prev;
    r->lru_prev = r->lru_next = nullptr;
    cached_range_chunks -= r->k;
  }

  // free() of a large range, second half (cannot fail on a driver error): cache it, still mapped.
  void cache_retired(Range* r) {
    r->all_ready = false;
    r->requested = 0;
    r->id = 0;
    r->is_slab = false;
    if (merging()) r = merge_neighbours(r);
    cache_insert(r);
  }

  // merge_cached: join the freed range `r` (not cached yet) with the cached ranges that end where
  // it begins and begin where it ends, as PyTorch's caching allocator joins free neighbours of a
  // segment: no driver call, and a larger request can reuse the whole (a split hands out a tail
  // and keeps the rest cached; freed, the tail joins it again) instead of mapping fresh chunks. Only
  // what one event can guard: the same owner stream, not the per-thread handle (another thread's
  // stream each time), no record_stream events, both accessible, one VA span. `r` is freed now,
  // so its owner event (if any) is the newest on that stream and covers the neighbours' work: it
  // stays; theirs go. Returns the range to cache (maybe a neighbour, grown).
  // Nothing here may throw (the free path cannot fail): the chunk list grows into room reserved
  // first (doubling: n neighbours freed one by one cost O(n), not O(n^2)), a join whose room
  // cannot be had is skipped, and dropping an event is quiet (a handle that would not go leaks,
  // which is harmless). Once a second stream has allocated, nothing is joined: a joined range
  // is ready for another stream only when its newest free's work is done, where its parts, apart,
  // would be as soon as each one's own is (a side stream, the swap runtime's, would map fresh
  // chunks or wait instead of reusing them).
  Range* merge_neighbours(Range* r) {
    if (events.multistream()) return r;
    auto joinable = [&](Range* n) {
      return !n->no_access && !r->no_access && n->stream == r->stream && r->stream != kPerThreadStream &&
             n->extra_events.empty() && r->extra_events.empty();
    };
    auto room = [](Range* into, size_t more) {
      if (into->chunks.capacity() >= into->k + more) return true;  // (a split only shrinks it)
      try {
        into->chunks.reserve(std::max(into->k + more, 2 * into->chunks.capacity()));
        return true;
      } catch (const std::bad_alloc&) {
        return false;
      }
    };
    auto cached_at = [](const PtrMap& m, uintptr_t addr) -> Range* {
      const uintptr_t* v = m.find(addr);
      return v ? reinterpret_cast<Range*>(*v) : nullptr;
    };
    auto append = [&](Range* into, Range* next) {  // `next` follows `into` in VA; goes
      into->chunks.insert(into->chunks.end(), next->chunks.begin(), next->chunks.end());
      into->k += next->k;
      ++st.num_merges;
      delete next;
    };
    Range* l = cached_at(cached_to, r->addr);
    if (l && joinable(l) && va->same_span(l->addr, l->k, r->k) && room(l, r->k)) {
      cache_remove(l);
      quiet([&] { events.drop_events(l); });  // r's event (recorded now) covers l's work
      l->owner_event = r->owner_event;
      l->has_owner_event = r->has_owner_event;
      l->all_ready = false;
      append(l, r);
      r = l;
    }
    Range* n = cached_at(cached_from, r->addr + r->k * chunk);
    if (n && joinable(n) && va->same_span(r->addr, r->k, n->k) && room(r, n->k)) {
      cache_remove(n);
      quiet([&] { events.drop_events(n); });
      append(r, n);
    }
    return r;
  }
  // An emptied slab leaves use: cached as a one-chunk range, never lost.
  void retire_slab(Range* r) {
    events.record_slab_owner_event(r);
    cache_retired(r);
  }

  // Unmap the last m chunks of a cached, fully ready range (last first); appends their handles to
  // `out`. When an unmap fails, the chunks unmapped so far still leave (in `out`), the range keeps
  // the rest, still mapped and cached, and the error propagates.
  void take_tail(Range* r, size_t m, std::vector<ChunkHandle>& out) {
    out.reserve(out.size() + m);  // nothing may fail between an unmap and recording its chunk
    cache_remove(r);
    size_t done = 0;
    std::exception_ptr err;
    for (; done < m; ++done) {
      size_t i = r->k - 1 - done;
      try {
        timed([&] { drv->unmap(r->addr + i * chunk, chunk); });
      } catch (...) {
        err = std::current_exception();
        break;
      }
      ++st.num_unmap;
      out.push_back(r->chunks[i]);
    }
    if (done == r->k) {
      va->give(r->addr, r->k);
      delete r;
    } else {
      if (done) va->give(r->addr + (r->k - done) * chunk, done);
      r->k -= done;
      r->chunks.resize(r->k);
      cache_insert(r);
    }
    if (err) std::rethrow_exception(err);
  }

  // Take up to `need` chunks from cached ranges, oldest first; with `wait`, wait for pending events.
  void reclaim_cached(size_t need, std::vector<ChunkHandle>& out, bool wait) {
    size_t got = 0;
    for (Range* r = lru_head; r && got < need;) {
      Range* next = r->lru_next;
      if (wait) events.wait_ready(r);
      if (events.fully_ready(r)) {
        size_t m = std::min(need - got, r->k);
        take_tail(r, m, out);
        got += m;
      }
      r = next;
    }
  }

  size_t in_use_chunks() const { return chunks_held - free_chunks.size() - cached_range_chunks; }
  void note_in_use() { peak_in_use_chunks = std::max(peak_in_use_chunks, in_use_chunks()); }

  // Create chunks until `out` has k or chunks_held reaches `cap` (and the budget allows).
  // `out` has room for k (the caller reserved it), so a created chunk is always recorded.
  void create_chunks(size_t k, std::vector<ChunkHandle>& out, bool& device_full, size_t cap = SIZE_MAX) {
    while (out.size() < k && !device_full && chunks_held < cap && budget_allows_one_more()) {
      if (!device_allows_one_more()) {
        device_full = true;
        failure = chunk > device_limit ? "one chunk is larger than the " + std::string(drv->name()) +
                                             " backend's memory (" + format_bytes_exact(device_limit) + ")"
                                       : "the " + std::string(drv->name()) + " backend's memory (" +
                                             format_bytes_exact(device_limit) + ") is full";
        break;
      }
      try {
        ChunkHandle h = timed([&] { return drv->create(chunk); });
        out.push_back(h);
        on_chunk_created();
      } catch (const driver::DriverOutOfMemory& e) {
        device_full = true;
        failure = e.what();
      }
    }
  }

  void release_empty_slabs() {
    for (Range* r : small.take_empty_slabs()) {
      slab_chunks -= r->k;
      retire_slab(r);
    }
  }

  // Collect k unmapped chunks for a fresh mapping; false (and `missing` bytes) when impossible.
  bool gather(size_t k, std::vector<ChunkHandle>& out, size_t& missing, bool& device_full) {
    // Without a budget: grow freely up to (1 + slack) x the peak demand, then prefer remapping
    // cached chunks (an idle cache past that is memory nobody needed at the peak), then grow.
    // With a budget, that memory is ours anyway: grow up to it first (fewest remaps), unless
    // prefer_remap asks for the leanest footprint.
    size_t demand = std::max(peak_in_use_chunks, in_use_chunks() + k);
    double slack = cfg.prefer_remap ? 0.0 : cfg.budget != 0 ? -1.0 : cfg.cache_slack;
    size_t soft_cap = slack < 0 ? SIZE_MAX : static_cast<size_t>(std::ceil(double(demand) * (1.0 + slack)));
    // Every chunk gathered goes back to the free pool when this fails (driver error or too few):
    // the pool has room for all of them, so giving back cannot fail.
    free_chunks.reserve(chunks_held + k);
    auto give_back = [&] {
      for (auto h : out) free_chunks.push_back(h);
      out.clear();
    };
    try {
      while (out.size() < k && !free_chunks.empty()) {
        out.push_back(free_chunks.back());
        free_chunks.pop_back();
      }
      create_chunks(k, out, device_full, soft_cap);
      // the soft cap's remap is a preference: a driver error there (an unmap refused) must not
      // fail a malloc that growing would serve; it is raised only if nothing else serves it
      // (without a cap creating has already stopped: the error is raised as before)
      std::exception_ptr optional_err;
      if (out.size() < k) {
        try {
          reclaim_cached(k - out.size(), out, false);
        } catch (...) {
          optional_err = std::current_exception();
        }
      }
      create_chunks(k, out, device_full);
      if (optional_err && out.size() < k) std::rethrow_exception(optional_err);
      if (out.size() < k) {
        release_empty_slabs();
        reclaim_cached(k - out.size(), out, false);
      }
      if (out.size() < k) reclaim_cached(k - out.size(), out, true);
    } catch (...) {
      give_back();
      throw;
    }
    if (out.size() < k) {
      missing = (k - out.size()) * chunk;
      give_back();
      return false;
    }
    return true;
  }

  Range* map_fresh(size_t k, size_t& missing, bool& device_full) {
    std::vector<ChunkHandle> handles;
    handles.reserve(k);
    if (!gather(k, handles, missing, device_full)) return nullptr;
    uintptr_t addr = 0;
    size_t mapped = 0;
    // Chunks go back to the free pool (room reserved by gather) on any failure below.
    try {
      addr = timed([&] { return va->take(k); });
    } catch (const driver::DriverOutOfMemory& e) {
      for (auto h : handles) free_chunks.push_back(h);
      // No address space left is running out of memory, whatever the backend calls it.
      missing = k * chunk;
      failure = std::string("cannot reserve ") + format_bytes_exact(k * chunk) + " of virtual address space (" +
                e.what() + ")";
      return nullptr;
    } catch (...) {
      // Not out of memory (EIO, EPERM, a CUDA error other than out of memory, the driver shutting
      // down): raised as it is, as a failed map or create is; freeing memory would not help.
      for (auto h : handles) free_chunks.push_back(h);
      throw;
    }
    try {
      for (; mapped < k; ++mapped) timed([&] { drv->map(addr + mapped * chunk, chunk, handles[mapped]); });
      timed([&] { drv->set_access(addr, k * chunk); });
    } catch (const std::exception& e) {
      // Undo chunk by chunk. A chunk whose unmap fails too stays mapped where it is: it becomes a
      // one-chunk cached range (untouched by any stream), so it is counted, reusable, trimmable.
      for (size_t i = 0; i < k; ++i) {
        uintptr_t at = addr + i * chunk;
        bool unmapped = i >= mapped;
        if (!unmapped) {
          try {
            drv->unmap(at, chunk);
            ++st.num_unmap;
            unmapped = true;
          } catch (...) {
          }
        }
        if (unmapped) {
          va->give(at, 1);
          free_chunks.push_back(handles[i]);
          continue;
        }
        Range* stuck = new Range;
        stuck->addr = at;
        stuck->k = 1;
        stuck->chunks.assign(1, handles[i]);
        stuck->all_ready = true;
        // mapped, but maybe before (or by) the set_access that failed: reusable only with access
        // (on a GPU the first kernel touching it would fault); else only trim/close take it
        try {
          drv->set_access(at, chunk);
        } catch (...) {
          stuck->no_access = true;
        }
        cache_insert(stuck);
      }
      if (mapped) st.num_map += mapped;
      if (!dynamic_cast<const driver::DriverOutOfMemory*>(&e)) throw;
      missing = k * chunk;  // e.g. the host's vm.max_map_count: out of memory, not a crash
      failure = e.what();
      return nullptr;
    }
    st.num_map += k;
    ++st.num_remaps;
    Range* r = new Range;
    r->addr = addr;
    r->k = k;
    r->chunks = std::move(handles);
    return r;
  }

  // A range of k mapped chunks for `stream`, or nullptr (missing bytes set).
  Range* acquire(size_t k, uintptr_t stream, size_t& missing, bool& device_full) {
    // 1. exact chunk count, most recently freed first
    if (std::vector<Range*>* bucket = cache.find(k)) {
      for (size_t i = bucket->size(), scanned = 0; i-- > 0 && scanned < 16; ++scanned) {
        Range* r = (*bucket)[i];
        if (!r->no_access && events.ready_for(r, stream)) {
          cache_remove(r);
          events.drop_events(r);
          ++st.num_cache_hits;
          return r;
        }
      }
    }
    // 2. the tail of the smallest larger cached range
    if (cfg.split_cached) {
      size_t scanned = 0;
      for (size_t kk = cache.next_above(k); kk != 0 && scanned < 16; kk = cache.next_above(kk)) {
        std::vector<Range*>& bucket = *cache.find(kk);
        for (size_t i = bucket.size(); i-- > 0 && scanned < 16; ++scanned) {
          Range* r = bucket[i];
          if (r->no_access || !events.ready_for(r, stream)) continue;
          // The piece handed out is r's tail: r keeps its address, its events (they cover what
          // stays cached) and its chunk list, which only shrinks, so the piece, freed, joins r
          // again by appending k handles (merge_cached): a split and a join cost O(k), whatever
          // r's size. Made before r leaves the cache: a failed allocation changes nothing.
          std::unique_ptr<Range> piece(new Range);
          piece->chunks.assign(r->chunks.end() - static_cast<std::ptrdiff_t>(k), r->chunks.end());
          Range* out = piece.release();
          cache_remove(r);
          out->k = k;
          out->addr = r->addr + (r->k - k) * chunk;
          r->k -= k;
          r->chunks.resize(r->k);
          cache_insert(r);
          ++st.num_cache_hits;
          ++st.num_splits;
          return out;
        }
      }
    }
    // 3. fresh mapping
    return map_fresh(k, missing, device_full);
  }

  void on_alloc_stats(size_t requested, size_t mapped) {
    ++st.num_malloc;
    bytes.requested.add(requested);
    bytes.mapped.add(mapped);
  }
  void on_free_stats(size_t requested, size_t mapped) {
    ++st.num_free;
    bytes.requested.sub(requested);
    bytes.mapped.sub(mapped);
  }

  void poll_small_pending(bool wait) {
    std::vector<Range*> released;
    small.poll_pending([&](Block* b) { return events.prune(b->events, wait); }, released);
    for (Range* r : released) {
      slab_chunks -= r->k;
      retire_slab(r);
    }
  }

  void* malloc_small(size_t n, uintptr_t stream, size_t& missing, bool& device_full) {
    size_t rounded = (n + kSmallAlign - 1) / kSmallAlign * kSmallAlign;
    if (small.has_pending()) poll_small_pending(false);
    Block* b = small.take(rounded, stream);
    if (!b) {
      Range* slab = acquire(1, stream, missing, device_full);
      if (!slab) {
        if (!small.has_pending()) return nullptr;
        poll_small_pending(true);  // blocks held for other streams: wait for them, then retry
        b = small.take(rounded, stream);
        if (!b) return nullptr;
      } else {
        slab->stream = stream;
        slab->is_slab = true;
        slab_chunks += 1;
        note_in_use();
        small.add_slab(slab, chunk, stream);
        b = small.take(rounded, stream);
      }
    }
    b->requested = n;
    b->id = next_id++;
    live.insert(b->addr, tag_block(b));
    ++st.num_small_malloc;
    st.small_requested_current += n;
    on_alloc_stats(n, b->size);
    if (trace_on) record_trace(TraceEvent::kAlloc, b->id, n, stream, b->addr);
    return reinterpret_cast<void*>(b->addr);
  }

  // Why a request of `bytes` can never be served: more than the backend's memory, or (a backend
  // with no limit but the budget, host-lazy) more than any address space.
  std::string beyond_address_space(size_t bytes) const {
    return "cannot reserve " + format_bytes_exact(bytes) + " of virtual address space (larger than any address space, " +
           format_bytes_exact(kMaxChunk) + ")";
  }
  std::string never_fits_reason(size_t bytes) const {
    if (device_limit == 0) return beyond_address_space(bytes);
    return "larger than the " + std::string(drv->name()) + " backend's memory (" + format_bytes_exact(device_limit) +
           ")";
  }
  // True when no amount of freeing can serve `nbytes` (a large request: k chunks).
  bool never_fits(size_t nbytes) const {
    if (nbytes > kMaxRequest) return true;
    size_t bytes = (nbytes / chunk + (nbytes % chunk != 0)) * chunk;
    return bytes > kMaxChunk || (device_limit != 0 && bytes > device_limit);
  }

  void* malloc_large(size_t n, uintptr_t stream, size_t& missing, bool& device_full) {
    size_t k = n / chunk + (n % chunk != 0);
    if (cfg.budget != 0 && k * chunk > cfg.budget) {
      missing = k * chunk - cfg.budget;
      return nullptr;
    }
    if (device_limit != 0 && k * chunk > device_limit) {  // could never fit: fail now, commit nothing
      missing = k * chunk - device_limit;
      device_full = true;
      failure = "larger than the " + std::string(drv->name()) + " backend's memory (" +
                format_bytes_exact(device_limit) + ")";
      return nullptr;
    }
    if (k * chunk > kMaxChunk) {  // could never be mapped: fail before creating any chunk
      missing = k * chunk - kMaxChunk;
      device_full = true;
      failure = beyond_address_space(k * chunk);
      return nullptr;
    }
    Range* r = acquire(k, stream, missing, device_full);
    if (!r) return nullptr;
    note_in_use();
    r->stream = stream;
    r->requested = n;
    r->id = next_id++;
    live.insert(r->addr, reinterpret_cast<uintptr_t>(r));
    on_alloc_stats(n, k * chunk);
    if (trace_on) record_trace(TraceEvent::kAlloc, r->id, n, stream, r->addr);
    return reinterpret_cast<void*>(r->addr);
  }

  void check_open() const {
    if (closed) throw std::runtime_error("vmalloc: this allocator is closed");
  }
  // Before taking the lock: in a forked child the lock may be held forever by a parent's thread.
  void check_not_forked() const {
    if (forked())
      throw std::runtime_error(
          "vmalloc: this allocator belongs to the process that created it; a forked child cannot use "
          "it (its memory is not mapped in the child): create a new Allocator in the child");
  }

  // The prologue of the public calls that take the lock (close() and closed() have their own: they
  // also work in a forked child): refuse in a forked child, then hold the lock, then what `need`
  // adds.
  class Guard {
   public:
    explicit Guard(const Impl& m, Need need = Need::lock) : lock_(unforked_mutex(m)) {
      if (need != Need::lock) m.check_open();
      if (need == Need::driver) m.drv->check_not_shut_down();
    }

   private:
    static std::mutex& unforked_mutex(const Impl& m) {
      m.check_not_forked();
      return m.mu;
    }
    std::lock_guard<std::mutex> lock_;
  };

  // Release cached physical memory until physical <= target; returns bytes released. A driver
  // failure on one range or chunk does not stop the others: what is releasable is released, the
  // rest stays counted where it is (a cached range keeps its still-mapped chunks, a chunk whose
  // release failed stays in the free pool), then the first error is rethrown.
  size_t shrink_to(size_t target, bool wait) {
    size_t before = chunks_held * chunk;
    std::exception_ptr err;
    auto attempt = [&](auto&& f) {
      try {
        f();
        return true;
      } catch (...) {
        if (!err) err = std::current_exception();
        return false;
      }
    };
    if (wait && small.has_pending()) attempt([&] { poll_small_pending(true); });
    release_empty_slabs();
    // One pass over the pool; a chunk whose release fails stays in it.
    auto release_free = [&] {
      size_t keep = 0;
      for (size_t i = 0; i < free_chunks.size(); ++i) {
        ChunkHandle h = free_chunks[i];
        if (chunks_held * chunk > target && attempt([&] { release_chunk(h); })) continue;
        free_chunks[keep++] = h;
      }
      free_chunks.resize(keep);
    };
    release_free();
    // A range whose unmap failed goes back to the LRU tail: visit only the ranges cached now.
    size_t to_visit = 0;
    for (Range* r = lru_head; r; r = r->lru_next) ++to_visit;
    for (Range* r = lru_head; r && to_visit > 0 && chunks_held * chunk > target; --to_visit) {
      Range* next = r->lru_next;
      if (wait) attempt([&] { events.wait_ready(r); });
      bool ready = false;
      attempt([&] { ready = events.fully_ready(r); });
      if (ready) {
        // only what is over the target (a joined range may be far larger than that)
        size_t over = (chunks_held * chunk - target + chunk - 1) / chunk;
        std::vector<ChunkHandle> hs;
        attempt([&] { take_tail(r, std::min(r->k, over), hs); });  // on failure r stays cached with the rest
        free_chunks.reserve(free_chunks.size() + hs.size());
        for (auto h : hs) free_chunks.push_back(h);
        release_free();
      }
      r = next;
    }
    if (err) std::rethrow_exception(err);
    return before - chunks_held * chunk;
  }

  // Unmap a range chunk by chunk and release its chunks; every driver call on its own (close).
  void unmap_release(Range* r) noexcept {
    quiet([&] { events.drop_events(r); });
    for (size_t i = 0; i < r->k; ++i) {
      quiet([&] { drv->unmap(r->addr + i * chunk, chunk); });
      ++st.num_unmap;
      quiet([&] { drv->release(r->chunks[i]); });
      ++st.num_chunks_released;
    }
    delete r;
  }

  // Allocates nothing (a close under memory pressure or at vm.max_map_count must not abort) and
  // walks each block and range once.
  void close_locked() noexcept {
    if (closed) return;
    closed = true;
    // cuMemUnmap / cuMemRelease do not wait for device work still using the memory (PyTorch's
    // ExpandableSegment synchronizes before unmapping for the same reason): one device-wide
    // synchronize first, so that no kernel still queued on live, deferred or cached memory runs
    // on it unmapped (nor is a late event recorded on a user's stream, which may be destroyed by
    // now). Only if that fails (a broken context), the events of freed memory are waited for one
    // by one, as trim() does. No-ops on the host backend.
    // The synchronize covers this device's context only: events already recorded (another
    // device's stream, record_stream) are still waited for, which is free for this device's.
    bool synced = quiet([&] { drv->synchronize(); });
    auto wait = [&](Range* r) {
      if (!synced) return events.wait_ready(r);
      events.wait_recorded(r);
    };
    live.for_each([&](uintptr_t, uintptr_t v) {
      if (!is_block(v)) unmap_release(as_range(v));
    });
    live.clear();
    small.clear(
        [&](EventHandle e) {
          quiet([&] { drv->event_wait(e); });
          quiet([&] { drv->event_destroy(e); });
        },
        [&](Range* r) {
          quiet([&] { wait(r); });
          unmap_release(r);
        });
    for (Range* r = lru_head; r;) {
      Range* next = r->lru_next;
      quiet([&] { wait(r); });
      unmap_release(r);
      r = next;
    }
    cache.clear();
    cached_from.clear();
    cached_to.clear();
    lru_head = lru_tail = nullptr;
    for (auto h : free_chunks) {
      quiet([&] { drv->release(h); });
      ++st.num_chunks_released;
    }
    free_chunks.clear();
    chunks_held = 0;
    cached_range_chunks = slab_chunks = 0;
    va->release_all();
    drv->shutdown();
    // the peaks stay: they are history
    bytes.physical.current = bytes.mapped.current = bytes.requested.current = 0;
    st.small_requested_current = 0;
  }
};

// ------------------------------------------------------------------------------------------------

Allocator::Allocator(const Config& cfg) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.cfg = cfg;
  if (cfg.device < 0) throw std::invalid_argument("device: must be >= 0, got " + std::to_string(cfg.device));
  m.drv = driver::make_driver(cfg.backend, cfg.device);
  m.gran = m.drv->granularity();
  m.events = RangeEvents(*m.drv);
  if (cfg.chunk_size == 0 || cfg.chunk_size % m.gran != 0)
    throw std::invalid_argument("chunk_size: " + std::to_string(cfg.chunk_size) +
                                " bytes is not a positive multiple of the " + cfg.backend +
                                " backend's allocation granularity (" + std::to_string(m.gran) + " bytes)");
  if (cfg.chunk_size > kMaxChunk)
    throw std::invalid_argument("chunk_size: " + std::to_string(cfg.chunk_size) + " bytes is larger than any " +
                                "address space (" + format_bytes_exact(kMaxChunk) + ")");
  if (cfg.budget != 0 && cfg.budget < cfg.chunk_size)
    throw std::invalid_argument("budget: " + std::to_string(cfg.budget) + " bytes is smaller than one chunk (" +
                                std::to_string(cfg.chunk_size) + " bytes)");
  install_fork_handler();
  m.fork_generation = g_fork_generation.load(std::memory_order_relaxed);
  m.device_limit = m.drv->total_memory();
  m.trace.set_capacity(cfg.trace_capacity);
  m.chunk = cfg.chunk_size;
  m.small_limit = std::min(cfg.small_threshold, cfg.chunk_size);
  m.va = std::make_unique<VaSpace>(*m.drv, m.chunk, std::max(kDefaultSpanBytes, m.chunk));
  m.st.chunk_size = m.chunk;
  m.st.budget = cfg.budget;
  m.st.granularity = m.gran;
}

Allocator::~Allocator() {
  if (!impl_) return;
  if (impl_->forked()) {
    // A forked child: nothing here is ours (the lock may even be held by a parent's thread that
    // does not exist here). Leave it all to the child's exit.
    (void)impl_.release();
    return;
  }
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->close_locked();
}

// malloc and try_malloc: `use_pressure` = false never calls the pressure callback (try_malloc's
// callers hold a lock the callback may need).
static void* malloc_impl(Allocator::Impl& m, size_t nbytes, uintptr_t stream, bool use_pressure) {
  if (nbytes == 0) throw std::invalid_argument("nbytes: must be a positive byte count, got 0");
  for (int attempt = 0;; ++attempt) {
    size_t missing = 0;
    std::function<bool(size_t)> cb;
    std::string reason;  // why this attempt failed, kept past the lock for the callback's outcome
    {
      Allocator::Impl::Guard g(m, Need::driver);
      m.note_stream(stream);
      m.failure.clear();
      bool device_full = false;
      void* p = nullptr;
      if (nbytes > kMaxRequest) {
        missing = nbytes;
        device_full = true;
        m.failure = m.never_fits_reason(nbytes);
      }
      else if (nbytes < m.small_limit)
        p = m.malloc_small(nbytes, stream, missing, device_full);
      else
        p = m.malloc_large(nbytes, stream, missing, device_full);
      if (p) return p;
      // A request no amount of freeing can serve does not ask the pressure callback.
      bool never_fits = device_full && m.never_fits(nbytes);
      if (attempt == 0 && use_pressure && m.pressure && !never_fits) {
        cb = m.pressure;
        reason = m.failure;  // for the message if the callback frees nothing (it names the budget)
        ++m.st.num_pressure_calls;
      } else {
        ++m.st.num_oom;
        size_t k = nbytes / m.chunk + (nbytes % m.chunk != 0);
        std::string why = !m.failure.empty() ? m.failure
                          : m.cfg.budget != 0 && !device_full
                              ? "budget " + format_bytes_exact(m.cfg.budget)
                              : "the device is full (" + std::string(m.drv->name()) + " backend)";
        throw OutOfMemory("vmalloc: out of memory: requested " + format_bytes_exact(nbytes) + " (" +
                              std::to_string(k) + " chunk(s) of " + format_bytes_exact(m.chunk) + "), in use " +
                              format_bytes_exact(m.bytes.physical.current) + " physical (" +
                              format_bytes_exact(m.bytes.requested.current) + " requested by live allocations), " +
                              why + "; " + format_bytes_exact(missing) + " missing",
                          nbytes, m.bytes.physical.current, m.cfg.budget);
      }
    }
    // Outside the lock: the callback may free memory through this allocator.
    if (!cb(missing)) {
      std::lock_guard<std::mutex> g(m.mu);
      ++m.st.num_oom;
      throw OutOfMemory("vmalloc: out of memory: requested " + format_bytes_exact(nbytes) + ", in use " +
                            format_bytes_exact(m.bytes.physical.current) + " physical, budget " +
                            (m.cfg.budget ? format_bytes_exact(m.cfg.budget) : std::string("none")) + "; " +
                            (reason.empty() ? "" : reason + "; ") + format_bytes_exact(missing) +
                            " missing and the pressure callback freed nothing",
                        nbytes, m.bytes.physical.current, m.cfg.budget);
    }
  }
}

void* Allocator::malloc(size_t nbytes, uintptr_t stream) { return malloc_impl(*impl_, nbytes, stream, true); }

void* Allocator::try_malloc(size_t nbytes, uintptr_t stream) {
  try {
    return malloc_impl(*impl_, nbytes, stream, false);
  } catch (const OutOfMemory&) {
    return nullptr;  // counted in num_oom by malloc_impl
  }
}

void Allocator::free(void* p) {
  Impl& m = *impl_;
  Impl::Guard g(m, Need::open);
  auto addr = reinterpret_cast<uintptr_t>(p);
  uintptr_t v = 0;
  if (m.merging()) {  // a range cached below adds one key to each: room first (nothing changed yet)
    m.cached_from.reserve_for(1);
    m.cached_to.reserve_for(1);
  }
  if (!m.live.take(addr, v))
    throw std::invalid_argument("ptr: " + hex(addr) +
                                " is not a live allocation of this allocator (unknown or already freed)");
  // Record the events reuse must wait for before anything changes: if that fails the pointer goes
  // back into the live map (no rehash: it was just there) and the stats are untouched, so the
  // caller may retry; nothing below fails on the driver. When the driver is shutting down (process
  // exit) the pointer stays live the same way, but free returns: nothing can reuse the memory
  // any more, the driver takes it with it, and a deleter at exit has nobody to tell.
  try {
    if (is_block(v)) {
      Block* b = as_block(v);
      if (!b->extra_streams.empty()) {
        m.events.record_on(b->extra_streams, b->events);
        m.small.reserve_pending();
      }
    } else {
      Range* r = as_range(v);
      if (!r->extra_streams.empty() || m.events.owner_event_now(r->stream)) m.events.record_free_events(r);
    }
  } catch (const driver::DriverShutDown&) {
    m.live.insert(addr, v);
    return;
  } catch (...) {
    m.live.insert(addr, v);
    throw;
  }
  if (is_block(v)) {
    Block* b = as_block(v);
    uintptr_t stream = b->slab->stream;
    if (m.trace_on) m.record_trace(TraceEvent::kFree, b->id, b->requested, stream, b->addr);
    ++m.st.num_small_free;
    m.st.small_requested_current -= b->requested;
    m.on_free_stats(b->requested, b->size);
    if (!b->extra_streams.empty()) {
      b->extra_streams.clear();
      m.small.defer(b);
      return;
    }
    if (Range* r = m.small.give(b)) {
      m.slab_chunks -= r->k;
      m.retire_slab(r);
    }
    return;
  }
  Range* r = as_range(v);
  if (m.trace_on) m.record_trace(TraceEvent::kFree, r->id, r->requested, r->stream, r->addr);
  m.on_free_stats(r->requested, r->k * m.chunk);
  m.cache_retired(r);
}

void Allocator::record_stream(void* p, uintptr_t stream) {
  Impl& m = *impl_;
  Impl::Guard g(m, Need::driver);
  auto addr = reinterpret_cast<uintptr_t>(p);
  const uintptr_t* found = m.live.find(addr);
  if (!found) throw std::invalid_argument("ptr: " + hex(addr) + " is not a live allocation of this allocator");
  m.note_stream(stream);
  uintptr_t v = *found;
  uintptr_t owner = is_block(v) ? as_block(v)->slab->stream : as_range(v)->stream;
  if (stream == owner) return;
  auto& extra = is_block(v) ? as_block(v)->extra_streams : as_range(v)->extra_streams;
  if (std::find(extra.begin(), extra.end(), stream) == extra.end()) extra.push_back(stream);
}

Stats Allocator::stats() const {
  const Impl& m = *impl_;
  Impl::Guard g(m);
  Stats s = m.st;
  s.requested_current = m.bytes.requested.current;
  s.requested_peak = m.bytes.requested.peak;
  s.mapped_current = m.bytes.mapped.current;
  s.mapped_peak = m.bytes.mapped.peak;
  s.physical_current = m.bytes.physical.current;
  s.physical_peak = m.bytes.physical.peak;
  s.internal_fragmentation = s.mapped_current - s.requested_current;
  s.cached_bytes = (m.free_chunks.size() + m.cached_range_chunks) * m.chunk;
  s.num_live = m.live.size();
  s.small_pool_bytes = m.slab_chunks * m.chunk;
  s.va_reserved = m.va->reserved_bytes();
  s.num_va_reserve = m.va->num_reserves();
  s.budget = m.cfg.budget;
  s.num_trace_dropped = m.trace.dropped();
  s.num_stream_waits = m.events.num_waits();
  return s;
}

void Allocator::reset_peak() {
  Impl& m = *impl_;
  Impl::Guard g(m, Need::open);
  // Only the reported peaks: the growth policy's own peak (peak_in_use_chunks) is history it needs.
  m.bytes.requested.reset_peak();
  m.bytes.mapped.reset_peak();
  m.bytes.physical.reset_peak();
}

size_t Allocator::trim() {
  Impl& m = *impl_;
  Impl::Guard g(m, Need::driver);
  size_t released = m.shrink_to(0, /*wait=*/true);
  try {
    m.va->release_unused();
  } catch (const driver::DriverShutDown&) {
    throw;
  } catch (...) {  // an unreserve failure keeps that span (still counted in va_reserved)
  }
  return released;
}

void Allocator::set_budget(size_t bytes) {
  Impl& m = *impl_;
  Impl::Guard g(m, Need::open);
  if (bytes != 0 && bytes < m.chunk)
    throw std::invalid_argument("budget: " + std::to_string(bytes) + " bytes is smaller than one chunk (" +
                                std::to_string(m.chunk) + " bytes)");
  m.cfg.budget = bytes;
  m.st.budget = bytes;
  // Waits for pending stream work on cached memory (as trim() does): on a GPU an event recorded at
  // or just before this call is rarely complete yet, and a cap must release what it can.
  if (bytes != 0 && m.chunks_held * m.chunk > bytes) m.shrink_to(bytes, /*wait=*/true);
}

void Allocator::set_pressure_callback(std::function<bool(size_t)> cb) {
  // The old callback is destroyed after the lock is released: destroying it may take other locks
  // (the Python binding's holder takes the GIL). After close() a callback is refused (close broke
  // the callback -> allocator cycle; attaching one would make it again); none is still accepted:
  // there is nothing to drop, and code that detaches on its way out need not know.
  {
    Impl::Guard g(*impl_, cb ? Need::open : Need::lock);
    impl_->pressure.swap(cb);
  }
}

void Allocator::set_trace(bool on) {
  Impl::Guard g(*impl_, Need::open);
  impl_->trace_on = on;
}

std::vector<TraceEvent> Allocator::take_trace() {
  Impl::Guard g(*impl_, Need::open);
  return impl_->trace.take();
}

void Allocator::set_trace_capacity(size_t events) {
  Impl::Guard g(*impl_, Need::open);
  impl_->trace.set_capacity(events);
  impl_->cfg.trace_capacity = events;
}

void Allocator::close() {
  // In a forked child: release nothing (all of it is the parent's) and touch no lock.
  if (impl_->forked()) {
    impl_->closed = true;
    return;
  }
  std::function<bool(size_t)> cb;  // dropped at close (breaks callback -> allocator cycles), unlocked
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->pressure.swap(cb);
  impl_->close_locked();
}

bool Allocator::forked() const { return impl_->forked(); }

bool Allocator::add_peer(int device) {
  Impl& m = *impl_;
  Impl::Guard g(m, Need::open);
  if (device == m.cfg.device) return m.drv->add_peer(device);  // nothing to re-grant
  bool known = m.drv->has_peer(device);
  if (!m.drv->add_peer(device)) return false;
  // What is mapped already gets it too: live ranges, slabs, cached ranges (each is k chunks
  // mapped back to back, so one call covers it).
  auto grant = [&](Range* r) {
    if (r->k && !r->no_access) m.timed([&] { m.drv->set_access(r->addr, r->k * m.chunk); });
  };
  try {
    m.live.for_each([&](uintptr_t, uintptr_t v) {
      if (!is_block(v)) grant(as_range(v));
    });
    m.small.for_each_slab_range(grant);
    for (Range* r = m.lru_head; r; r = r->lru_next) grant(r);
  } catch (...) {
    // not a peer then (unless it was one before): later mappings must not carry a grant that
    // fails (ranges granted before the failure keep it, which only allows more)
    if (!known) m.drv->remove_peer(device);
    throw;
  }
  return true;
}

void Allocator::inject_fault(const std::string& call, uint64_t nth, int err, uint64_t count) {
  Impl::Guard g(*impl_, Need::open);
  impl_->drv->inject_fault(call, nth, err, count);
}

Allocator::DebugState Allocator::debug_state() const {
  const Impl& m = *impl_;
  Impl::Guard g(m);
  DebugState d;
  auto u = m.drv->usage();
  d.committed_bytes = u.committed_bytes;
  d.mapped_bytes = u.mapped_bytes;
  d.faults_fired = u.faults_fired;
  d.free_chunks = m.free_chunks.size();
  d.cached_range_chunks = m.cached_range_chunks;
  d.slab_chunks = m.slab_chunks;
  d.chunks_held = m.chunks_held;
  d.close_block_visits = m.small.clear_visits();
  d.trace_events = m.trace.size();
  return d;
}

const Config& Allocator::config() const { return impl_->cfg; }
size_t Allocator::granularity() const { return impl_->gran; }

bool Allocator::closed() const {
  if (impl_->forked()) return true;  // dead in a forked child
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->closed;
}

size_t Allocator::allocation_size(const void* p) const {
  const Impl& m = *impl_;
  Impl::Guard g(m, Need::open);
  const uintptr_t* v = m.live.find(reinterpret_cast<uintptr_t>(p));
  if (!v) return 0;
  return is_block(*v) ? as_block(*v)->requested : as_range(*v)->requested;
}

std::vector<std::pair<uintptr_t, size_t>> Allocator::live_allocations() const {
  const Impl& m = *impl_;
  std::vector<std::pair<uintptr_t, size_t>> out;
  {
    Impl::Guard g(m, Need::open);
    out.reserve(m.live.size());
    m.live.for_each([&](uintptr_t addr, uintptr_t v) {
      out.emplace_back(addr, is_block(v) ? as_block(v)->requested : as_range(v)->requested);
    });
  }
  std::sort(out.begin(), out.end());
  return out;
}

size_t Allocator::total_memory() const { return impl_->drv->total_memory(); }

size_t Allocator::largest_available() {
  Impl& m = *impl_;
  Impl::Guard g(m, Need::open);  // the lock also against close() dropping the driver's context
  // a snapshot (microseconds), less 1/64 for what others (NCCL, other processes) may take
  // before the caller allocates
  size_t room = m.timed([&] { return m.drv->free_memory(); });
  room -= room / 64;
  size_t cached = (m.free_chunks.size() + m.cached_range_chunks) * m.chunk;
  if (m.cfg.budget != 0) {
    size_t held = m.chunks_held * m.chunk;
    room = std::min(room, m.cfg.budget > held ? m.cfg.budget - held : 0);
  }
  return cached + room / m.chunk * m.chunk;
}

size_t backend_granularity(const std::string& backend, int device) {
  if (backend == "host" || backend == "host-lazy") return driver::host_granularity();
  if (backend == "cuda") return driver::cuda_granularity(device);
  throw std::invalid_argument("backend: unknown backend '" + backend +
                              "' (expected 'host', 'host-lazy' or 'cuda')");
}

}  // namespace vmalloc
