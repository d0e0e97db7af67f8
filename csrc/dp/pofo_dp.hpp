// pofo, seed 001 Appendix B: optimal persistent rematerialization + offloading under the
// assumptions of its section 3.2 (offloads before the loss, prefetches after it, memory
// persistency, continuous release/reservation during a transfer).
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace vmalloc {
namespace pofo {

// Our chain model (DESIGN.md) in integer memory units.  Stage s = 0..L (L is the loss).
// x and delta have L+2 entries (x[L+1] = delta[L+1] = 0).
struct Chain {
  int L = 0;
  std::vector<int64_t> x, xbar, delta, fw_tmp, bw_tmp;
  std::vector<int64_t> fck_tmp;  // transient of F_ck / F_none (Chain.fck_tmp)
  std::vector<double> fw, bw;  // seconds
};

struct Options {
  bool offload = true;    // allow O / P (false, or beta = 0: rotor's persistent DP)
  bool recompute = true;  // allow F_ck / F_none (false: offload-only under the same model)
  // Only look for sequences faster than this (seconds): branch and bound against a known
  // solution (e.g. rotor's). If none is faster, the result is infeasible.
  double budget = std::numeric_limits<double>::infinity();
  // Round the forward states' Delta_F / Delta_B up to multiples of this many units (1 =
  // exact). Fewer states, a little pessimism; the plan is simulated anyway.
  int delta_step = 1;
  // Stages whose input may not be offloaded (our improvement step's "recompute instead of
  // transfer" move, scheduler/planners/improve.py); empty = all may be.
  std::vector<uint8_t> no_offload;
  // Ours, not seed 001 (issue 14): the simulator's whole-activation model instead of
  // assumption 3 (see pofo_dp.cpp "Whole-activation mode"). Its value is achievable: the
  // plan it emits (prefetches included) simulates no slower. Needs memory < 1024 units
  // and L < 64.
  bool whole = false;
};

// One op of the resulting sequence, in order.  kind: 0 F_all, 1 F_ck, 2 F_none, 3 B,
// 4 offload (of the input of `stage`, placed right before the forward that reads it),
// 5 prefetch (whole mode only: placed exactly where the DP timed it).
struct Op {
  int kind, stage;
};

struct Result {
  bool feasible = false;
  double time = 0;              // the DP's makespan under its model (seconds)
  std::vector<Op> ops;          // compute ops and offloads (prefetches: see `prefetch`)
  // For each offloaded stage s (in the order the prefetches run): s and the index in `ops`
  // of the first backward-phase op that needs the input of s back.
  std::vector<std::pair<int, int>> prefetch;
  size_t states_fwd = 0, states_bwd = 0;  // memo sizes, for the benchmark
};

Result solve(const Chain& c, int64_t memory, double beta, const Options& opt);

}  // namespace pofo
}  // namespace vmalloc
