// DYNPROG, seed 000 Algorithm 1.  Notation of the paper: x_i = c.act[i], y_i = c.grad[i],
// ex_i^F / ex_i^B = fw_tmp / bw_tmp, u_F / u_B = fw / bw, B = beta.
//
// Reconstructions of garbled formulas (the paper's text is a PDF conversion):
//  * Algorithm 1 writes "M_F + ex^F - Delta_F + |x_{i+1}| <= M" and
//    "M_B = |y_i| + Delta_B + M_F - Delta_F": the Deltas there are the positive parts
//    Delta^+ (a negative Delta is idle channel time, not memory).
//  * Eq. (6) reads ex_i^F; it is ex_i^B (the backward's transient memory).
//  * Delta_B is indexed the same way as Delta_F: Delta_{B_i} is the amount of data from
//    x_0..x_{i-1} already prefetched when B_{i-1} starts (prefetches as late as possible),
//    eps_i^B the idle between the end of B_i and the start of B_{i-1}; M_B is the memory
//    just before B_{i-1} and the check of B_i is M_B - Delta_B^+ + ex_i^B + |x_{i+1}| + |y_{i+1}|.
//  * Eq. (9): R_j^B = ex_j^B + |y_j| + |y_{j+1}| - sum_{k >= j+2} |x_k| (the text's y_{j-1} is
//    y_{j+1}: B_j holds its input and output gradients), and the window also needs
//    R_j^B + M_F - Delta_F <= M (all offloads done) or the state is infeasible.
//  * Negative Deltas (idle channel credit) are clamped at -M: only credit up to the largest
//    possible positive Delta of the other phase (<= M) ever matters (eqs. 9, 10).
// Discretisation (see offload_dp.hpp): on the unit grid, data moved during a time t is
// t * beta units rounded to the nearest (floor would lose up to a unit per stage and pile up
// over long chains: seed 000 section 6.2; up would gain as much), except that an idle
// eps = excess / beta moves exactly `excess` units. With exact moves (`exact`) the
// states hold fractional units instead (N = double): the recurrence is then the relaxation
// itself, with a tolerance for float rounding in its memory checks.
#include "dp/offload_dp.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <unordered_map>

namespace vmalloc {
namespace offload {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// N: int64_t (the unit grid) or double (exact moves: fractional units)
template <class N>
struct State {
  N mf, df, db;
  bool operator==(const State& o) const { return mf == o.mf && df == o.df && db == o.db; }
};
inline uint64_t bits(int64_t v) { return static_cast<uint64_t>(v); }
inline uint64_t bits(double v) {
  v += 0.0;  // -0.0 == 0.0: one hash
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}
template <class N>
struct StateHash {
  size_t operator()(const State<N>& s) const {
    uint64_t h = bits(s.mf) * 0x9E3779B97F4A7C15ull;
    h ^= bits(s.df) + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2);
    h ^= bits(s.db) * 0xC2B2AE3D27D4EB4Full + (h << 6) + (h >> 2);
    return static_cast<size_t>(h);
  }
};

// Units of data moved in `t` seconds (never more than `cap`: with beta = inf, everything):
// on the grid, to the nearest unit (unbiased over many steps); else exactly.
template <class N>
N moved(double t, double beta, N cap) {
  if (beta <= 0 || t <= 0) return 0;
  double v = t * beta;
  if (!std::isfinite(v) || v >= static_cast<double>(cap)) return cap;
  if constexpr (std::is_integral_v<N>) return static_cast<N>(std::floor(v + 0.5));
  return v;
}

template <class N>
double wait(N excess, double beta) {
  if (excess <= 0) return 0;
  return std::isinf(beta) ? 0.0 : excess / beta;
}

template <class N>
struct Model {
  using S = State<N>;
  const Chain& c;
  N M;
  double beta;
  N big;  // "everything" for moved(): more than any Delta can be
  // exact moves: float rounding of sums of whole sizes and fractional moves is far below
  // this; a memory check passes within it and a remainder within it is none (0 on the grid)
  N tol;
  std::vector<double> ubF, ubB;  // suffix sums U_j^F, U_j^B
  std::vector<int64_t> act_suffix;  // sum_{k >= j} act[k]

  Model(const Chain& ch, int64_t mem, double b) : c(ch), M(static_cast<N>(mem)), beta(b) {
    const int L = c.L;
    // "everything": 4 (sum of act + M) + 4, saturated. Exact units (slots=None) allow a
    // budget of up to 2^62 bytes, where the plain product overflowed int64 (UB; in practice
    // it wrapped negative, and moved() then returned a negative amount: a huge bogus idle).
    // Saturating at kCap keeps every sum below (exF + big, q - DF, ...) in range.
    constexpr int64_t kCap = std::numeric_limits<int64_t>::max() / 8;
    int64_t tot = 0;
    for (auto a : c.act) tot = a >= kCap - tot ? kCap : tot + std::max<int64_t>(a, 0);
    const int64_t m = std::max<int64_t>(mem, 0);
    big = static_cast<N>((m >= kCap / 4 || tot >= kCap / 4 - m) ? kCap : 4 * (tot + m) + 4);
    tol = std::is_integral_v<N> ? N(0) : static_cast<N>(1e-12 * std::max<double>(1.0, double(m)));
    ubF.assign(L + 2, 0.0);
    ubB.assign(L + 2, 0.0);
    for (int j = L - 1; j >= 0; --j) {
      ubF[j] = ubF[j + 1] + c.fw[j + 1];
      ubB[j] = ubB[j + 1] + c.bw[j + 1];
    }
    act_suffix.assign(L + 3, 0);
    for (int k = L + 1; k >= 0; --k) act_suffix[k] = act_suffix[k + 1] + c.act[k];
  }

  N excess(N v) const { return v > tol ? v : N(0); }  // max(0, v), float noise dropped
  N snap(N v) const { return v > tol || v < -tol ? v : N(0); }

  // One step of Algorithm 1 (eqs. 1-8) at stage i.  Returns false if infeasible.
  bool step(int i, const S& s, bool off, S& nx, double& eps) const {
    const N dfp = std::max<N>(s.df, 0), dbp = std::max<N>(s.db, 0);
    const N fneed = static_cast<N>(c.act[i + 1] + c.fw_tmp[i]);
    if (s.mf - dfp + fneed > M + tol) return false;
    const N mb = static_cast<N>(c.grad[i]) + dbp + s.mf - dfp;  // memory just before B_{i-1}
    const N bneed = static_cast<N>(c.act[i + 1] + c.grad[i + 1] + c.bw_tmp[i]);
    if (mb - dbp + bneed > M + tol) return false;
    if (off && (beta <= 0 || c.act[i] <= 0)) return false;
    const N exF = excess(s.mf + fneed - M);  // eq. (1) times beta
    const N exB = excess(mb + bneed - M);    // eq. (6) times beta
    eps = wait(exF, beta) + wait(exB, beta);
    const N DF = std::min(big, exF + moved(c.fw[i], beta, big));
    const N DB = std::min(big, exB + moved(c.bw[i], beta, big));
    const N act = static_cast<N>(c.act[i]), next = static_cast<N>(c.act[i + 1]);
    if (off) {  // eqs. (2), (3), (7)
      const N q = dfp + act;
      nx.df = snap(std::max(q - DF, -M));
      nx.mf = s.mf + next - std::min(q, DF);
      nx.db = snap(act + std::max<N>(0, s.db - DB));
    } else {  // eqs. (4), (5), (8)
      nx.df = snap(std::max(s.df - DF, -M));
      nx.mf = s.mf + next - std::min(dfp, DF);
      nx.db = snap(std::max(s.db - DB, -M));
    }
    return true;
  }

  // eps_G, the idle time between F_L and B_L (eqs. 9, 10); +inf if infeasible.
  double junction(const S& s) const {
    const int L = c.L;
    if (s.df <= 0 && s.db <= 0) return 0.0;
    if (s.df > 0 && s.db > 0) return wait(s.df + s.db, beta);
    if (std::isinf(beta)) return 0.0;
    double e = 0;
    if (s.df > 0) {  // offloads run on into the backward phase, eq. (9)
      const double avB = -static_cast<double>(s.db) / beta;
      e = std::max(e, s.df / beta - avB);
      for (int j = L; j >= 0 && ubB[j] < avB; --j) {
        const N R = static_cast<N>(c.bw_tmp[j] + c.grad[j] + c.grad[j + 1] - act_suffix[j + 2]);
        if (R + s.mf - s.df > M + tol) return kInf;
        e = std::max(e, static_cast<double>(R + s.mf - M) / beta - ubB[j]);
      }
    } else {  // prefetches start during the forward phase, eq. (10)
      const double avF = -static_cast<double>(s.df) / beta;
      e = std::max(e, s.db / beta - avF);
      for (int j = L; j >= 0 && ubF[j] < avF; --j) {
        const N R = static_cast<N>(c.fw_tmp[j] - act_suffix[j + 2]);
        e = std::max(e, static_cast<double>(R + s.mf + s.db - M) / beta - ubF[j]);
      }
    }
    return e;
  }
};

template <class N>
struct Entry {
  double idle;
  int32_t parent;  // index in the previous layer's entries
  uint8_t off;
  State<N> st;
};

template <class N>
Result solve_on(const Chain& c, int64_t memory, double beta) {
  Result res;
  const int L = c.L;
  Model<N> m(c, memory, beta);
  std::vector<std::vector<Entry<N>>> layers(L + 2);
  State<N> s0{static_cast<N>(c.act[0]), 0, 0};
  if (s0.mf > memory) return res;
  layers[0].push_back({0.0, -1, 0, s0});
  for (int i = 0; i <= L; ++i) {
    std::unordered_map<State<N>, int32_t, StateHash<N>> index;
    index.reserve(layers[i].size() * 2 + 4);
    auto& next = layers[i + 1];
    for (int32_t k = 0; k < static_cast<int32_t>(layers[i].size()); ++k) {
      const Entry<N> e = layers[i][k];
      for (int off = 0; off <= 1; ++off) {
        if (off && i > L) continue;
        State<N> nx;
        double eps;
        if (!m.step(i, e.st, off != 0, nx, eps)) continue;
        const double idle = e.idle + eps;
        auto it = index.find(nx);
        if (it == index.end()) {
          index.emplace(nx, static_cast<int32_t>(next.size()));
          next.push_back({idle, k, static_cast<uint8_t>(off), nx});
        } else if (idle < next[it->second].idle) {
          next[it->second] = {idle, k, static_cast<uint8_t>(off), nx};
        }
      }
    }
    res.states += next.size();
    if (next.empty()) return res;
  }
  double best = kInf;
  int32_t arg = -1;
  for (int32_t k = 0; k < static_cast<int32_t>(layers[L + 1].size()); ++k) {
    const Entry<N>& e = layers[L + 1][k];
    const double v = e.idle + m.junction(e.st);
    if (v < best) best = v, arg = k;
  }
  if (arg < 0) return res;
  res.feasible = true;
  res.idle = best;
  res.offload.assign(L + 1, 0);
  for (int i = L + 1; i >= 1; --i) {
    const Entry<N>& e = layers[i][arg];
    res.offload[i - 1] = e.off;
    arg = e.parent;
  }
  return res;
}

template <class N>
Result evaluate_on(const Chain& c, int64_t memory, double beta, const std::vector<uint8_t>& offload) {
  Result res;
  Model<N> m(c, memory, beta);
  State<N> s{static_cast<N>(c.act[0]), 0, 0};
  if (s.mf > memory || static_cast<int>(offload.size()) != c.L + 1) return res;
  double idle = 0;
  for (int i = 0; i <= c.L; ++i) {
    State<N> nx;
    double eps;
    if (!m.step(i, s, offload[i] != 0, nx, eps)) return res;
    idle += eps;
    s = nx;
  }
  const double g = m.junction(s);
  if (std::isinf(g)) return res;
  res.feasible = true;
  res.idle = idle + g;
  res.offload = offload;
  res.states = static_cast<size_t>(c.L + 1);
  return res;
}

}  // namespace

Result solve(const Chain& c, int64_t memory, double beta, bool exact) {
  return exact ? solve_on<double>(c, memory, beta) : solve_on<int64_t>(c, memory, beta);
}

Result evaluate(const Chain& c, int64_t memory, double beta, const std::vector<uint8_t>& offload,
                bool exact) {
  return exact ? evaluate_on<double>(c, memory, beta, offload)
               : evaluate_on<int64_t>(c, memory, beta, offload);
}

}  // namespace offload
}  // namespace vmalloc
