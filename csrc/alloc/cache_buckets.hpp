// The cache of mapped ranges, bucketed by chunk count. Chunk counts below kDirect index a vector
// directly with a bitmap of non-empty buckets (no allocation when a bucket empties and refills on
// the fast path; the next larger non-empty bucket is a few word scans); larger counts use a map.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "alloc/range.hpp"

namespace vmalloc {

class CacheBuckets {
 public:
  static constexpr size_t kDirect = 1024;

  CacheBuckets() : direct_(kDirect), bits_(kDirect / 64, 0) {}

  // The bucket of k chunks, or nullptr if empty.
  std::vector<Range*>* find(size_t k) {
    if (k < kDirect) return direct_[k].empty() ? nullptr : &direct_[k];
    auto it = big_.find(k);
    return it == big_.end() ? nullptr : &it->second;
  }

  void push(Range* r) {
    std::vector<Range*>& b = r->k < kDirect ? direct_[r->k] : big_[r->k];
    r->bucket_pos = b.size();
    b.push_back(r);
    if (r->k < kDirect) bits_[r->k / 64] |= uint64_t(1) << (r->k % 64);
  }

  void erase(Range* r) {
    size_t k = r->k;
    std::vector<Range*>* b = find(k);
    Range* last = b->back();
    (*b)[r->bucket_pos] = last;
    last->bucket_pos = r->bucket_pos;
    b->pop_back();
    if (!b->empty()) return;
    if (k < kDirect)
      bits_[k / 64] &= ~(uint64_t(1) << (k % 64));
    else
      big_.erase(k);
  }

  // Smallest chunk count > k with a non-empty bucket; 0 if none.
  size_t next_above(size_t k) const {
    size_t i = k + 1;
    if (i < kDirect) {
      size_t w = i / 64;
      uint64_t word = bits_[w] & (~uint64_t(0) << (i % 64));
      while (true) {
        if (word) return w * 64 + static_cast<size_t>(__builtin_ctzll(word));
        if (++w == bits_.size()) break;
        word = bits_[w];
      }
      i = kDirect;
    }
    auto it = big_.lower_bound(i);
    return it == big_.end() ? 0 : it->first;
  }

  void clear() {
    for (auto& b : direct_) b.clear();
    std::fill(bits_.begin(), bits_.end(), 0);
    big_.clear();
  }

 private:
  std::vector<std::vector<Range*>> direct_;
  std::vector<uint64_t> bits_;
  std::map<size_t, std::vector<Range*>> big_;
};

}  // namespace vmalloc
