#include "alloc/bench_loops.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <random>
#include <thread>
#include <utility>

namespace vmalloc {
namespace bench {

double malloc_free_cycle(Allocator& a, const std::vector<size_t>& sizes, size_t repeats) {
  auto t0 = std::chrono::steady_clock::now();
  for (size_t r = 0; r < repeats; ++r)
    for (size_t n : sizes) a.free(a.malloc(n, 0));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

namespace {

struct Held {
  unsigned char* p;
  size_t n;
  unsigned char tag;
};

// Every byte of blocks up to 64 KiB; every 4096th byte (and the last) of larger ones, which are
// chunk aligned, so probes of two overlapping large ranges land on the same addresses.
template <class F>
void for_each_probe(size_t n, F&& f) {
  size_t step = n <= (64u << 10) ? 1 : 4096;
  for (size_t i = 0; i < n; i += step) f(i);
  f(n - 1);
}

}  // namespace

StressResult stress_threads(Allocator& a, int threads, size_t iters, size_t max_bytes, uint64_t seed) {
  std::atomic<uint64_t> ops{0}, bad{0}, overlaps{0}, oom{0};
  auto body = [&](int t) {
    std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(t));
    std::vector<Held> held;
    unsigned char next_tag = static_cast<unsigned char>(t * 37 + 1);
    auto check_and_free = [&](size_t i) {
      Held h = held[i];
      for_each_probe(h.n, [&](size_t off) {
        if (h.p[off] != h.tag) ++bad;
      });
      a.free(h.p);
      ++ops;
      held[i] = held.back();
      held.pop_back();
    };
    for (size_t it = 0; it < iters; ++it) {
      bool do_free = !held.empty() && (held.size() >= 8 || (rng() & 1));
      if (do_free) {
        check_and_free(rng() % held.size());
        continue;
      }
      // Log-uniform sizes: mostly small blocks, some multi-chunk ranges.
      std::uniform_real_distribution<double> u(0.0, std::log2(static_cast<double>(max_bytes)));
      size_t n = std::max<size_t>(1, static_cast<size_t>(std::exp2(u(rng))));
      unsigned char* p;
      try {
        p = static_cast<unsigned char*>(a.malloc(n, 0));
      } catch (const OutOfMemory&) {
        ++oom;
        continue;
      }
      ++ops;
      for (const Held& h : held)
        if (p < h.p + h.n && h.p < p + n) ++overlaps;
      next_tag = static_cast<unsigned char>(next_tag == 255 ? 1 : next_tag + 1);
      for_each_probe(n, [&](size_t off) { p[off] = next_tag; });
      held.push_back(Held{p, n, next_tag});
    }
    while (!held.empty()) check_and_free(held.size() - 1);
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(body, t);
  for (auto& th : pool) th.join();
  StressResult r;
  r.operations = ops;
  r.corruptions = bad;
  r.overlaps = overlaps;
  r.oom = oom;
  return r;
}

}  // namespace bench
}  // namespace vmalloc
