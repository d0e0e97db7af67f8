// Small-block sub-allocator: requests below the small threshold are carved from one-chunk slabs so
// a 4 KiB tensor does not pin a whole chunk. Within a slab: 512-byte rounding, best fit, splitting,
// and immediate coalescing with free neighbours, as in PyTorch's small pool. The free index is one
// intrusive list per 512-byte size class (a class holds blocks of exactly that size; one top class
// holds every block of 1 MiB and more) with a bitmap of non-empty classes, and Block objects are
// recycled: malloc/free of a small block allocates nothing and finds the best fit in a few word
// scans.
//
// Slabs belong to one stream (blocks are reused only on the stream they were freed on, so reuse
// never races device work); an empty slab goes back to the allocator as a cached one-chunk range,
// except one kept per stream so a malloc/free loop does not churn slabs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "alloc/range.hpp"

namespace vmalloc {

struct Slab;
struct Pool;

struct Block {
  Slab* slab = nullptr;
  uintptr_t addr = 0;
  size_t size = 0;          // multiple of kSmallAlign
  Block* prev = nullptr;    // neighbours in address order inside the slab
  Block* next = nullptr;
  Block* fprev = nullptr;   // free-list links (free blocks only)
  Block* fnext = nullptr;
  bool free = true;
  // Live state.
  size_t requested = 0;
  uint64_t id = 0;
  std::vector<uintptr_t> extra_streams;
  // Freed but possibly still read by other streams: held until these events complete.
  std::vector<driver::EventHandle> events;
};

struct Slab {
  Range* range = nullptr;
  Block* first = nullptr;   // the block at range->addr: never merged away while the slab lives
  size_t index = 0;         // position in SmallBins::slabs_
  Pool* pool = nullptr;
  uintptr_t stream = 0;
  size_t used = 0;          // bytes in blocks that are not free (live or deferred)
};

constexpr size_t kSmallAlign = 512;

// The free blocks of one stream.
struct Pool {
  static constexpr size_t kTopClass = (size_t(1) << 20) / kSmallAlign;  // blocks >= 1 MiB
  uintptr_t stream = 0;
  std::vector<Block*> heads = std::vector<Block*>(kTopClass + 1, nullptr);
  std::vector<uint64_t> bits = std::vector<uint64_t>(kTopClass / 64 + 1, 0);
  size_t empty_slabs = 0;

  static size_t class_of(size_t size) { return std::min(size / kSmallAlign, kTopClass); }
  void push(Block* b);
  void remove(Block* b);
  Block* best_fit(size_t rounded);
};

class SmallBins {
 public:
  SmallBins() = default;
  SmallBins(const SmallBins&) = delete;
  SmallBins& operator=(const SmallBins&) = delete;
  ~SmallBins();

  // A block of at least `rounded` bytes on `stream`, or nullptr when no slab of it has room.
  Block* take(size_t rounded, uintptr_t stream);
  // Carve a new slab out of `r` (one mapped chunk of `bytes`).
  void add_slab(Range* r, size_t bytes, uintptr_t stream);
  // Back to its slab. Returns the slab's range when the slab became empty and should be released.
  Range* give(Block* b);
  // Freed while other streams may still use it: held back (events in b->events) until polled.
  void defer(Block* b) { pending_.push_back(b); }
  bool has_pending() const { return !pending_.empty(); }
  // Give back every deferred block for which `ready(block)` says its events are complete (ready may
  // also wait). Slab ranges to release are appended to `out`.
  template <class Ready>
  void poll_pending(Ready&& ready, std::vector<Range*>& out) {
    for (size_t i = 0; i < pending_.size();) {
      Block* b = pending_[i];
      if (!ready(b)) {
        ++i;
        continue;
      }
      pending_[i] = pending_.back();
      pending_.pop_back();
      if (Range* r = give(b)) out.push_back(r);
    }
  }
  // Every empty slab's range (trim, memory pressure).
  std::vector<Range*> take_empty_slabs();
  // close(): forget every block and slab, walking each slab's blocks once in address order (linear
  // in blocks, allocates nothing). `on_event(e)` gets each event of a deferred block, then
  // `on_range(r)` the slab's range (the caller owns ranges).
  template <class OnEvent, class OnRange>
  void clear(OnEvent&& on_event, OnRange&& on_range) {
    for (Slab* s : slabs_) {
      for (Block* b = s->first; b;) {
        Block* next = b->next;
        for (auto e : b->events) on_event(e);
        delete b;
        ++clear_visits_;
        b = next;
      }
      on_range(s->range);
      delete s;
    }
    slabs_.clear();
    pools_.clear();
    last_pool_ = nullptr;
    pending_.clear();
    for (Block* b : spare_) delete b;
    spare_.clear();
  }
  // Room for one more deferred block, so defer() cannot fail after a free committed.
  void reserve_pending() { pending_.reserve(pending_.size() + 1); }

  size_t slab_count() const { return slabs_.size(); }
  template <class F>
  void for_each_slab_range(F&& f) const {
    for (Slab* s : slabs_) f(s->range);
  }
  uint64_t clear_visits() const { return clear_visits_; }  // blocks walked by clear() (tests: linear)

 private:
  Pool* pool_for(uintptr_t stream);
  Block* new_block();
  void recycle(Block* b);
  void drop_slab(Slab* s, Block* only);

  std::unordered_map<uintptr_t, std::unique_ptr<Pool>> pools_;  // by stream
  Pool* last_pool_ = nullptr;                                   // the most recent stream's pool
  std::vector<Slab*> slabs_;
  std::vector<Block*> pending_;
  std::vector<Block*> spare_;  // recycled Block objects
  uint64_t clear_visits_ = 0;
};

}  // namespace vmalloc
