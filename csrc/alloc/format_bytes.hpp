// Byte counts for messages, in binary units: the allocator's errors and the PyTorch entry points'
// out-of-memory text. One scaling rule; two spellings, each kept as its messages always read.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>

namespace vmalloc {

namespace format_bytes_detail {

// `n` in the largest of KiB .. units[top] it reaches, "%.2f <unit>"; "" below 1 KiB. Dividing by
// 1024 is exact in floating point, so this equals dividing once by the unit.
inline std::string scaled(size_t n, int top) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < top) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return std::string();
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace format_bytes_detail

// "3.00 MiB", "1.50 TiB"; below 1 KiB "512 B" (the PyTorch entry points' out-of-memory text).
inline std::string format_bytes(size_t n) {
  std::string s = format_bytes_detail::scaled(n, 4);
  return s.empty() ? std::to_string(n) + " B" : s;
}

// With the exact count, for the allocator's own errors (a size the caller passed is recognisable):
// "3.00 MiB (3145728 bytes)", GiB at most ("2048.00 GiB (...)"); below 1 KiB "512 bytes".
inline std::string format_bytes_exact(size_t n) {
  std::string s = format_bytes_detail::scaled(n, 3);
  return s.empty() ? std::to_string(n) + " bytes" : s + " (" + std::to_string(n) + " bytes)";
}

}  // namespace vmalloc
