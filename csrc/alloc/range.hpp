// A contiguous virtual range with `k` physical chunks mapped back to back: either live (a large
// allocation or a small-block slab) or cached (mapped, waiting for reuse).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "driver/driver.hpp"

namespace vmalloc {

struct Range {
  uintptr_t addr = 0;
  size_t k = 0;                              // chunks
  std::vector<driver::ChunkHandle> chunks;   // chunks[i] is mapped at addr + i * chunk_size

  // The stream the memory was last allocated on (the "owner"): work on it is ordered with any
  // reuse on the same stream, so same-stream reuse never waits.
  uintptr_t stream = 0;

  // Live state.
  size_t requested = 0;
  uint64_t id = 0;
  bool is_slab = false;
  std::vector<uintptr_t> extra_streams;  // record_stream() streams other than the owner

  // Cached state: events that must complete before another stream (or the chunk pool) may have it.
  bool all_ready = false;                // every use on every stream is known complete
  bool no_access = false;                // mapped without access rights (a failed rollback): never reused
  bool has_owner_event = false;          // recorded on `stream` at free (several streams seen) or lazily
  driver::EventHandle owner_event = 0;
  std::vector<driver::EventHandle> extra_events;  // one per extra stream, recorded at free
  Range* lru_prev = nullptr;             // cache LRU list (oldest first)
  Range* lru_next = nullptr;
  size_t bucket_pos = 0;                 // index in the cache bucket of its chunk count
};

}  // namespace vmalloc
