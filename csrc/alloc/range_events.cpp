// The stream events of ranges: the parts off the fast path (see range_events.hpp).
#include "alloc/range_events.hpp"

#include "alloc/quiet.hpp"

namespace vmalloc {

bool RangeEvents::fully_ready(Range* r) {
  if (r->all_ready) return true;
  bool extras_done = prune(r->extra_events);
  if (!r->has_owner_event) record_owner_event(r);
  if (!extras_done || !drv_->event_done(r->owner_event)) {
    ++num_waits_;
    return false;
  }
  drv_->event_destroy(r->owner_event);
  r->has_owner_event = false;
  r->all_ready = true;
  return true;
}

void RangeEvents::wait_ready(Range* r) {
  if (r->all_ready) return;
  if (!r->has_owner_event) record_owner_event(r);
  wait_recorded(r);
  fully_ready(r);
}

void RangeEvents::wait_recorded(const Range* r) {
  if (r->has_owner_event) drv_->event_wait(r->owner_event);
  for (auto e : r->extra_events) drv_->event_wait(e);
}

void RangeEvents::record_on(const std::vector<uintptr_t>& streams, std::vector<driver::EventHandle>& into) {
  size_t before = into.size();
  into.reserve(before + streams.size());
  try {
    for (uintptr_t s : streams) into.push_back(drv_->record_event(s));
  } catch (...) {
    for (size_t i = before; i < into.size(); ++i) quiet([&] { drv_->event_destroy(into[i]); });
    into.resize(before);
    throw;
  }
}

void RangeEvents::record_free_events(Range* r) {
  record_on(r->extra_streams, r->extra_events);
  if (owner_event_now(r->stream)) {
    try {
      record_owner_event(r);
    } catch (...) {
      for (size_t i = r->extra_events.size() - r->extra_streams.size(); i < r->extra_events.size(); ++i)
        quiet([&] { drv_->event_destroy(r->extra_events[i]); });
      r->extra_events.resize(r->extra_events.size() - r->extra_streams.size());
      throw;
    }
  }
  r->extra_streams.clear();
}

void RangeEvents::record_slab_owner_event(Range* r) noexcept {
  if (!r->has_owner_event && owner_event_now(r->stream)) quiet([&] { record_owner_event(r); });
}

}  // namespace vmalloc
