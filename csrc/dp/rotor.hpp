// Optimal persistent checkpointing of a heterogeneous chain (seed 002, Theorem 1, Alg. 1-2).
//
// Indexing is DESIGN.md's: stages s = 0..L, stage L is the loss; x[s] is the input of
// stage s, xbar[s] what F_all s keeps, delta[s] the gradient B s produces. The caller
// passes x and delta with one extra entry (x[L+1] = delta[L+1] = 0: the loss value and the
// gradient nothing consumes), sizes both in integer memory units (the DP's discretization)
// and exact (for the predicted peak), and a budget in units that counts x[0].
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace vmalloc {
namespace dp {

enum RotorKind : int { kFAll = 0, kFCk = 1, kFNone = 2, kB = 3 };

struct RotorSizes {            // one entry per stage (x, delta: L+2 entries)
  std::vector<int64_t> x, xbar, delta, fw_tmp, bw_tmp, fck_tmp;
};
struct RotorExact {
  std::vector<double> x, xbar, delta, fw_tmp, bw_tmp, fck_tmp;
};

struct RotorResult {
  bool feasible = false;
  double time = 0;                          // DP value C(0, L, budget - x[0])
  double peak = 0;                          // exact peak of the plan, x[0] included
  int64_t min_units = 0;                    // smallest feasible budget (units, x[0] included)
  std::vector<std::pair<int, int>> ops;     // (RotorKind, stage)
  int64_t used_budget = 0;                  // the budget (units) the plan was rebuilt at
  int tried = 0;                            // plans rebuilt and scored (refinement)
  int steps = 0;                            // distinct DP values in [budget, budget + extra]
};

// allow_all = false restricts the DP to the AD model (revolve): F_all only right before its B.
// exact_values: keep the table in double (exact optimality for integer times below 2^53)
// rather than float (half the memory traffic; what the discretized mode uses).
// extra > 0 (refinement, see rotor.cpp): tabulate up to budget + extra units (one table) and
// return the fastest plan rebuilt at a budget in [budget, budget + extra] whose exact peak is
// at most exact_limit (ties: the lower peak; the caller adds its tolerance to the limit); the
// plan at budget itself is the fallback. A budget below the rounded minimum (min_units) has no
// fallback: it is refined from the minimum when that is within budget + extra, else infeasible.
// The table holds only the cells the answer can read; whole_table: every cell up to
// budget + extra instead (the same answer, slower: tests compare the two).
RotorResult rotor_solve(const std::vector<double>& fw, const std::vector<double>& bw,
                        const RotorSizes& units, const RotorExact& exact, int64_t budget,
                        bool allow_all, bool exact_values, int64_t extra = 0,
                        double exact_limit = 0, bool whole_table = false);

// Smallest feasible budget in units (x[0] included); O(L^3), no table.
int64_t rotor_min_units(const RotorSizes& units, bool allow_all);

}  // namespace dp
}  // namespace vmalloc
