// Optimal persistent checkpointing (seed 002, Theorem 1 and Algorithms 1-2), in DESIGN.md's
// indexing (stages 0..L, L = loss; the paper's stage l is our l-1, its a^{l-1} our x[l-1]).
//
// C(s, t, m): least time to run stages s..t forward and backward, given that the input of
// stage s is stored (and NOT counted in m) and delta[t+1] is stored (counted in m), within
// memory m. Memory follows scheduler/simulate.py exactly (the reference): memory during an
// op = everything stored + the op's outputs + its tmp. Two ways to start (Theorem 1):
//   all:  F_all s, then C(s+1, t, m - xbar[s]), then B s
//   ck:   F_ck s, F_none s+1 .. s'-1 (s < s' <= t), then C(s', t, m - x[s']), then C(s, s'-1, m)
// The conditions are reconstructed from the simulator's rules rather than copied from the
// converted text, which is garbled in three places:
//  * m_all must also count delta[s] (B s holds its input delta[s+1] AND its output delta[s]
//    plus bw_tmp), and F_all s holds delta[t+1] + xbar[s] + fw_tmp[s] (F_ck / F_none hold
//    fck_tmp instead: a forward that keeps nothing has its own transient, Chain.fck_tmp);
//  * m_none is taken per s' (only the F_none ops actually run, s+1..s'-1, plus F_ck s),
//    not over all of s..t: the paper's bound over-restricts, and the exhaustive oracle in
//    tests/ scores the finer one as optimal;
//  * Algorithm 2 lists F_none up to s'; the forwards are s..s'-1 (its C_ck sums u_f^s..u_f^{s'-1}).
// Speed (seed 002 reports < 20 s for L = 339 at 500 slots; we aim at < 2 s; a new input
// shape at L = 48 in well under 1 ms): for each (s, t) only the memory range [lo, hi) can
// need the table, where lo is the least feasible memory and hi the peak of the schedule that
// is optimal with unlimited memory (above it C is constant); of that, only the cells the
// answer at the budget can read are tabulated (reach(): one in five at L = 48 and half the
// store-all peak, 16x faster there than the whole range); the inner loop over m is a
// branch-free min-plus sweep (AVX2 clone), and a candidate is only swept where it can still
// win (see relax_pruned).
#include "dp/rotor.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace vmalloc {
namespace dp {
namespace {

// Table values: double in exact units (slots=None: exact optimality on integer chains),
// float with slots (half the memory traffic, which is what the DP's time is; float's 2^-24
// relative precision only matters for near-ties). The reported time is summed in double
// over the plan's ops in the simulator's order either way.
constexpr int64_t kBig = std::numeric_limits<int64_t>::max() / 4;
constexpr size_t kMaxCells = size_t(1) << 28;   // refuse tables beyond 2^28 cells

// The simulator's memory rules inside a sub-chain s..t (the input of s counted outside).
template <class V, class Vec>
struct Rules {
  const Vec &x, &xbar, &delta, &fwt, &bwt, &ckt;
  V m_all(int s, int t) const {        // F_all s (with delta[t+1] stored) and B s
    return std::max<V>(delta[t + 1] + xbar[s] + fwt[s], xbar[s] + delta[s + 1] + delta[s] + bwt[s]);
  }
  V f_ck(int s, int t) const { return delta[t + 1] + x[s + 1] + ckt[s]; }            // F_ck s
  V f_none(int j, int t) const { return delta[t + 1] + x[j] + x[j + 1] + ckt[j]; }   // F_none j
};

// out[i] = min(out[i], (c + A[i]) + B[i]) over ranges of m: the whole cost of the DP. Cloned
// for AVX2 where the CPU has it (runtime dispatch, so the module still runs on any x86-64).
// These two serve the all-case (one sub-chain, then its constant part).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VMALLOC_CLONES __attribute__((target_clones("avx2", "default"), optimize("O3")))
#else
#define VMALLOC_CLONES
#endif
#define VMALLOC_RELAX(Val)                                                                     \
  VMALLOC_CLONES void relax_ac(Val* __restrict out, int64_t n, Val c, const Val* __restrict a,  \
                               Val cb) {                                                       \
    for (int64_t i = 0; i < n; ++i) { Val v = (c + a[i]) + cb; out[i] = v < out[i] ? v : out[i]; } \
  }                                                                                            \
  VMALLOC_CLONES void relax_cc(Val* __restrict out, int64_t n, Val v) {                         \
    for (int64_t i = 0; i < n; ++i) out[i] = v < out[i] ? v : out[i];                          \
  }
VMALLOC_RELAX(float)
VMALLOC_RELAX(double)
#undef VMALLOC_RELAX

// The same sweeps for a pruned candidate: they stop after the first block in which the
// running minimum is already <= lb (the candidate's least value; out[] is non-increasing, so
// nothing past it can improve) and say so. Blocks of 32 bytes (GCC/Clang vector extensions:
// one AVX2 operation in the avx2 clone, two SSE ones otherwise), the stop checked once per
// block; sweeping a block past the stop point changes nothing (min is idempotent).
#if defined(__GNUC__)
#define VMALLOC_BLOCK(Val, expr)                                                         \
  {                                                                                            \
    typedef Val V __attribute__((vector_size(32)));                                            \
    constexpr int64_t W = 32 / sizeof(Val);                                                    \
    for (; i + W <= n; i += W) {                                                               \
      bool stop = !(out[i + W - 1] > lb);                                                      \
      V va, vb, o;                                                                             \
      __builtin_memcpy(&va, a + i, sizeof va);                                                 \
      __builtin_memcpy(&vb, b + i, sizeof vb);                                                 \
      __builtin_memcpy(&o, out + i, sizeof o);                                                 \
      V v = expr;                                                                              \
      o = v < o ? v : o;                                                                       \
      __builtin_memcpy(out + i, &o, sizeof o);                                                 \
      if (stop) return true;                                                                   \
    }                                                                                          \
  }
#else
#define VMALLOC_BLOCK(Val, expr)
#endif
// a, b: the two tabulated sub-chains (a constant one is passed as its own value, unused)
#define VMALLOC_RELAX_UNTIL(Val, name, expr, sexpr)                                             \
  VMALLOC_CLONES bool name(Val* __restrict out, int64_t n, Val c, const Val* __restrict a,     \
                           const Val* __restrict b, Val cb, Val lb) {                          \
    (void)a, (void)b, (void)cb;                                                                \
    int64_t i = 0;                                                                             \
    VMALLOC_BLOCK(Val, expr)                                                             \
    for (; i < n; ++i) {                                                                       \
      if (!(out[i] > lb)) return true;                                                         \
      Val v = sexpr;                                                                           \
      out[i] = v < out[i] ? v : out[i];                                                        \
    }                                                                                          \
    return false;                                                                              \
  }
#define VMALLOC_RELAX_UNTIL_ALL(Val)                                                            \
  VMALLOC_RELAX_UNTIL(Val, until_aa, (c + va) + vb, (c + a[i]) + b[i])                         \
  VMALLOC_RELAX_UNTIL(Val, until_ac, (c + va) + cb, (c + a[i]) + cb)                           \
  VMALLOC_RELAX_UNTIL(Val, until_ca, c + vb, c + b[i])
VMALLOC_RELAX_UNTIL_ALL(float)
VMALLOC_RELAX_UNTIL_ALL(double)
#undef VMALLOC_RELAX_UNTIL_ALL
#undef VMALLOC_RELAX_UNTIL
#undef VMALLOC_BLOCK

// The least memory the checkpoint candidates s' = s+1..t of C(s, t) need (bounds()): the
// least over i of max(d + pm[i], x[i] + lc[i], lr[i]) (the forwards' peak, C(s', t) after
// x[s'], C(s, s'-1)), starting from best.
VMALLOC_CLONES int64_t least_peak(int64_t n, int64_t d, const int64_t* __restrict pm,
                                  const int64_t* __restrict x, const int64_t* __restrict lc,
                                  const int64_t* __restrict lr, int64_t best) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = std::max(std::max(d + pm[i], x[i] + lc[i]), lr[i]);
    best = v < best ? v : best;
  }
  return best;
}

template <class Val>
class Solver {
  static constexpr Val kInf = std::numeric_limits<Val>::infinity();

 public:
  Solver(const std::vector<double>& fw, const std::vector<double>& bw, const RotorSizes& u,
         bool allow_all)
      : L_(int(fw.size()) - 1), n_(L_ + 1), fw_(fw), bw_(bw), u_(u), all_(allow_all),
        R_{u.x, u.xbar, u.delta, u.fw_tmp, u.bw_tmp, u.fck_tmp} {
    pf_.assign(n_ + 1, 0.0);
    for (int s = 0; s < n_; ++s) pf_[s + 1] = pf_[s] + fw_[s];
    bounds();
  }

  int L() const { return L_; }
  int64_t min_units() const { return u_.x[0] + lo(0, L_); }

  // The cells the answer can read; returns their count. C(0, L) is read at m in
  // [m_lo, m_max] only (the budget, and the refinement's limits above it), and each cell
  // reads its candidates' sub-chains at the m its formula names (fill_pair; rebuild reads no
  // others), so going from every sub-chain to the shorter ones it reads, the hull
  // [base, row) of the m each is read at is collected, clipped to [lo, hi) (below lo nothing
  // is feasible and from hi on C is cinf: neither needs the table). Most cells are never
  // read (at 48 stages and 500 slots, four in five), and only these are tabulated.
  // whole: every cell below m_max + 1 instead (tests check that reach() changes nothing).
  size_t reach(int64_t m_lo, int64_t m_max, bool whole = false) {
    if (whole) {
      size_t total = 0;
      for (Pair& p : P_) {
        p.base = p.lo, p.row = std::max(p.lo, std::min(p.hi, m_max + 1));
        total += size_t(p.row - p.base);
      }
      return total;
    }
    for (Pair& p : P_) p.base = kBig, p.row = -kBig;
    auto put = [&](Pair& p, int64_t a, int64_t b) {  // p is read at [a, b)
      a = std::max(a, p.lo), b = std::min(b, p.hi);
      if (a < b) p.base = std::min(p.base, a), p.row = std::max(p.row, b);
    };
    put(P_[idx(0, L_)], m_lo, m_max + 1);
    size_t total = 0;
    // row by row, each from the right: (s, t) is read by (s', t) for s' < s and by (s, t')
    // for t' > t, all visited before it
    for (int s = 0; s < L_; ++s)
      for (int t = L_; t > s; --t) {
        Pair& p = P_[idx(s, t)];
        if (p.base >= p.row) { p.base = p.row = p.lo; continue; }
        total += size_t(p.row - p.base);
        const int64_t a = p.base, b = p.row;
        if (all_) {
          int64_t from = std::max({a, R_.m_all(s, t), u_.xbar[s] + lo(s + 1, t)});
          put(P_[idx(s + 1, t)], from - u_.xbar[s], b - u_.xbar[s]);
        }
        int64_t mn = R_.f_ck(s, t);
        for (int sp = s + 1; sp <= t; ++sp) {  // the candidates of fill_pair and rebuild
          if (sp > s + 1) mn = std::max(mn, R_.f_none(sp - 1, t));
          if (mn >= b) break;
          Pair &first = P_[idx(sp, t)], &second = P_[idx(s, sp - 1)];
          int64_t from = std::max({a, mn, u_.x[sp] + first.lo, second.lo});
          if (from >= b) continue;
          put(first, from - u_.x[sp], b - u_.x[sp]);
          put(second, from, b);
        }
      }
    return total;
  }

  // Algorithm 1 on the cells reach() collected (x[0] excluded from m): ``total`` of them.
  void fill(size_t total) {
    if (total > kMaxCells)
      throw std::invalid_argument(
          "rotor: the DP table would need more than 2^28 cells; use fewer memory slots");
    tab_.assign(total, kInf);
    size_t off = 0;
    // column-major (t, then s downwards), the order fill_pair runs in: C(s, t) reads
    // C(s', t) for s' > s (this column, still in cache) and C(s, t') for t' < t
    for (int t = 1; t < n_; ++t)
      for (int s = t - 1; s >= 0; --s) {
        Pair& p = P_[idx(s, t)];
        const int64_t m0 = p.base, m1 = p.row;
        p.row = int64_t(off) - m0;  // from here on: C(s, t, m) is tab_[row + m]
        if (m0 < m1) fill_pair(s, t, m0, m1, &tab_[off]);
        off += size_t(m1 - m0);
      }
  }

  // C(s, t, m) for any m that reach() collected (below lo: infinity; at or above hi: the
  // unlimited-memory time).
  Val value(int s, int t, int64_t m) const {
    const Pair& p = P_[idx(s, t)];
    if (m < p.lo) return kInf;
    if (m >= p.hi) return p.cinf;
    return tab_[size_t(p.row + m)];
  }

  // Algorithm 2: append the ops of C(s, t, m), add their time to *time (in plan order, as
  // the simulator sums it) and return their exact peak (the input of s excluded).
  double rebuild(int s, int t, int64_t m, const Rules<double, std::vector<double>>& E,
                 std::vector<std::pair<int, int>>& ops, double* time) const {
    if (s == t) {
      ops.emplace_back(kFAll, s);
      *time += fw_[s];
      ops.emplace_back(kB, s);
      *time += bw_[s];
      return E.m_all(s, s);
    }
    int choice = -1;  // -1: the all-case, else s'
    if (m >= hi(s, t)) {
      choice = all_ ? -1 : s + 1;  // the unlimited-memory schedule
    } else {
      // the same candidates, computed with the same expressions, as fill_pair
      Val best = kInf;
      if (all_ && m >= R_.m_all(s, t)) best = (Val(fw_[s] + bw_[s]) + value(s + 1, t, m - u_.xbar[s])) + Val(0);
      int64_t mn = R_.f_ck(s, t);
      for (int sp = s + 1; sp <= t; ++sp) {
        if (sp > s + 1) mn = std::max(mn, R_.f_none(sp - 1, t));
        if (m < mn) break;  // mn only grows with s'
        // a sub-chain below its least feasible m: reach() tabulated neither half's cell
        if (m < u_.x[sp] + lo(sp, t) || m < lo(s, sp - 1)) continue;
        Val v = (Val(pf_[sp] - pf_[s]) + value(sp, t, m - u_.x[sp])) + value(s, sp - 1, m);
        if (v < best) { best = v; choice = sp; }
      }
      if (!(best < kInf)) throw std::logic_error("rotor: rebuilding an infeasible state");
    }
    if (choice < 0) {
      ops.emplace_back(kFAll, s);
      *time += fw_[s];
      double p = rebuild(s + 1, t, m - u_.xbar[s], E, ops, time);
      ops.emplace_back(kB, s);
      *time += bw_[s];
      return std::max(E.m_all(s, t), E.xbar[s] + p);
    }
    int sp = choice;
    double mn = E.f_ck(s, t);
    ops.emplace_back(kFCk, s);
    *time += fw_[s];
    for (int j = s + 1; j < sp; ++j) {
      ops.emplace_back(kFNone, j);
      *time += fw_[j];
      mn = std::max(mn, E.f_none(j, t));
    }
    double p1 = rebuild(sp, t, m - u_.x[sp], E, ops, time);
    double p2 = rebuild(s, sp - 1, m, E, ops, time);
    return std::max({mn, E.x[sp] + p1, p2});
  }

 private:
  size_t idx(int s, int t) const { return size_t(s) * n_ + t; }
  int64_t lo(int s, int t) const { return P_[idx(s, t)].lo; }
  int64_t hi(int s, int t) const { return P_[idx(s, t)].hi; }

  // lo: least feasible m; hi, cinf: peak and time of the schedule that is optimal with
  // unlimited memory (rotor: F_all everything; revolve: F_ck everything, F_all at each B).
  void bounds() {
    P_.assign(size_t(n_) * n_, Pair{kBig, kBig, 0, 0, kInf});
    // lo by row and by column, so that the O(L^3) loop (least_peak) reads both sub-chains
    // of the candidates contiguously; pm[s']: the peak of the forwards a candidate s' runs
    // before its sub-chains (F_ck s, F_none s+1..s'-1), less delta[t+1]
    std::vector<int64_t> row(size_t(n_) * n_, kBig), col(size_t(n_) * n_, kBig), pm(n_ + 1);
    for (int s = L_; s >= 0; --s) {  // (s', t) for s' > s and (s, t') for t' < t come first
      if (s < L_) {
        pm[s + 1] = u_.x[s + 1] + u_.fck_tmp[s];
        for (int sp = s + 2; sp <= L_; ++sp)
          pm[sp] = std::max(pm[sp - 1], u_.x[sp - 1] + u_.x[sp] + u_.fck_tmp[sp - 1]);
      }
      for (int t = s; t <= L_; ++t) {
        Pair& p = P_[idx(s, t)];
        if (t == s) {
          p.lo = p.hi = R_.m_all(s, s);
          p.cinf = Val(fw_[s]) + Val(bw_[s]);
        } else {
          int64_t best = kBig;
          if (all_) best = std::max(R_.m_all(s, t), u_.xbar[s] + lo(s + 1, t));
          p.lo = least_peak(t - s, u_.delta[t + 1], &pm[s + 1], &u_.x[s + 1],
                            &col[size_t(t) * n_ + s + 1], &row[size_t(s) * n_ + s], best);
          if (all_) {
            p.hi = std::max(R_.m_all(s, t), u_.xbar[s] + hi(s + 1, t));
            p.cinf = (Val(fw_[s] + bw_[s]) + P_[idx(s + 1, t)].cinf) + Val(0);
          } else {
            p.hi = std::max({R_.f_ck(s, t), u_.x[s + 1] + hi(s + 1, t), hi(s, s)});
            p.cinf = (Val(pf_[s + 1] - pf_[s]) + P_[idx(s + 1, t)].cinf) + P_[idx(s, s)].cinf;
          }
          p.hi = std::max(p.hi, p.lo);
        }
        row[size_t(s) * n_ + t] = col[size_t(t) * n_ + s] = p.lo;
      }
    }
  }

  // out[m] = min(out[m], c + C(a)(m - k)) for m in [m0, m1): the all-case (one sub-chain
  // sa..ta), tabulated below its hi and constant above.
  void relax_all(Val* out, int64_t m0, int64_t m1, Val c, int sa, int ta, int64_t k) {
    if (m0 >= m1) return;
    const size_t ia = idx(sa, ta);
    const Pair& A = P_[ia];
    const int64_t e = std::clamp(A.hi + k, m0, m1);
    if (m0 < e) relax_ac(out, e - m0, c, &tab_[size_t(A.row + m0 - k)], Val(0));
    if (e < m1) relax_cc(out + (e - m0), m1 - e, c + A.cinf);
  }

  // out[m] = min(out[m], (c + C(a)(m - k)) + C(b)(m)) for m in [a, b), C(a) = sa..ta and
  // C(b) = sb..tb. Every candidate is non-increasing in m, and so is the running minimum
  // out[]. On [a, b) a candidate is never below its value at b - 1 (lb), so it can only
  // improve out[m] where out[m] > lb: none of [a, b) if out[a] <= lb, else a prefix, which
  // the sweeps find as they go (a separate search for its end cost more than the sweep).
  // Each sub-chain is tabulated below its hi and constant above, so [a, b) splits in at
  // most three pieces.
  void relax_pruned(Val* out, int64_t m0, int64_t a, int64_t b, Val c, int sa, int ta,
                    int64_t k, int sb, int tb) {
    if (a >= b) return;
    Val lb = (c + value(sa, ta, b - 1 - k)) + value(sb, tb, b - 1);
    if (lb >= out[a - m0]) return;
    const size_t ia = idx(sa, ta), ib = idx(sb, tb);
    const Pair &A = P_[ia], &B = P_[ib];
    const int64_t ha = A.hi + k, hb = B.hi;
    const Val ca = A.cinf, cb = B.cinf;
    const int64_t e1 = std::clamp(std::min(ha, hb), a, b), e2 = std::clamp(std::max(ha, hb), a, b);
    auto pa = [&](int64_t m) { return &tab_[size_t(A.row + m - k)]; };
    auto pb = [&](int64_t m) { return &tab_[size_t(B.row + m)]; };
    if (a < e1 && until_aa(out + (a - m0), e1 - a, c, pa(a), pb(a), cb, lb)) return;
    if (e1 < e2) {
      bool done = ha > hb ? until_ac(out + (e1 - m0), e2 - e1, c, pa(e1), pa(e1), cb, lb)
                          : until_ca(out + (e1 - m0), e2 - e1, c + ca, pb(e1), pb(e1), cb, lb);
      if (done) return;
    }
    // both constant: the candidate is lb itself
    for (Val* o = out + (e2 - m0), *end = out + (b - m0); o < end && *o > lb; ++o) *o = lb;
  }

  // C(s, t, m) for m in [m0, m1) into out[0, m1 - m0) (all infinity yet)
  void fill_pair(int s, int t, int64_t m0, int64_t m1, Val* out) {
    if (all_) {  // F_all s, C(s+1, t, m - xbar[s]), B s
      Val c = Val(fw_[s] + bw_[s]);
      int64_t from = std::max({m0, R_.m_all(s, t), u_.xbar[s] + lo(s + 1, t)});
      if (from < m1) relax_all(out + (from - m0), from, m1, c, s + 1, t, u_.xbar[s]);  // out[] is all inf yet
    }
    int64_t mn = R_.f_ck(s, t);
    for (int sp = s + 1; sp <= t; ++sp) {  // F_ck s, F_none s+1..s'-1, C(s', t), C(s, s'-1)
      if (sp > s + 1) mn = std::max(mn, R_.f_none(sp - 1, t));
      if (mn >= m1) break;  // the F_none peaks only grow with s'
      Val c = Val(pf_[sp] - pf_[s]);
      int64_t from = std::max({m0, mn, u_.x[sp] + lo(sp, t), lo(s, sp - 1)});
      relax_pruned(out, m0, from, m1, c, sp, t, u_.x[sp], s, sp - 1);
    }
  }

  int L_, n_;
  const std::vector<double>& fw_;
  const std::vector<double>& bw_;
  const RotorSizes& u_;
  bool all_;
  Rules<int64_t, std::vector<int64_t>> R_;
  std::vector<double> pf_;
  // per sub-chain (s, t), together (one cache line per lookup): the least feasible m, the
  // m from which C is constant (cinf), the first m tabulated (base) and, once fill() laid
  // the table out, where C(s, t, m) is: tab_[row + m] (in reach(): the end of the m read)
  struct Pair { int64_t lo, hi, base, row; Val cinf; };
  std::vector<Pair> P_;
  std::vector<Val> tab_;
};

void check(const std::vector<double>& fw, const std::vector<double>& bw, const RotorSizes& u) {
  size_t n = fw.size();
  if (n == 0) throw std::invalid_argument("rotor: empty chain");
  auto need = [&](size_t got, size_t want, const char* name) {
    if (got != want)
      throw std::invalid_argument(std::string("rotor: ") + name + " has " + std::to_string(got) +
                                  " entries, expected " + std::to_string(want));
  };
  need(bw.size(), n, "bw");
  need(u.x.size(), n + 1, "x (with x[L+1] = 0)");
  need(u.delta.size(), n + 1, "delta (with delta[L+1] = 0)");
  need(u.xbar.size(), n, "xbar");
  need(u.fw_tmp.size(), n, "fw_tmp");
  need(u.bw_tmp.size(), n, "bw_tmp");
  need(u.fck_tmp.size(), n, "fck_tmp");
}

int64_t min_units_impl(const RotorSizes& units, bool allow_all) {
  std::vector<double> zeros(units.xbar.size(), 0.0);
  check(zeros, zeros, units);
  return Solver<double>(zeros, zeros, units, allow_all).min_units();
}

// Refinement. Sizes are rounded UP to whole units, so every item in memory is overestimated
// by less than one unit and a plan whose exact peak fits the limit may need up to one unit
// per item held more than the budget in the rounded problem: the DP at the budget cannot see
// it. One table up to budget + extra (the caller's bound on that excess) answers every budget
// in between; C(0, L, .) is a step function and only where it drops can a faster plan appear,
// so the plan rebuilt at each drop is a candidate, scored by its exact peak. Short lists are
// scanned fastest first (the first plan that fits is the fastest). Long ones (up to ~L drops)
// try the fastest, then bisect for the last drop that fits, assuming the exact peak grows
// with the budget: a heuristic (on the bench chains it picks what the full scan picks, with
// ~8 rebuilds instead of ~300), but the best plan seen that fits is kept either way, never
// one slower than the budget's own.
// A budget below the rounded problem's minimum is refined too when that minimum is within
// the headroom (at the every-block plan's own peak, say, its rounded peak can be a few units
// above the budget): the drops then start at the minimum, no plan is known to fit, and the
// limit is refused only if none of those rebuilt fits.
constexpr size_t kScanSteps = 32;

struct Candidate {
  double time = 0, peak = 0;
  int64_t at = 0;
  std::vector<std::pair<int, int>> ops;
};

template <class Val>
RotorResult solve_with(const std::vector<double>& fw, const std::vector<double>& bw,
                       const RotorSizes& units, const RotorExact& exact, int64_t budget,
                       bool allow_all, int64_t extra, double exact_limit, bool whole_table) {
  Solver<Val> solver(fw, bw, units, allow_all);
  RotorResult r;
  r.min_units = solver.min_units();
  // below the rounded minimum only the refinement can find a plan, and only within reach
  const bool below = budget < r.min_units;
  if (below && (extra <= 0 || r.min_units - budget > extra)) return r;
  const int64_t m = budget - units.x[0];
  const int64_t first = below ? r.min_units - units.x[0] : m;  // the least budget with a plan
  int L = solver.L();
  size_t cells = solver.reach(first, m + extra, whole_table);
  if (extra > 0 && cells > kMaxCells) {  // too large: the budget's own table only
    if (below) return r;
    extra = 0, cells = solver.reach(m, m, whole_table);
  }
  solver.fill(cells);
  if (!(solver.value(0, L, first) < std::numeric_limits<Val>::infinity())) return r;  // cannot happen
  Rules<double, std::vector<double>> E{exact.x, exact.xbar, exact.delta, exact.fw_tmp, exact.bw_tmp,
                                     exact.fck_tmp};
  auto build = [&](int64_t at) {
    Candidate c;
    c.at = at;
    c.peak = exact.x[0] + solver.rebuild(0, L, at, E, c.ops, &c.time);
    return c;
  };
  // exact_limit: the caller's limit with the simulator's tolerance already added
  auto fits = [&](const Candidate& c) { return c.peak <= exact_limit; };
  Candidate best;
  bool found = !below;
  if (found) best = build(m);  // the rounded problem's optimum: fits by construction
  auto take = [&](Candidate& c) {
    if (!found || c.time < best.time || (c.time == best.time && c.peak < best.peak))
      best = std::move(c), found = true;
  };
  int tried = 0;
  std::vector<int64_t> steps{first};
  if (extra > 0) {
    Val prev = solver.value(0, L, first);
    for (int64_t a = first + 1; a <= m + extra; ++a) {
      Val v = solver.value(0, L, a);
      if (v < prev) steps.push_back(a), prev = v;
    }
    const size_t n = steps.size();
    if (n <= kScanSteps) {  // fastest first; steps[0]'s plan is best already unless below
      for (size_t j = n; j-- > (below ? 0 : 1);) {
        Candidate c = build(steps[j]);
        ++tried;
        if (fits(c)) { take(c); break; }
      }
    } else {  // the fastest first (it often fits when memory is ample), then bisect
      size_t lo = 0, hi = n - 1;  // the plan at steps[lo] fits, at steps[hi] not
      Candidate top = build(steps[hi]);
      ++tried;
      if (fits(top)) {
        take(top), lo = hi;
      } else if (below) {  // nothing fits yet: the lowest drop that does starts the bisection
        for (; lo < hi; ++lo) {
          Candidate c = build(steps[lo]);
          ++tried;
          if (fits(c)) { take(c); break; }
        }
      }
      while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        Candidate c = build(steps[mid]);
        ++tried;
        if (fits(c)) lo = mid, take(c);
        else hi = mid;
      }
    }
  }
  if (!found) return r;
  r.time = best.time;
  r.peak = best.peak;
  r.ops = std::move(best.ops);
  r.used_budget = best.at + units.x[0];
  r.tried = tried;
  r.steps = int(steps.size());
  r.feasible = true;
  return r;
}

}  // namespace

int64_t rotor_min_units(const RotorSizes& units, bool allow_all) {
  return min_units_impl(units, allow_all);
}

RotorResult rotor_solve(const std::vector<double>& fw, const std::vector<double>& bw,
                        const RotorSizes& units, const RotorExact& exact, int64_t budget,
                        bool allow_all, bool exact_values, int64_t extra, double exact_limit,
                        bool whole_table) {
  check(fw, bw, units);
  if (extra < 0) throw std::invalid_argument("rotor: extra must be >= 0, got " + std::to_string(extra));
  auto solve = exact_values ? solve_with<double> : solve_with<float>;
  return solve(fw, bw, units, exact, budget, allow_all, extra, exact_limit, whole_table);
}

}  // namespace dp
}  // namespace vmalloc
