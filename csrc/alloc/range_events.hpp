// The stream events that hold freed memory back from reuse until the device work that used it is
// complete (the "Streams" rules at the top of allocator.cpp): which events a free records at once
// and which are recorded lazily, whether a cached range is ready for a stream, and waiting for it.
// It uses only the driver's event calls and the streams seen so far; the allocator owns the ranges
// and decides what to do with a ready one. The checks on the fast path (same-stream reuse, no
// event) are inline here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "alloc/range.hpp"
#include "driver/driver.hpp"

namespace vmalloc {

// Streams whose handle names "the default stream of the current context" (CUDA's 0 and legacy
// handles): they never die, so events on them may be recorded late. Not the per-thread handle
// (2): it names the calling thread's stream, so an event recorded late from another thread would
// land on another stream; its events are recorded at free, from the freeing thread.
inline bool is_default_stream(uintptr_t s) { return s == 0 || s == 1; }
constexpr uintptr_t kPerThreadStream = 2;

class RangeEvents {
 public:
  RangeEvents() = default;
  explicit RangeEvents(driver::Driver& drv) : drv_(&drv) {}

  // Every stream memory is allocated on or recorded to: more than one stream seen makes frees
  // record the owner's event eagerly.
  void note_stream(uintptr_t s) {
    if (!seen_stream_) {
      seen_stream_ = true;
      first_stream_ = s;
    } else if (s != first_stream_) {
      multistream_ = true;
    }
  }
  // The owner's event is recorded at free when another stream may take the memory (several
  // streams seen) or when the owner is a stream that may be destroyed later (any handle but the
  // default ones): recording later on a dead stream is an error, or worse, another stream.
  bool owner_event_now(uintptr_t stream) const { return multistream_ || !is_default_stream(stream); }
  // More than one stream seen: memory one stream freed may go to another once its events complete.
  bool multistream() const { return multistream_; }

  // May cached range `r` be reused on `stream` now? On its owner stream only the record_stream
  // events matter (stream order covers the owner's own work); elsewhere every event does.
  bool ready_for(Range* r, uintptr_t stream) {
    if (r->all_ready) return true;
    if (r->stream == stream && stream != kPerThreadStream) {  // 2: maybe another thread's stream
      if (prune(r->extra_events)) return true;
      ++num_waits_;
      return false;
    }
    return fully_ready(r);
  }
  // Every use on every stream complete? Records the owner's event lazily when it was not recorded
  // at free (single-stream phase): an event recorded later covers the earlier work too.
  bool fully_ready(Range* r);
  // Blocks until every use of `r` on every stream is complete (then it is fully ready).
  void wait_ready(Range* r);
  // Blocks on the events `r` has recorded, recording none (close(), after a device synchronize).
  void wait_recorded(const Range* r);
  // Forget `r`'s events (it is being reused, or released).
  void drop_events(Range* r) {
    if (r->has_owner_event) drv_->event_destroy(r->owner_event);
    r->has_owner_event = false;
    for (auto e : r->extra_events) drv_->event_destroy(e);
    r->extra_events.clear();
    r->all_ready = false;
  }
  // Drop the completed events of `ev` (with `wait`, waiting for each first); true when none is left.
  bool prune(std::vector<driver::EventHandle>& ev, bool wait = false) {
    for (size_t i = 0; i < ev.size();) {
      if (wait) drv_->event_wait(ev[i]);
      if (drv_->event_done(ev[i])) {
        drv_->event_destroy(ev[i]);
        ev[i] = ev.back();
        ev.pop_back();
      } else {
        ++i;
      }
    }
    return ev.empty();
  }

  // Record one event per stream of `streams` into `into`; all or nothing (a failure destroys the
  // events it recorded and leaves `into` as it was).
  void record_on(const std::vector<uintptr_t>& streams, std::vector<driver::EventHandle>& into);
  // free() of a large range, first half: record the events its reuse must wait for. Throws with
  // nothing changed (the range stays live).
  void record_free_events(Range* r);
  // An emptied slab leaves use: its owner's event, where owner_event_now wants it. If that cannot
  // be recorded now it is recorded lazily (fully_ready), as on a default stream: never throws.
  void record_slab_owner_event(Range* r) noexcept;

  uint64_t num_waits() const { return num_waits_; }  // times memory was held back (Stats)

 private:
  void record_owner_event(Range* r) {
    r->owner_event = drv_->record_event(r->stream);
    r->has_owner_event = true;
  }

  driver::Driver* drv_ = nullptr;
  bool seen_stream_ = false;
  uintptr_t first_stream_ = 0;
  bool multistream_ = false;  // more than one stream seen: record owner events eagerly at free
  uint64_t num_waits_ = 0;
};

}  // namespace vmalloc
