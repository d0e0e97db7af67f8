// address -> value hash map for the live allocations: open addressing with linear probing and
// backward-shift deletion (no tombstones), so malloc/free on the fast path allocate nothing
// (std::unordered_map allocates a node per insert, a measurable share of a ~100 ns malloc+free).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace vmalloc {

class PtrMap {
 public:
  PtrMap() { rehash(1024); }

  size_t size() const { return size_; }

  // Room for `extra` more keys without a rehash: an insert that must not fail calls this first.
  void reserve_for(size_t extra) {
    while ((size_ + extra) * 4 > slots_.size() * 3) rehash(slots_.size() * 2);
  }

  // Insert a key that is not present (addresses of live allocations are unique).
  void insert(uintptr_t key, uintptr_t value) {
    if ((size_ + 1) * 4 > slots_.size() * 3) rehash(slots_.size() * 2);
    size_t i = home(key);
    while (slots_[i].key != 0) i = (i + 1) & mask_;
    slots_[i] = Slot{key, value};
    ++size_;
  }

  // Remove `key`; returns false (and leaves `value` alone) when absent.
  bool take(uintptr_t key, uintptr_t& value) {
    size_t i = home(key);
    while (true) {
      if (slots_[i].key == 0) return false;
      if (slots_[i].key == key) break;
      i = (i + 1) & mask_;
    }
    value = slots_[i].value;
    // Backward shift: pull later members of the probe run into the hole.
    size_t hole = i;
    for (size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
      size_t h = home(slots_[j].key);
      // j's home lies cyclically outside (hole, j]: it may move into the hole.
      if (((j - h) & mask_) >= ((j - hole) & mask_)) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    --size_;
    return true;
  }

  const uintptr_t* find(uintptr_t key) const {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i].value;
      if (slots_[i].key == 0) return nullptr;
    }
  }

  template <class F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.key != 0) f(s.key, s.value);
  }

  void clear() {
    slots_.assign(slots_.size(), Slot{});
    size_ = 0;
  }

 private:
  struct Slot {
    uintptr_t key = 0;  // 0 = empty (no allocation lives at address 0)
    uintptr_t value = 0;
  };
  size_t home(uintptr_t key) const {
    // Allocations are >= 512-byte aligned: drop the zero bits, then multiplicative hashing.
    return static_cast<size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> shift_) & mask_;
  }
  void rehash(size_t n) {
    std::vector<Slot> old(n, Slot{});  // made first: if this throws, the map is as it was
    old.swap(slots_);
    mask_ = n - 1;
    shift_ = 64;
    for (size_t m = n; m > 1; m >>= 1) --shift_;
    size_ = 0;
    for (const Slot& s : old)
      if (s.key != 0) insert(s.key, s.value);
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  unsigned shift_ = 64;
  size_t size_ = 0;
};

}  // namespace vmalloc
