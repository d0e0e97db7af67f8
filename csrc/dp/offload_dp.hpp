// DYNPROG of seed 000 (Algorithm 1, equations 1-10): the offload decisions that minimise the
// idle time of an ordered, no-wait schedule under the "fractional communications" relaxation
// (each activation is offloaded entirely or not at all, but memory is released / reserved
// continuously while it moves, and prefetches run as late as possible).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace vmalloc {
namespace offload {

// The chain in the seed-000 view, in integer memory units (slots, or bytes when exact).
// Index i = 0..L is stage i (L is the loss).  act[i] is seed 000's |x_i|: the input of stage
// i as the offload-only schedule stores it (x[0], then xbar[i-1]); act has L+2 entries, the
// last (xbar[L]) is never offloaded.  grad[i] = delta[i], L+2 entries (grad[L+1] = 0).
struct Chain {
  int L = 0;
  std::vector<int64_t> act, grad, fw_tmp, bw_tmp;
  std::vector<double> fw, bw;  // seconds
};

struct Result {
  bool feasible = false;
  double idle = 0;                 // relaxed idle time (seconds): makespan = compute + idle
  std::vector<uint8_t> offload;    // offload[i]: the input of stage i is offloaded (i = 0..L)
  size_t states = 0;               // hash-table entries visited (for the benchmark)
};

// memory: the limit in units; beta: units per second (0 = no transfers, +inf = free ones).
// The data a stage moves, beta times its time, is rounded to the nearest unit: the states stay
// on the unit grid, few enough for long chains in slots. With `exact` that data is kept exact
// (fractional units): the recurrence is then the relaxation itself, as exact units (bytes)
// need; rounding 0.4 B to 0 charged idle time no plan has.
Result solve(const Chain& c, int64_t memory, double beta, bool exact);

// The same recurrence along fixed decisions (for the exhaustive test of the search).
Result evaluate(const Chain& c, int64_t memory, double beta, const std::vector<uint8_t>& offload,
                bool exact);

}  // namespace offload
}  // namespace vmalloc
