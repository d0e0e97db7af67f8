#include "alloc/small_bins.hpp"

namespace vmalloc {

SmallBins::~SmallBins() {
  std::vector<Range*> ranges;
  std::vector<driver::EventHandle> events;
  clear({}, ranges, events);  // ranges are owned (and freed) by the allocator
}

Block* SmallBins::take(size_t rounded, uintptr_t stream) {
  auto pit = pools_.find(stream);
  if (pit == pools_.end()) return nullptr;
  Pool& pool = pit->second;
  // Block pointers order ties, so the smallest key of this size is (rounded, nullptr).
  auto it = pool.free.lower_bound({rounded, nullptr});
  if (it == pool.free.end()) return nullptr;
  Block* b = it->second;
  pool.free.erase(it);
  if (b->slab->used == 0) --pool.empty_slabs;
  if (b->size - rounded >= kSmallAlign) {
    Block* rest = new Block;
    rest->slab = b->slab;
    rest->addr = b->addr + rounded;
    rest->size = b->size - rounded;
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = rounded;
    pool.free.insert({rest->size, rest});
  }
  b->free = false;
  b->slab->used += b->size;
  return b;
}

void SmallBins::add_slab(Range* r, size_t bytes, uintptr_t stream) {
  Slab* s = new Slab;
  s->range = r;
  s->stream = stream;
  slabs_.insert(s);
  Block* b = new Block;
  b->slab = s;
  b->addr = r->addr;
  b->size = bytes;
  Pool& pool = pools_[stream];
  pool.free.insert({b->size, b});
  ++pool.empty_slabs;
}

Range* SmallBins::give(Block* b) {
  Slab* s = b->slab;
  Pool& pool = pools_[s->stream];
  s->used -= b->size;
  b->free = true;
  b->requested = 0;
  b->id = 0;
  b->extra_streams.clear();
  if (Block* n = b->next; n && n->free) {
    erase_free(pool, n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    delete n;
  }
  if (Block* p = b->prev; p && p->free) {
    erase_free(pool, p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    delete b;
    b = p;
  }
  if (s->used != 0) {
    pool.free.insert({b->size, b});
    return nullptr;
  }
  // The slab is empty: b is its only block. Keep one empty slab per stream.
  if (pool.empty_slabs == 0) {
    pool.free.insert({b->size, b});
    ++pool.empty_slabs;
    return nullptr;
  }
  Range* r = s->range;
  drop_slab(pool, s, b);
  return r;
}

void SmallBins::drop_slab(Pool& pool, Slab* s, Block* only) {
  (void)pool;
  delete only;
  slabs_.erase(s);
  delete s;
}

std::vector<Range*> SmallBins::take_empty_slabs() {
  std::vector<Range*> out;
  for (auto& [stream, pool] : pools_) {
    (void)stream;
    if (pool.empty_slabs == 0) continue;
    for (auto it = pool.free.begin(); it != pool.free.end();) {
      Block* b = it->second;
      if (b->slab->used == 0) {
        it = pool.free.erase(it);
        out.push_back(b->slab->range);
        drop_slab(pool, b->slab, b);
      } else {
        ++it;
      }
    }
    pool.empty_slabs = 0;
  }
  return out;
}

void SmallBins::clear(const std::vector<Block*>& live, std::vector<Range*>& out,
                      std::vector<driver::EventHandle>& events_out) {
  // Every block is reachable by walking address order from a free, deferred or live block.
  std::set<Block*> all;
  auto walk = [&all](Block* b) {
    while (b->prev) b = b->prev;
    for (; b; b = b->next) all.insert(b);
  };
  for (auto& [stream, pool] : pools_) {
    (void)stream;
    for (auto& e : pool.free) walk(e.second);
  }
  for (Block* b : pending_) walk(b);
  for (Block* b : live) walk(b);
  for (Block* b : all) {
    for (auto e : b->events) events_out.push_back(e);
    delete b;
  }
  for (Slab* s : slabs_) {
    out.push_back(s->range);
    delete s;
  }
  slabs_.clear();
  pools_.clear();
  pending_.clear();
}

}  // namespace vmalloc
