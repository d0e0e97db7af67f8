// Python binding of the offloading DYNPROG (seed 000, Algorithm 1): csrc/dp/offload_dp.*
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "dp/offload_dp.hpp"

namespace nb = nanobind;
using vmalloc::offload::Chain;
using vmalloc::offload::Result;

namespace {

Chain make_chain(std::vector<int64_t> act, std::vector<int64_t> grad, std::vector<int64_t> fw_tmp,
                 std::vector<int64_t> bw_tmp, std::vector<double> fw, std::vector<double> bw) {
  Chain c;
  c.L = static_cast<int>(fw.size()) - 1;
  if (c.L < 0 || bw.size() != fw.size() || fw_tmp.size() != fw.size() ||
      bw_tmp.size() != fw.size() || act.size() != fw.size() + 1 || grad.size() != fw.size() + 1)
    throw std::invalid_argument("offload: inconsistent chain array lengths");
  c.act = std::move(act);
  c.grad = std::move(grad);
  c.fw_tmp = std::move(fw_tmp);
  c.bw_tmp = std::move(bw_tmp);
  c.fw = std::move(fw);
  c.bw = std::move(bw);
  return c;
}

nb::tuple pack(const Result& r) {
  std::vector<int> off(r.offload.begin(), r.offload.end());
  return nb::make_tuple(r.feasible, r.idle, off, r.states);
}

}  // namespace

void bind_offload(nb::module_& m) {
  m.def(
      "offload_dynprog",
      [](std::vector<int64_t> act, std::vector<int64_t> grad, std::vector<int64_t> fw_tmp,
         std::vector<int64_t> bw_tmp, std::vector<double> fw, std::vector<double> bw,
         int64_t memory, double beta, bool exact) {
        Chain c = make_chain(std::move(act), std::move(grad), std::move(fw_tmp),
                             std::move(bw_tmp), std::move(fw), std::move(bw));
        Result r;
        {
          nb::gil_scoped_release release;
          r = vmalloc::offload::solve(c, memory, beta, exact);
        }
        return pack(r);
      },
      "Seed 000 Algorithm 1 -> (feasible, relaxed idle time, offload flags, states).");
  m.def(
      "offload_evaluate",
      [](std::vector<int64_t> act, std::vector<int64_t> grad, std::vector<int64_t> fw_tmp,
         std::vector<int64_t> bw_tmp, std::vector<double> fw, std::vector<double> bw,
         int64_t memory, double beta, std::vector<int> offload, bool exact) {
        Chain c = make_chain(std::move(act), std::move(grad), std::move(fw_tmp),
                             std::move(bw_tmp), std::move(fw), std::move(bw));
        std::vector<uint8_t> off(offload.begin(), offload.end());
        return pack(vmalloc::offload::evaluate(c, memory, beta, off, exact));
      },
      "Algorithm 1's recurrence along fixed offload decisions (for tests).");
}
