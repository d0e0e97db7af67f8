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
// Discretisation: data moved during a time t is t * beta units rounded to the nearest (floor
// would lose up to a unit per stage and pile up over long chains: seed 000 section 6.2), except
// that an idle eps = excess / beta moves exactly `excess` units.
#include "dp/offload_dp.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

namespace vmalloc {
namespace offload {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct State {
  int64_t mf, df, db;
  bool operator==(const State& o) const { return mf == o.mf && df == o.df && db == o.db; }
};
struct StateHash {
  size_t operator()(const State& s) const {
    uint64_t h = static_cast<uint64_t>(s.mf) * 0x9E3779B97F4A7C15ull;
    h ^= static_cast<uint64_t>(s.df) + 0x632BE59BD9B4E019ull + (h << 6) + (h >> 2);
    h ^= static_cast<uint64_t>(s.db) * 0xC2B2AE3D27D4EB4Full + (h << 6) + (h >> 2);
    return static_cast<size_t>(h);
  }
};

// Units of data moved in `t` seconds (never more than `cap`: with beta = inf, everything).
int64_t moved(double t, double beta, int64_t cap) {
  if (beta <= 0 || t <= 0) return 0;
  double v = t * beta;
  if (!std::isfinite(v) || v >= static_cast<double>(cap)) return cap;
  return static_cast<int64_t>(std::floor(v + 0.5));  // nearest: unbiased over many steps
}

double wait(int64_t excess, double beta) {
  if (excess <= 0) return 0;
  return std::isinf(beta) ? 0.0 : excess / beta;
}

struct Model {
  const Chain& c;
  int64_t M;
  double beta;
  int64_t big;  // "everything" for moved(): more than any Delta can be
  std::vector<double> ubF, ubB;  // suffix sums U_j^F, U_j^B
  std::vector<int64_t> act_suffix;  // sum_{k >= j} act[k]

  Model(const Chain& ch, int64_t mem, double b) : c(ch), M(mem), beta(b) {
    const int L = c.L;
    // "everything": 4 (sum of act + M) + 4, saturated. Exact units (slots=None) allow a
    // budget of up to 2^62 bytes, where the plain product overflowed int64 (UB; in practice
    // it wrapped negative, and moved() then returned a negative amount: a huge bogus idle).
    // Saturating at kCap keeps every sum below (exF + big, q - DF, ...) in range.
    constexpr int64_t kCap = std::numeric_limits<int64_t>::max() / 8;
    int64_t tot = 0;
    for (auto a : c.act) tot = a >= kCap - tot ? kCap : tot + std::max<int64_t>(a, 0);
    const int64_t m = std::max<int64_t>(M, 0);
    big = (m >= kCap / 4 || tot >= kCap / 4 - m) ? kCap : 4 * (tot + m) + 4;
    ubF.assign(L + 2, 0.0);
    ubB.assign(L + 2, 0.0);
    for (int j = L - 1; j >= 0; --j) {
      ubF[j] = ubF[j + 1] + c.fw[j + 1];
      ubB[j] = ubB[j + 1] + c.bw[j + 1];
    }
    act_suffix.assign(L + 3, 0);
    for (int k = L + 1; k >= 0; --k) act_suffix[k] = act_suffix[k + 1] + c.act[k];
  }

  // One step of Algorithm 1 (eqs. 1-8) at stage i.  Returns false if infeasible.
  bool step(int i, const State& s, bool off, State& nx, double& eps) const {
    const int64_t dfp = std::max<int64_t>(s.df, 0), dbp = std::max<int64_t>(s.db, 0);
    const int64_t fneed = c.act[i + 1] + c.fw_tmp[i];
    if (s.mf - dfp + fneed > M) return false;
    const int64_t mb = c.grad[i] + dbp + s.mf - dfp;  // memory just before B_{i-1}
    const int64_t bneed = c.act[i + 1] + c.grad[i + 1] + c.bw_tmp[i];
    if (mb - dbp + bneed > M) return false;
    if (off && (beta <= 0 || c.act[i] <= 0)) return false;
    const int64_t exF = std::max<int64_t>(0, s.mf + fneed - M);  // eq. (1) times beta
    const int64_t exB = std::max<int64_t>(0, mb + bneed - M);    // eq. (6) times beta
    eps = wait(exF, beta) + wait(exB, beta);
    const int64_t DF = std::min(big, exF + moved(c.fw[i], beta, big));
    const int64_t DB = std::min(big, exB + moved(c.bw[i], beta, big));
    if (off) {  // eqs. (2), (3), (7)
      const int64_t q = dfp + c.act[i];
      nx.df = std::max(q - DF, -M);
      nx.mf = s.mf + c.act[i + 1] - std::min(q, DF);
      nx.db = c.act[i] + std::max<int64_t>(0, s.db - DB);
    } else {  // eqs. (4), (5), (8)
      nx.df = std::max(s.df - DF, -M);
      nx.mf = s.mf + c.act[i + 1] - std::min(dfp, DF);
      nx.db = std::max(s.db - DB, -M);
    }
    return true;
  }

  // eps_G, the idle time between F_L and B_L (eqs. 9, 10); +inf if infeasible.
  double junction(const State& s) const {
    const int L = c.L;
    if (s.df <= 0 && s.db <= 0) return 0.0;
    if (s.df > 0 && s.db > 0) return wait(s.df + s.db, beta);
    if (std::isinf(beta)) return 0.0;
    double e = 0;
    if (s.df > 0) {  // offloads run on into the backward phase, eq. (9)
      const double avB = -static_cast<double>(s.db) / beta;
      e = std::max(e, s.df / beta - avB);
      for (int j = L; j >= 0 && ubB[j] < avB; --j) {
        const int64_t R = c.bw_tmp[j] + c.grad[j] + c.grad[j + 1] - act_suffix[j + 2];
        if (R + s.mf - s.df > M) return kInf;
        e = std::max(e, static_cast<double>(R + s.mf - M) / beta - ubB[j]);
      }
    } else {  // prefetches start during the forward phase, eq. (10)
      const double avF = -static_cast<double>(s.df) / beta;
      e = std::max(e, s.db / beta - avF);
      for (int j = L; j >= 0 && ubF[j] < avF; --j) {
        const int64_t R = c.fw_tmp[j] - act_suffix[j + 2];
        e = std::max(e, static_cast<double>(R + s.mf + s.db - M) / beta - ubF[j]);
      }
    }
    return e;
  }
};

struct Entry {
  double idle;
  int32_t parent;  // index in the previous layer's entries
  uint8_t off;
  State st;
};

}  // namespace

Result solve(const Chain& c, int64_t memory, double beta) {
  Result res;
  const int L = c.L;
  Model m(c, memory, beta);
  std::vector<std::vector<Entry>> layers(L + 2);
  State s0{c.act[0], 0, 0};
  if (s0.mf > memory) return res;
  layers[0].push_back({0.0, -1, 0, s0});
  for (int i = 0; i <= L; ++i) {
    std::unordered_map<State, int32_t, StateHash> index;
    index.reserve(layers[i].size() * 2 + 4);
    auto& next = layers[i + 1];
    for (int32_t k = 0; k < static_cast<int32_t>(layers[i].size()); ++k) {
      const Entry e = layers[i][k];
      for (int off = 0; off <= 1; ++off) {
        if (off && i > L) continue;
        State nx;
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
    const Entry& e = layers[L + 1][k];
    const double v = e.idle + m.junction(e.st);
    if (v < best) best = v, arg = k;
  }
  if (arg < 0) return res;
  res.feasible = true;
  res.idle = best;
  res.offload.assign(L + 1, 0);
  for (int i = L + 1; i >= 1; --i) {
    const Entry& e = layers[i][arg];
    res.offload[i - 1] = e.off;
    arg = e.parent;
  }
  return res;
}

Result evaluate(const Chain& c, int64_t memory, double beta, const std::vector<uint8_t>& offload) {
  Result res;
  Model m(c, memory, beta);
  State s{c.act[0], 0, 0};
  if (s.mf > memory || static_cast<int>(offload.size()) != c.L + 1) return res;
  double idle = 0;
  for (int i = 0; i <= c.L; ++i) {
    State nx;
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

}  // namespace offload
}  // namespace vmalloc
