// Python face of the checkpointing DP (csrc/dp/rotor.*): scheduler.planners.rotor / revolve.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "dp/rotor.hpp"

namespace nb = nanobind;
using I = std::vector<int64_t>;
using D = std::vector<double>;

void bind_rotor(nb::module_& m) {
  m.def(
      "rotor_solve",
      [](D fw, D bw, std::tuple<I, I, I, I, I, I> u, std::tuple<D, D, D, D, D, D> e, int64_t budget,
         bool allow_all, bool exact_values, int64_t extra, double exact_limit, bool whole_table) {
        vmalloc::dp::RotorSizes units{std::get<0>(u), std::get<1>(u), std::get<2>(u),
                                      std::get<3>(u), std::get<4>(u), std::get<5>(u)};
        vmalloc::dp::RotorExact exact{std::get<0>(e), std::get<1>(e), std::get<2>(e),
                                      std::get<3>(e), std::get<4>(e), std::get<5>(e)};
        vmalloc::dp::RotorResult r;
        {
          nb::gil_scoped_release release;
          r = vmalloc::dp::rotor_solve(fw, bw, units, exact, budget, allow_all, exact_values, extra,
                                      exact_limit, whole_table);
        }
        return nb::make_tuple(r.feasible, r.time, r.peak, r.min_units, r.ops, r.used_budget,
                              r.tried, r.steps);
      },
      nb::arg("fw"), nb::arg("bw"), nb::arg("units"), nb::arg("exact"), nb::arg("budget"),
      nb::arg("allow_all") = true, nb::arg("exact_values") = true, nb::arg("extra") = 0,
      nb::arg("exact_limit") = 0.0, nb::arg("whole_table") = false,
      "Seed 002 Algorithms 1-2. units (int) / exact (float): (x, xbar, delta, fw_tmp, bw_tmp, fck_tmp),\n"
      "x and delta of length L+2. Returns (feasible, time, peak, min_units, ops[(kind, stage)],\n"
      "used_budget, tried, steps), kind 0 F_all, 1 F_ck, 2 F_none, 3 B. extra > 0: the fastest plan\n"
      "rebuilt at a budget in [budget, budget + extra] (one table) whose exact peak <= exact_limit.\n"
      "whole_table: tabulate every cell up to budget + extra, not only those the answer reads\n"
      "(the same result, slower; for tests).");
  m.def(
      "rotor_min_units",
      [](std::tuple<I, I, I, I, I, I> u, bool allow_all) {
        vmalloc::dp::RotorSizes units{std::get<0>(u), std::get<1>(u), std::get<2>(u),
                                      std::get<3>(u), std::get<4>(u), std::get<5>(u)};
        return vmalloc::dp::rotor_min_units(units, allow_all);
      },
      nb::arg("units"), nb::arg("allow_all") = true,
      "Smallest feasible budget in units (x[0] included).");
}
