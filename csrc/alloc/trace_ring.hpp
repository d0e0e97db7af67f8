// The allocation trace: a ring of the most recent events, so a long run with the history on
// (VMALLOC_REPORT) holds a bounded amount of memory; what falls out is counted.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "alloc/allocator.hpp"

namespace vmalloc {

class TraceRing {
 public:
  explicit TraceRing(size_t capacity) : capacity_(capacity) {}

  void push(const TraceEvent& e) {
    if (capacity_ == 0) {
      ++dropped_;
      return;
    }
    if (events_.size() < capacity_) {
      events_.push_back(e);
      return;
    }
    events_[head_] = e;  // full: overwrite the oldest
    head_ = (head_ + 1) % capacity_;
    ++dropped_;
  }
  // The events, oldest first; the ring is empty after.
  std::vector<TraceEvent> take() {
    std::rotate(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(head_), events_.end());
    head_ = 0;
    std::vector<TraceEvent> out;
    out.swap(events_);
    return out;
  }
  // Keeps the newest `capacity` events held now.
  void set_capacity(size_t capacity) {
    std::vector<TraceEvent> kept = take();
    if (kept.size() > capacity) {
      dropped_ += kept.size() - capacity;
      kept.erase(kept.begin(), kept.end() - static_cast<std::ptrdiff_t>(capacity));
    }
    events_.swap(kept);
    capacity_ = capacity;
  }
  size_t size() const { return events_.size(); }
  uint64_t dropped() const { return dropped_; }  // events dropped since construction

 private:
  std::vector<TraceEvent> events_;
  size_t capacity_;
  size_t head_ = 0;  // index of the oldest event once full
  uint64_t dropped_ = 0;
};

}  // namespace vmalloc
