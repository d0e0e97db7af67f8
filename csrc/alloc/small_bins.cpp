#include "alloc/small_bins.hpp"

#include <algorithm>

namespace vmalloc {

void Pool::push(Block* b) {
  size_t c = class_of(b->size);
  b->fprev = nullptr;
  b->fnext = heads[c];
  if (heads[c]) heads[c]->fprev = b;
  heads[c] = b;
  bits[c / 64] |= uint64_t(1) << (c % 64);
}

void Pool::remove(Block* b) {
  size_t c = class_of(b->size);
  if (b->fprev)
    b->fprev->fnext = b->fnext;
  else
    heads[c] = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = nullptr;
  if (!heads[c]) bits[c / 64] &= ~(uint64_t(1) << (c % 64));
}

Block* Pool::best_fit(size_t rounded) {
  size_t c = class_of(rounded);
  size_t w = c / 64;
  uint64_t word = bits[w] & (~uint64_t(0) << (c % 64));
  while (true) {
    if (word) {
      size_t found = w * 64 + static_cast<size_t>(__builtin_ctzll(word));
      if (found < kTopClass) return heads[found];  // exact-size classes: any block fits
      // Top class: sizes vary; the smallest that fits.
      Block* best = nullptr;
      for (Block* b = heads[found]; b; b = b->fnext)
        if (b->size >= rounded && (!best || b->size < best->size)) best = b;
      return best;
    }
    if (++w == bits.size()) return nullptr;
    word = bits[w];
  }
}

SmallBins::~SmallBins() {
  clear([](driver::EventHandle) {}, [](Range*) {});  // ranges are owned (and freed) by the allocator
}

Pool* SmallBins::pool_for(uintptr_t stream) {
  if (last_pool_ && last_pool_->stream == stream) return last_pool_;
  auto it = pools_.find(stream);
  if (it == pools_.end()) return nullptr;
  return last_pool_ = it->second.get();
}

Block* SmallBins::new_block() {
  if (spare_.empty()) return new Block;
  Block* b = spare_.back();
  spare_.pop_back();
  return b;
}

void SmallBins::recycle(Block* b) {
  b->extra_streams.clear();
  b->events.clear();
  b->prev = b->next = b->fprev = b->fnext = nullptr;
  b->slab = nullptr;
  spare_.push_back(b);
}

Block* SmallBins::take(size_t rounded, uintptr_t stream) {
  Pool* pool = pool_for(stream);
  if (!pool) return nullptr;
  Block* b = pool->best_fit(rounded);
  if (!b) return nullptr;
  pool->remove(b);
  if (b->slab->used == 0) --pool->empty_slabs;
  if (b->size - rounded >= kSmallAlign) {
    Block* rest = new_block();
    rest->slab = b->slab;
    rest->addr = b->addr + rounded;
    rest->size = b->size - rounded;
    rest->free = true;
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = rounded;
    pool->push(rest);
  }
  b->free = false;
  b->slab->used += b->size;
  return b;
}

void SmallBins::add_slab(Range* r, size_t bytes, uintptr_t stream) {
  auto& slot = pools_[stream];
  if (!slot) {
    slot = std::make_unique<Pool>();
    slot->stream = stream;
  }
  Slab* s = new Slab;
  s->range = r;
  s->pool = slot.get();
  s->stream = stream;
  s->index = slabs_.size();
  slabs_.push_back(s);
  Block* b = new_block();
  s->first = b;
  b->slab = s;
  b->addr = r->addr;
  b->size = bytes;
  b->free = true;
  s->pool->push(b);
  ++s->pool->empty_slabs;
}

Range* SmallBins::give(Block* b) {
  Slab* s = b->slab;
  Pool* pool = s->pool;
  s->used -= b->size;
  b->free = true;
  b->requested = 0;
  b->id = 0;
  b->extra_streams.clear();
  if (Block* n = b->next; n && n->free) {
    pool->remove(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    recycle(n);
  }
  if (Block* p = b->prev; p && p->free) {
    pool->remove(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    recycle(b);
    b = p;
  }
  if (s->used != 0 || pool->empty_slabs == 0) {
    // Keep it; an empty slab is kept when it is this stream's only one.
    if (s->used == 0) ++pool->empty_slabs;
    pool->push(b);
    return nullptr;
  }
  Range* r = s->range;  // empty, and the stream already keeps an empty slab: release
  drop_slab(s, b);
  return r;
}

void SmallBins::drop_slab(Slab* s, Block* only) {
  recycle(only);
  Slab* last = slabs_.back();  // O(1) removal: the last slab takes its place
  slabs_[s->index] = last;
  last->index = s->index;
  slabs_.pop_back();
  delete s;
}

std::vector<Range*> SmallBins::take_empty_slabs() {
  std::vector<Range*> out;
  for (size_t i = 0; i < slabs_.size();) {
    Slab* s = slabs_[i];
    if (s->used != 0) {
      ++i;
      continue;
    }
    // An empty slab is one free block starting at the range.
    Block* only = s->first;
    s->pool->remove(only);
    --s->pool->empty_slabs;
    out.push_back(s->range);
    drop_slab(s, only);  // slabs_[i] is now another slab (or gone)
  }
  return out;
}

}  // namespace vmalloc
