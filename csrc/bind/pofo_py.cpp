// Python binding of pofo (seed 001, Appendix B): csrc/dp/pofo_dp.*
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "dp/pofo_dp.hpp"

namespace nb = nanobind;

void bind_pofo(nb::module_& m) {
  m.def(
      "pofo_solve",
      [](std::vector<int64_t> x, std::vector<int64_t> xbar, std::vector<int64_t> delta,
         std::vector<int64_t> fw_tmp, std::vector<int64_t> bw_tmp, std::vector<double> fw,
         std::vector<double> bw, int64_t memory, double beta, bool offload, bool recompute,
         double budget, int delta_step, std::vector<uint8_t> no_offload, bool whole,
         std::vector<int64_t> fck_tmp) {
        vmalloc::pofo::Chain c;
        c.L = static_cast<int>(fw.size()) - 1;
        const size_t n = fw.size();
        if (c.L < 0 || bw.size() != n || xbar.size() != n || fw_tmp.size() != n ||
            bw_tmp.size() != n || x.size() != n + 1 || delta.size() != n + 1 ||
            (!fck_tmp.empty() && fck_tmp.size() != n))
          throw std::invalid_argument("pofo: inconsistent chain array lengths");
        if (c.L >= 1000) throw std::invalid_argument("pofo: at most 1000 stages");
        if (memory < 0 || memory >= (1 << 17))
          throw std::invalid_argument("pofo: memory must be in [0, 131071] units (use slots)");
        c.x = std::move(x);
        c.xbar = std::move(xbar);
        c.delta = std::move(delta);
        c.fck_tmp = fck_tmp.empty() ? fw_tmp : std::move(fck_tmp);  // default: one transient
        c.fw_tmp = std::move(fw_tmp);
        c.bw_tmp = std::move(bw_tmp);
        c.fw = std::move(fw);
        c.bw = std::move(bw);
        vmalloc::pofo::Options opt;
        opt.offload = offload;
        opt.recompute = recompute;
        opt.budget = budget;
        opt.delta_step = delta_step;
        opt.no_offload = std::move(no_offload);
        opt.whole = whole;
        if (whole && (memory >= (1 << 10) || c.L >= 64))
          throw std::invalid_argument("pofo: whole=True needs memory in [0, 1023] units and "
                                      "at most 63 stages");
        vmalloc::pofo::Result r;
        {
          nb::gil_scoped_release release;
          r = vmalloc::pofo::solve(c, memory, beta, opt);
        }
        std::vector<std::pair<int, int>> ops;
        ops.reserve(r.ops.size());
        for (const auto& op : r.ops) ops.emplace_back(op.kind, op.stage);
        return nb::make_tuple(r.feasible, r.time, ops, r.prefetch, r.states_fwd, r.states_bwd);
      },
      nb::arg("x"), nb::arg("xbar"), nb::arg("delta"), nb::arg("fw_tmp"), nb::arg("bw_tmp"),
      nb::arg("fw"), nb::arg("bw"), nb::arg("memory"), nb::arg("beta"), nb::arg("offload"),
      nb::arg("recompute"), nb::arg("budget"), nb::arg("delta_step"),
      nb::arg("no_offload") = std::vector<uint8_t>(), nb::arg("whole") = false,
      nb::arg("fck_tmp") = std::vector<int64_t>(),
      "Seed 001 Appendix B -> (feasible, time, [(kind, stage)], [(stage, consumer index)], "
      "forward states, backward states). kind: 0 F_all, 1 F_ck, 2 F_none, 3 B, 4 offload, 5 "
      "prefetch (whole only). whole: the simulator's whole-activation model (ours). no_offload: "
      "stages whose input may not be offloaded. fck_tmp: transient of F_ck/F_none (default fw_tmp).");
}
