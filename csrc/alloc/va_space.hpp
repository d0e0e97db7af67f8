// Virtual address space for the allocator: reserved from the driver in large spans and handed out
// in whole chunks by a best-fit range allocator that coalesces neighbours. VA is cheap (nothing is
// committed until a chunk is mapped), so spans are big and rarely reserved.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "driver/driver.hpp"

namespace vmalloc {

class VaSpace {
 public:
  // `span_bytes`: default size of one reservation (rounded down to whole chunks, at least one).
  VaSpace(driver::Driver& drv, size_t chunk_size, size_t span_bytes);
  VaSpace(const VaSpace&) = delete;
  VaSpace& operator=(const VaSpace&) = delete;

  // Address of `k` contiguous chunks (reserves a new span when no free run is long enough).
  uintptr_t take(size_t k);
  // Return `k` chunks starting at `addr` (taken earlier, nothing mapped there any more).
  void give(uintptr_t addr, size_t k);
  // Whether the `k` chunks at `addr` and those at `addr` + `k` chunks lie in one span (one driver
  // reservation: a range crossing two could not be given back, nor mapped as one on a GPU).
  bool same_span(uintptr_t addr, size_t k, size_t k_next) const;
  // Unreserve spans of which nothing is handed out; returns the bytes unreserved.
  size_t release_unused();
  // Unreserve everything (close()): callers guarantee nothing is mapped.
  void release_all() noexcept;

  size_t reserved_bytes() const { return reserved_; }
  uint64_t num_reserves() const { return num_reserves_; }

 private:
  struct Span {
    uintptr_t base;
    size_t chunks;
    size_t handed_out = 0;
  };
  struct Run {  // a free run of chunks inside one span
    size_t chunks;
    Span* span;
  };
  void insert_run(uintptr_t addr, size_t k, Span* span);
  void erase_run(std::map<uintptr_t, Run>::iterator it);

  driver::Driver& drv_;
  size_t chunk_;
  size_t span_chunks_;
  std::vector<std::unique_ptr<Span>> spans_;
  std::map<uintptr_t, Run> runs_;                       // by address: coalescing
  std::set<std::pair<size_t, uintptr_t>> by_size_;     // (chunks, address): best fit
  size_t reserved_ = 0;
  uint64_t num_reserves_ = 0;
};

}  // namespace vmalloc
