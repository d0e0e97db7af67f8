#include "alloc/va_space.hpp"

#include <algorithm>
#include <stdexcept>

namespace vmalloc {

VaSpace::VaSpace(driver::Driver& drv, size_t chunk_size, size_t span_bytes)
    : drv_(drv), chunk_(chunk_size), span_chunks_(std::max<size_t>(1, span_bytes / chunk_size)) {}

void VaSpace::insert_run(uintptr_t addr, size_t k, Span* span) {
  runs_.emplace(addr, Run{k, span});
  by_size_.emplace(k, addr);
}

void VaSpace::erase_run(std::map<uintptr_t, Run>::iterator it) {
  by_size_.erase({it->second.chunks, it->first});
  runs_.erase(it);
}

uintptr_t VaSpace::take(size_t k) {
  auto fit = by_size_.lower_bound({k, 0});
  if (fit == by_size_.end()) {
    size_t n = std::max(k, span_chunks_);
    auto span = std::make_unique<Span>(Span{drv_.reserve(n * chunk_), n});
    reserved_ += n * chunk_;
    ++num_reserves_;
    insert_run(span->base, n, span.get());
    spans_.push_back(std::move(span));
    fit = by_size_.lower_bound({k, 0});
  }
  uintptr_t addr = fit->second;
  auto it = runs_.find(addr);
  Run run = it->second;
  erase_run(it);
  if (run.chunks > k) insert_run(addr + k * chunk_, run.chunks - k, run.span);
  run.span->handed_out += k;
  return addr;
}

void VaSpace::give(uintptr_t addr, size_t k) {
  // Find the span (spans are few) and coalesce with free neighbours of the same span.
  Span* span = nullptr;
  for (auto& s : spans_)
    if (addr >= s->base && addr + k * chunk_ <= s->base + s->chunks * chunk_) span = s.get();
  if (!span) throw std::logic_error("vmalloc: VA range returned to no span");
  span->handed_out -= k;
  auto next = runs_.lower_bound(addr);
  if (next != runs_.end() && next->second.span == span && next->first == addr + k * chunk_) {
    k += next->second.chunks;
    erase_run(next);
  }
  auto prev = runs_.lower_bound(addr);
  if (prev != runs_.begin()) {
    --prev;
    if (prev->second.span == span && prev->first + prev->second.chunks * chunk_ == addr) {
      addr = prev->first;
      k += prev->second.chunks;
      erase_run(prev);
    }
  }
  insert_run(addr, k, span);
}

bool VaSpace::same_span(uintptr_t addr, size_t k, size_t k_next) const {
  uintptr_t end = addr + (k + k_next) * chunk_;
  for (auto& s : spans_)
    if (addr >= s->base && addr < s->base + s->chunks * chunk_) return end <= s->base + s->chunks * chunk_;
  return false;
}

size_t VaSpace::release_unused() {
  size_t released = 0;
  for (size_t i = 0; i < spans_.size();) {
    Span* s = spans_[i].get();
    if (s->handed_out != 0) {
      ++i;
      continue;
    }
    // unreserve first: if it throws, the span stays whole (one free run), as before the call
    drv_.unreserve(s->base, s->chunks * chunk_);
    erase_run(runs_.find(s->base));  // an unused span is one free run
    released += s->chunks * chunk_;
    reserved_ -= s->chunks * chunk_;
    spans_.erase(spans_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  return released;
}

void VaSpace::release_all() noexcept {
  for (auto& s : spans_) {
    try {
      drv_.unreserve(s->base, s->chunks * chunk_);
    } catch (...) {  // best effort at close (the driver may be shutting down)
    }
  }
  spans_.clear();
  runs_.clear();
  by_size_.clear();
  reserved_ = 0;
}

}  // namespace vmalloc
