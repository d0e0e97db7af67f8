// Loops that exercise an Allocator from C++ with no Python in the loop: the throughput benchmark
// (bench/alloc_micro.py) and a multi-threaded stress test with content checks (tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "alloc/allocator.hpp"

namespace vmalloc {
namespace bench {

// `repeats` times: for each size, malloc then free. Returns elapsed seconds.
double malloc_free_cycle(Allocator& a, const std::vector<size_t>& sizes, size_t repeats);

struct StressResult {
  uint64_t operations = 0;    // mallocs + frees
  uint64_t corruptions = 0;   // pattern mismatches found (must be 0)
  uint64_t overlaps = 0;      // a new block overlapping one this thread holds (must be 0)
  uint64_t oom = 0;           // OutOfMemory caught (allowed under a budget)
};

// `threads` threads, each `iters` random steps (malloc of a size in [1, max_bytes] skewed to
// small, or free of one of its live blocks), each block filled with a per-block byte at its
// first, last and every 4096th byte and checked before it is freed. Host backend only (the
// memory must be CPU-addressable).
StressResult stress_threads(Allocator& a, int threads, size_t iters, size_t max_bytes, uint64_t seed);

}  // namespace bench
}  // namespace vmalloc
