// pofo: seed 001 Appendix B in our chain model (DESIGN.md).  Seed 001's layer l is our stage
// s = l - 1: a^{l-1} = x[s], abar^l = xbar[s], delta^l = delta[s+1], o^f / o^b = fw_tmp / bw_tmp.
//
//  OC(s, x, A, dF, dB)  (B.1): time from F_s to the end of B_s.  The input of stage s
//      (I = x[s] if x = 0, xbar[s-1] if x = 1) is stored; A = earlier stored values that stay
//      on the GPU; dF = earlier data still to offload when F_s may start; dB = earlier data
//      that must be prefetched by the time B_s ends (and so sits in memory at that point).
//  C(s, t, m, d)  (B.3): time of stages s..t in the backward phase (recompute from the
//      input of s, which is stored outside the budget m; delta[t+1] is inside it), while d
//      units of earlier data are prefetched as late as possible, ending with this sequence.
//
// Reconstructions and choices where the converted text is garbled or silent:
//  * B.1's validity test "M_{F_all}^{i,L} + I > M - A or M_{B_i}^{i,L} + I > M - A" is
//    written here as: the op's memory <= avail = M - A - I.
//  * Case 2 (F_ck) of B.1: the offloaded input cannot be released before F_ck s reads it
//    (k = s), later F_none may use its memory: op memory <= avail (+ I if offloaded).
//  * The sub-chain C ends holding delta[s] and the d prefetched units: we require
//    delta[s] + d <= m (Lemma 1 only looks at the ops; the end state must fit too).
//  * B.2: the loss's F_all/B may still overlap the last offload / first prefetch
//    (eps^F, eps^B as in Case 1), then eps^G = (dF_left + dB_left) / beta.
//  * Lemma 1 idle times are placed where the lemma puts them: at the start of an offloading
//    sequence, at the end of a prefetching one.
// Discretisation: data moved in t seconds = t * beta units rounded to the nearest; an idle eps that covers an
// excess of e units moves exactly e units.
#include "dp/pofo_dp.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace vmalloc {
namespace pofo {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Open-addressing hash table (uint64 key -> Memo): the DP's hot path is memo lookups, and
// std::unordered_map's node allocations cost several times more.
struct Memo {
  double v;     // the optimum if exact, else a lower bound (>= the budget it was asked with)
  int32_t ch;
  bool exact = true;
};

// Dense table for C(s, t, m, d), d <= m <= M, t >= s: one block of all (s, t) per (m, d),
// t fastest.  The ck loop of a state reads C(s, s..t, m, d), which sit next to each other,
// and C(sp+1, t, m - x[sp+1], d2), whose few (m, d) blocks stay in cache (with s outermost
// these reads were cache misses; 1.5x slower on DenseNet-201).  NaN = not computed.
class CTable {
 public:
  CTable(int L, int64_t M) : pairs_(static_cast<size_t>(L + 1) * (L + 2) / 2) {
    off_.assign(L + 2, 0);
    for (int s = 0; s <= L; ++s) off_[s + 1] = off_[s] + static_cast<size_t>(L + 1 - s);
    const size_t n = pairs_ * static_cast<size_t>((M + 1) * (M + 2) / 2);
    v_.assign(n, std::numeric_limits<double>::quiet_NaN());
    ch_.assign(n, 0);
  }
  static bool fits(int L, int64_t M) {
    return static_cast<double>(L + 1) * (L + 2) / 2 * (M + 1) * (M + 2) / 2 <= 4e7;
  }
  size_t index(int s, int t, int64_t m, int64_t d) const {
    return static_cast<size_t>(m * (m + 1) / 2 + d) * pairs_ + off_[s] + (t - s);
  }
  std::vector<double> v_;
  std::vector<int16_t> ch_;
  size_t size() const {
    size_t n = 0;
    for (double x : v_) n += !std::isnan(x);
    return n;
  }

 private:
  size_t pairs_;
  std::vector<size_t> off_;
};

// Dense memo of OC(s, x, A, dF, dB) where it fits (dF, dB are multiples of the Delta step q),
// s fastest: the choices of a state read OC(sp+1, .) for consecutive sp, which then sit
// together instead of in random hash slots. v = NaN: not computed.
class OCTable {
 public:
  OCTable(int L, int64_t M, int64_t q) : L1_(L + 1), M1_(M + 1), n_(M / q + 1), q_(q) {
    v_.assign(static_cast<size_t>(2 * M1_ * n_ * n_ * L1_),
              Memo{std::numeric_limits<double>::quiet_NaN(), 0, true});
  }
  static bool fits(int L, int64_t M, int64_t q) {
    const double n = static_cast<double>(M / q + 1);
    return 2.0 * (L + 1) * (M + 1) * n * n <= 4e6;
  }
  Memo& at(int s, int x, int64_t A, int64_t dF, int64_t dB) {
    return v_[static_cast<size_t>((((x * M1_ + A) * n_ + dF / q_) * n_ + dB / q_) * L1_ + s)];
  }
  size_t size() const {
    size_t n = 0;
    for (const Memo& m : v_) n += !std::isnan(m.v);
    return n;
  }

 private:
  int64_t L1_, M1_, n_, q_;
  std::vector<Memo> v_;
};

class MemoTable {
 public:
  MemoTable() { rehash(1 << 16); }
  Memo* find(uint64_t key) {
    const uint64_t k = key + 1;  // 0 marks an empty slot
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &vals_[i];
      if (keys_[i] == 0) return nullptr;
    }
  }
  void put(uint64_t key, const Memo& m) {
    if (2 * (size_ + 1) > keys_.size()) rehash(keys_.size() * 2);
    const uint64_t k = key + 1;
    size_t i = slot(k);
    while (keys_[i] != 0 && keys_[i] != k) i = (i + 1) & mask_;
    if (keys_[i] == 0) ++size_;
    keys_[i] = k;
    vals_[i] = m;
  }
  const Memo& at(uint64_t key) { return *find(key); }
  size_t size() const { return size_; }

 private:
  size_t slot(uint64_t k) const {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return static_cast<size_t>(k) & mask_;
  }
  void rehash(size_t cap) {
    std::vector<uint64_t> ok;
    std::vector<Memo> ov;
    ok.swap(keys_);
    ov.swap(vals_);
    keys_.assign(cap, 0);
    vals_.resize(cap);
    mask_ = cap - 1;
    size_ = 0;
    for (size_t i = 0; i < ok.size(); ++i)
      if (ok[i]) put(ok[i] - 1, ov[i]);
  }
  std::vector<uint64_t> keys_;
  std::vector<Memo> vals_;
  size_t mask_ = 0, size_ = 0;
};

class Solver {
 public:
  Solver(const Chain& c, int64_t M, double beta, const Options& opt)
      : c_(c), L_(c.L), M_(M), beta_(beta), opt_(opt) {
    q_ = std::max(1, opt.delta_step);
    if (!(beta_ > 0)) opt_.offload = false;
    fpre_.assign(L_ + 2, 0.0);
    cpre_.assign(L_ + 2, 0.0);
    for (int k = 0; k <= L_; ++k) {
      fpre_[k + 1] = fpre_[k] + c_.fw[k];
      cpre_[k + 1] = cpre_[k] + c_.fw[k] + c_.bw[k];
    }
    big_ = 4 * M_ + 4;
    if (CTable::fits(L_, M_)) dense_ = std::make_unique<CTable>(L_, M_);
    // the dense OC memo on coarse Delta grids (long chains); exact grids are mostly empty
    if (!opt_.whole && q_ > 1 && OCTable::fits(L_, M_, q_))
      ocd_ = std::make_unique<OCTable>(L_, M_, q_);
  }

  double top(double budget) { return OC(0, 0, 0, 0, 0, budget); }

  void emit_top(Result& r) {
    out_ = &r;
    oc_choice(0, 0, 0, 0, 0, best_oc(0, 0, 0, 0, 0), true);
    out_ = nullptr;
  }

  size_t n_oc() const { return oc_.size() + (ocd_ ? ocd_->size() : 0); }
  size_t n_c() const { return dense_ ? dense_->size() : c_memo_.size(); }

 private:
  // ---------------------------------------------------------------- helpers
  int64_t moved(double t) const {
    if (!(beta_ > 0) || t <= 0) return 0;
    const double v = t * beta_;
    if (!std::isfinite(v) || v >= static_cast<double>(big_)) return big_;
    // nearest (unbiased over many steps); v + 0.5 > 0, so truncation is floor (no libm call)
    return static_cast<int64_t>(v + 0.5);
  }
  double wait(double excess) const {
    if (excess <= 0) return 0;
    if (std::isinf(beta_)) return 0;
    if (!(beta_ > 0)) return kInf;
    return excess / beta_;
  }
  bool finite_beta() const { return beta_ > 0 && !std::isinf(beta_); }
  int64_t input(int s, int x) const { return s == 0 ? c_.x[0] : (x ? c_.xbar[s - 1] : c_.x[s]); }
  // memory of the k-th forward of a F_ck s, F_none s+1..k run (without the input of s)
  int64_t fmem(int s, int k) const {
    return (k == s ? c_.x[s + 1] : c_.x[k] + c_.x[k + 1]) + c_.fck_tmp[k];
  }

  static uint64_t ckey(int s, int t, int64_t m, int64_t d) {
    return (static_cast<uint64_t>(s) << 54) | (static_cast<uint64_t>(t) << 44) |
           (static_cast<uint64_t>(m) << 22) | static_cast<uint64_t>(d);
  }
  static uint64_t okey(int s, int x, int64_t A, int64_t dF, int64_t dB) {
    return (static_cast<uint64_t>(s) << 54) | (static_cast<uint64_t>(x) << 53) |
           (static_cast<uint64_t>(A) << 36) | (static_cast<uint64_t>(dF) << 18) |
           static_cast<uint64_t>(dB);
  }

  // ---------------------------------------------------------------- backward: C_Delta
  double C(int s, int t, int64_t m, int64_t d) {
    if (m < 0 || d < 0 || c_.delta[s] + d > m) return kInf;
    if (d > 0 && !(beta_ > 0)) return kInf;
    size_t di = 0;
    double hit;
    if (memo_get(s, t, m, d, &di, &hit)) return hit;
    double best = c_choice(s, t, m, d, -1, false);
    int32_t arg = -1;
    if (s < t && opt_.recompute) {
      // running max over k of M_k + beta * F[k+1] (Lemma 1 distance to the end of F_sp)
      double run = -kInf;
      const int64_t dt = c_.delta[t + 1];
      // C(s, s..t-1, m, d), the first part of each choice, read in place when dense
      const double* row = dense_ ? &dense_->v_[dense_->index(s, s, m, d)] : nullptr;
      for (int sp = s; sp < t; ++sp) {
        const int64_t mk = dt + fmem(s, sp);
        if (mk > m) break;  // F_sp does not fit: no longer run does either
        // branch and bound: any such sequence computes s..t once and F_s..F_sp again
        if (cpre_[t + 1] - cpre_[s] + fpre_[sp + 1] - fpre_[s] >= best) break;
        run = std::max(run, mk + (finite_beta() ? beta_ * fpre_[sp + 1] : 0.0));
        if (c_.x[sp + 1] > m) continue;
        const double maxterm = finite_beta() ? run - beta_ * fpre_[sp + 1] : run;
        double T1 = row ? row[sp - s] : kNaN;
        if (std::isnan(T1)) T1 = C(s, sp, m, d);
        const double v = c_ck(s, t, m, d, sp, maxterm, T1, false, best);
        if (v < best) best = v, arg = sp;
      }
    }
    memo_put(s, t, m, d, di, best, arg);
    return best;
  }

  void c_emit(int s, int t, int64_t m, int64_t d) {
    C(s, t, m, d);
    c_choice(s, t, m, d, memo_choice(s, t, m, d), true);
  }

  // C and Cw memoise in the same tables (one mode per solve): dense where the range fits,
  // else hashed. memo_get also returns the dense index that memo_put then reuses.
  bool memo_get(int s, int t, int64_t m, int64_t d, size_t* di, double* v) {
    if (dense_) {
      *di = dense_->index(s, t, m, d);
      *v = dense_->v_[*di];
      return !std::isnan(*v);
    }
    const Memo* hit = c_memo_.find(ckey(s, t, m, d));
    if (hit) *v = hit->v;
    return hit != nullptr;
  }
  void memo_put(int s, int t, int64_t m, int64_t d, size_t di, double v, int32_t arg) {
    if (dense_) {
      dense_->v_[di] = v;
      dense_->ch_[di] = static_cast<int16_t>(arg);
    } else {
      c_memo_.put(ckey(s, t, m, d), {v, arg, true});
    }
  }
  int memo_choice(int s, int t, int64_t m, int64_t d) {
    return dense_ ? dense_->ch_[dense_->index(s, t, m, d)] : c_memo_.at(ckey(s, t, m, d)).ch;
  }

  // ch = -1: F_all s first (or the single-stage case); ch = sp >= s: F_ck s, F_none up to sp.
  double c_choice(int s, int t, int64_t m, int64_t d, int ch, bool emit) {
    const int64_t dt = c_.delta[t + 1];
    if (ch < 0) {
      const int64_t mf = dt + c_.xbar[s] + c_.fw_tmp[s];
      const int64_t mb = c_.xbar[s] + c_.delta[s + 1] + c_.delta[s] + c_.bw_tmp[s];
      if (mf > m || mb > m) return kInf;
      if (s == t) {  // B.3 initialisation, Lemma 1 over the sequence F_all s, B s
        double e = 0;
        if (beta_ > 0 && !std::isinf(beta_)) {
          e = std::max({0.0, static_cast<double>(mf - m + d) / beta_ - c_.bw[s],
                        static_cast<double>(mb - m + d) / beta_});
        }
        if (emit) push(0, s), push(3, s);
        return c_.fw[s] + c_.bw[s] + e;
      }
      if (c_.xbar[s] > m) return kInf;
      const int64_t exB = std::max<int64_t>(0, mb - m + d);
      const int64_t d1 = std::max<int64_t>(0, d - (exB + moved(c_.bw[s])));
      const double T = C(s + 1, t, m - c_.xbar[s], d1);
      if (std::isinf(T)) return kInf;
      const int64_t d2 = std::max<int64_t>(0, d1 - moved(T));
      const int64_t exF = std::max<int64_t>(0, mf - m + d2);
      const double v = c_.fw[s] + c_.bw[s] + T + wait(exF) + wait(exB);
      if (emit) {
        push(0, s);
        c_emit(s + 1, t, m - c_.xbar[s], d1);
        push(3, s);
      }
      return v;
    }
    const int sp = ch;
    double maxterm = -kInf;
    for (int k = s; k <= sp; ++k) {
      const int64_t mk = dt + fmem(s, k);
      if (mk > m) return kInf;
      const double dist = fpre_[sp + 1] - fpre_[k + 1];  // time from the end of F_k to the end
      maxterm = std::max(maxterm, finite_beta() ? mk - beta_ * dist : static_cast<double>(mk));
    }
    if (c_.x[sp + 1] > m) return kInf;
    return c_ck(s, t, m, d, sp, maxterm, C(s, sp, m, d), emit, kInf);
  }

  // Case 2 of B.3 with the forward run's Lemma 1 term and T1 = C(s, sp, m, d) already
  // known (x[sp+1] <= m checked).
  // ``bound``: a value known to be reachable; a result that cannot beat it may be kInf.
  double c_ck(int s, int t, int64_t m, int64_t d, int sp, double maxterm, double T1,
              bool emit, double bound) {
    if (std::isinf(T1)) return kInf;
    if (fpre_[sp + 1] - fpre_[s] + T1 + cpre_[t + 1] - cpre_[sp + 1] >= bound) return kInf;
    const int64_t d2 = std::max<int64_t>(0, d - moved(T1));
    const double T2 = C(sp + 1, t, m - c_.x[sp + 1], d2);
    if (std::isinf(T2)) return kInf;
    const int64_t d3 = std::max<int64_t>(0, d2 - moved(T2));
    const double eF = finite_beta() ? wait(maxterm - m + d3) : 0.0;
    const double v = (fpre_[sp + 1] - fpre_[s]) + T1 + T2 + eF;
    if (emit) {
      push(1, s);
      for (int k = s + 1; k <= sp; ++k) push(2, k);
      c_emit(sp + 1, t, m - c_.x[sp + 1], d2);
      c_emit(s, sp, m, d);
    }
    return v;
  }

  // ---------------------------------------------------------------- forward: OC_x
  // choice = kind | v << 2 | sp << 3; kind 0 loss, 1 F_all, 2 F_ck; v = 1: offload the input
  // Branch and bound: ``budget`` is a value the caller already has; if this state cannot
  // do better, it returns kInf (and memoises "value >= budget"). Returning the bound
  // itself would be wrong: partial + (budget - partial) can round below the caller's best.
  double OC(int s, int x, int64_t A, int64_t dF, int64_t dB, double budget = kInf) {
    const int64_t I = input(s, x);
    // what is stored, still being offloaded, or already prefetched all sits in GPU memory
    if (A + I + dF > M_ || A + I + dB > M_) return kInf;
    if (const Memo* hit = oc_find(s, x, A, dF, dB)) {
      if (hit->exact) return hit->v;
      if (hit->v >= budget) return kInf;  // known not to beat the budget
    }
    double best = kInf;
    int32_t arg = 0;
    const double rest = cpre_[L_ + 1] - cpre_[s];  // no sequence from here is faster
    if (rest >= budget) {
      best = rest;
    } else if (s == L_) {
      best = oc_choice(s, x, A, dF, dB, 0, false, budget);
    } else {
      for (int v = 0; v <= 1; ++v) {
        if (v && !(opt_.offload && I > 0 && may_offload(s))) continue;
        int32_t ch = 1 | (v << 2);
        double val = oc_choice(s, x, A, dF, dB, ch, false, std::min(best, budget));
        if (val < best) best = val, arg = ch;
        if (!opt_.recompute) continue;
        const int64_t avail = M_ - A - I;
        double run = -kInf;
        // C(s, s.., avail, dB), each choice's backward part, read in place when dense
        const double* row = dense_ && avail >= 0 && dB <= avail
                                ? &dense_->v_[dense_->index(s, s, avail, dB)] : nullptr;
        for (int sp = s; sp < L_; ++sp) {
          const int64_t mk = fmem(s, sp);
          if (mk > avail + ((v && sp > s) ? I : 0)) break;  // longer runs do not fit either
          if (rest + fpre_[sp + 1] - fpre_[s] >= std::min(best, budget)) break;  // bound
          run = std::max(run, finite_beta() ? mk - beta_ * (fpre_[sp] - fpre_[s])
                                            : static_cast<double>(mk));
          ch = 2 | (v << 2) | (sp << 3);
          val = oc_ck(s, x, A, dF, dB, v, sp, run, false, std::min(best, budget), row);
          if (val < best) best = val, arg = ch;
        }
      }
    }
    if (best < budget || std::isinf(budget)) {  // searched without a cut: the optimum
      oc_put(s, x, A, dF, dB, {best, arg, true});
      return best;
    }
    oc_put(s, x, A, dF, dB, {budget, arg, false});  // some choices were cut: only ">= budget"
    return kInf;
  }

  const Memo* oc_find(int s, int x, int64_t A, int64_t dF, int64_t dB) {
    if (ocd_) {
      const Memo& m = ocd_->at(s, x, A, dF, dB);
      return std::isnan(m.v) ? nullptr : &m;
    }
    return oc_.find(okey(s, x, A, dF, dB));
  }
  void oc_put(int s, int x, int64_t A, int64_t dF, int64_t dB, const Memo& m) {
    if (ocd_) {
      ocd_->at(s, x, A, dF, dB) = m;
    } else {
      oc_.put(okey(s, x, A, dF, dB), m);
    }
  }

  int32_t best_oc(int s, int x, int64_t A, int64_t dF, int64_t dB) {
    OC(s, x, A, dF, dB);
    return oc_find(s, x, A, dF, dB)->ch;
  }

  void next_state(int v, int64_t I, int64_t A, int64_t dF, int64_t dB, int64_t DF, int64_t DB,
                  int64_t& A2, int64_t& dF2, int64_t& dB2) const {  // seed 001 Table 2
    if (v) {
      A2 = A;
      dF2 = std::max<int64_t>(0, dF + I - DF);
      dB2 = std::max<int64_t>(0, dB - DB) + I;
    } else {
      A2 = A + I;
      dF2 = std::max<int64_t>(0, dF - DF);
      dB2 = std::max<int64_t>(0, dB - DB);
    }
    if (q_ > 1) {  // coarser Delta grid (rounded up: never less data to move than real)
      dF2 = (dF2 + q_ - 1) / q_ * q_;
      dB2 = (dB2 + q_ - 1) / q_ * q_;
    }
  }

  double oc_choice(int s, int x, int64_t A, int64_t dF, int64_t dB, int32_t ch, bool emit,
                   double budget = kInf) {
    const int kind = ch & 3, v = (ch >> 2) & 1, sp = ch >> 3;
    const int64_t I = input(s, x);
    const int64_t avail = M_ - A - I;
    if (kind == 0 || kind == 1) {
      const int64_t mf = c_.xbar[s] + c_.fw_tmp[s];
      const int64_t mb = c_.xbar[s] + c_.delta[s + 1] + c_.delta[s] + c_.bw_tmp[s];
      if (mf > avail || mb > avail) return kInf;
      const int64_t exF = std::max<int64_t>(0, mf + dF - avail);  // Lemma 1, Case 1
      const int64_t exB = std::max<int64_t>(0, mb + dB - avail);
      const int64_t DF = std::min(big_, exF + moved(c_.fw[s]));
      const int64_t DB = std::min(big_, exB + moved(c_.bw[s]));
      double val = c_.fw[s] + c_.bw[s] + wait(exF) + wait(exB);
      if (kind == 0) {  // the loss, B.2
        const int64_t left = std::max<int64_t>(0, dF - DF) + std::max<int64_t>(0, dB - DB);
        if (emit) push(0, s), push(3, s);
        return val + wait(static_cast<double>(left));
      }
      int64_t A2, dF2, dB2;
      next_state(v, I, A, dF, dB, DF, DB, A2, dF2, dB2);
      if (val + cpre_[L_ + 1] - cpre_[s + 1] >= budget) return kInf;  // bound
      const double T = OC(s + 1, 1, A2, dF2, dB2, budget - val);
      if (std::isinf(T)) return kInf;
      if (emit) {
        if (v) push(4, s);
        push(0, s);
        oc_choice(s + 1, 1, A2, dF2, dB2, best_oc(s + 1, 1, A2, dF2, dB2), true);
        if (v) out_->prefetch.emplace_back(s, static_cast<int>(out_->ops.size()));
        push(3, s);
      }
      return val + T;
    }
    // kind 2: F_ck s, F_none s+1..sp, then OC from sp+1, then C(s, sp) (Case 2)
    double maxterm = -kInf;
    for (int k = s; k <= sp; ++k) {
      const int64_t mk = fmem(s, k);
      if (mk > avail + ((v && k > s) ? I : 0)) return kInf;
      const double dist = fpre_[k] - fpre_[s];  // time from the start of the sequence
      maxterm = std::max(maxterm, finite_beta() ? mk - beta_ * dist : static_cast<double>(mk));
    }
    return oc_ck(s, x, A, dF, dB, v, sp, maxterm, emit, budget);
  }

  // ``row``: C(s, s.., M - A - I, dB) in the dense table (T1 read in place), or nullptr
  double oc_ck(int s, int x, int64_t A, int64_t dF, int64_t dB, int v, int sp, double maxterm,
               bool emit, double bound, const double* row = nullptr) {
    const int64_t I = input(s, x);
    const int64_t avail = M_ - A - I;
    const double eF = finite_beta() ? wait(maxterm + dF - avail)
                                    : (maxterm + dF > avail ? kInf : 0.0);
    if (std::isinf(eF)) return kInf;
    const double fwsum = fpre_[sp + 1] - fpre_[s];
    const int64_t DF = moved(fwsum + eF);
    double T1 = row ? row[sp - s] : kNaN;
    if (std::isnan(T1)) T1 = C(s, sp, avail, dB);
    if (std::isinf(T1)) return kInf;
    if (fwsum + eF + T1 + cpre_[L_ + 1] - cpre_[sp + 1] >= bound) return kInf;  // bound
    const int64_t DB = moved(T1);
    int64_t A2, dF2, dB2;
    next_state(v, I, A, dF, dB, DF, DB, A2, dF2, dB2);
    const double T = OC(sp + 1, 0, A2, dF2, dB2, bound - (fwsum + eF + T1));
    if (std::isinf(T)) return kInf;
    if (emit) {
      if (v) push(4, s);
      push(1, s);
      for (int k = s + 1; k <= sp; ++k) push(2, k);
      oc_choice(sp + 1, 0, A2, dF2, dB2, best_oc(sp + 1, 0, A2, dF2, dB2), true);
      if (v) out_->prefetch.emplace_back(s, static_cast<int>(out_->ops.size()));
      c_emit(s, sp, avail, dB);
    }
    return fwsum + eF + T + T1;
  }

  // ---------------------------------------------------------------- whole-activation mode
  // Ours (issue 14), not seed 001: the DP under the simulator's model (scheduler/simulate.py)
  // instead of assumption 3. An offload holds its whole item until its copy completes; a
  // prefetch reserves its whole item when it starts; one channel, copies in plan order.
  //  * OCw(s, x, A, q, dB): as OC, plus the channel at F_s's start: the copy in flight (R
  //    sub-units of 1/kSub unit left, H units held until it completes) and the offloads
  //    queued behind it (T units; two or more are merged: held until the last completes,
  //    later than the simulator frees the first: pessimistic, never optimistic).
  //    dB: the size of one prefetched item whose copy starts with B_s (the last op) and is
  //    reserved from then on (the parent's "early" prefetch; it waits for it after B_s).
  //  * Each offloaded input's prefetch sits right before its consumer ("late": the consumer
  //    waits for the whole copy) or right before the backward op that precedes it ("early":
  //    overlapping that op, which must fit beside it).
  //  * Cw(s, t, m, d): rotor's sub-chain with an item of size d reserved during B_s.
  // Every op starts in the DP no earlier than in the simulator (remaining copies rounded up,
  // merged queues, the loss waiting for the forward copies), so the emitted plan simulates in
  // at most the DP's value, and exactly in it when none of these roundings bites.
  static constexpr int64_t kSub = 4;
  double tcopy(int64_t units) const { return units / beta_; }

  // The channel at a forward op's start: the copy in flight (R sub-units left, H units held
  // until it completes) and the offloads queued behind it (T units, not started: held, and
  // copied one after the other; two or more are merged: all held until the last completes).
  struct Chan {
    int64_t R = 0, H = 0, T = 0;
  };
  struct Run {
    double end;     // the run's end, from its start
    double done;    // when the channel has copied everything queued so far
    Chan next;      // the channel at the run's end
  };
  // A forward run F_s..F_sp (all: the single F_all s) from time 0 (the previous op's end),
  // with `fixed` stored besides the run's own memory, the channel `q` and, if `off`, the
  // input I of s offloaded from the run's start (queued last).
  bool run_w(int s, int sp, bool all, int64_t fixed, int64_t I, bool off, const Chan& q,
             Run& out) const {
    const double t_h = q.R > 0 ? static_cast<double>(q.R) / kSub / beta_ : 0.0;
    const double t_t = q.T > 0 ? t_h + tcopy(q.T) : t_h;
    const double t_n = off ? t_t + tcopy(I) : t_t;
    const double tol = 1e-9 * (1.0 + t_n);
    auto held = [&](double t, bool reads_I) {  // its copy completes after t (ties: freed)
      return (t_h > t + tol ? q.H : 0) + (t_t > t + tol ? q.T : 0) +
             (off && (reads_I || t_n > t + tol) ? I : 0);
    };
    double tau = 0;
    for (int k = s; k <= sp; ++k) {
      const int64_t mk = all ? c_.xbar[s] + c_.fw_tmp[s] : fmem(s, k);
      double st = tau;
      const double events[3] = {t_h, t_t, off && k > s ? t_n : t_t};
      for (double ev : events) {  // wait for copies to complete, in order
        if (fixed + mk + held(st, k == s) <= M_) break;
        if (ev > st + tol) st = ev;
      }
      if (fixed + mk + held(st, k == s) > M_) return false;
      tau = st + c_.fw[k];
    }
    out.end = tau;
    out.done = t_n;
    out.next = Chan();
    // the first item still in flight at the end becomes the head, the rest the queue
    const double ends[3] = {t_h, t_t, t_n};
    const int64_t sizes[3] = {q.R > 0 ? q.H : 0, q.T, off ? I : 0};
    bool head = false;
    for (int i = 0; i < 3; ++i) {
      if (sizes[i] == 0 || !(ends[i] > tau + tol)) continue;
      if (!head) {
        head = true;
        out.next.H = sizes[i];
        out.next.R = std::max<int64_t>(
            1, static_cast<int64_t>(std::ceil((ends[i] - tau) * beta_ * kSub - 1e-6)));
      } else {
        out.next.T += sizes[i];
      }
    }
    return out.next.H + out.next.T <= M_ && out.next.R < (1 << 12);
  }

  // 6 + 1 + 4 x 10 + 12 + 2 bits: whole mode needs L < 64 and memory < 1024 units
  static uint64_t wkey(int s, int x, int64_t A, const Chan& q, int64_t D, int mode) {
    return (static_cast<uint64_t>(s) << 55) | (static_cast<uint64_t>(x) << 54) |
           (static_cast<uint64_t>(A) << 44) | (static_cast<uint64_t>(q.H) << 34) |
           (static_cast<uint64_t>(q.T) << 24) | (static_cast<uint64_t>(D) << 14) |
           (static_cast<uint64_t>(q.R) << 2) | static_cast<uint64_t>(mode);
  }

  double Cw(int s, int t, int64_t m, int64_t d) {
    if (m < 0 || d < 0 || c_.delta[s] + d > m) return kInf;
    size_t di = 0;
    double hit;
    if (memo_get(s, t, m, d, &di, &hit)) return hit;
    double best = cw_choice(s, t, m, d, -1, false);
    int32_t arg = -1;
    for (int sp = s; sp < t && opt_.recompute; ++sp) {
      const double v = cw_choice(s, t, m, d, sp, false);
      if (v < best) best = v, arg = sp;
    }
    memo_put(s, t, m, d, di, best, arg);
    return best;
  }

  void cw_emit(int s, int t, int64_t m, int64_t d) {
    Cw(s, t, m, d);
    cw_choice(s, t, m, d, memo_choice(s, t, m, d), true);
  }

  double cw_choice(int s, int t, int64_t m, int64_t d, int ch, bool emit) {
    const int64_t dt = c_.delta[t + 1];
    if (ch < 0) {  // F_all s, (s..t), B s
      const int64_t mf = dt + c_.xbar[s] + c_.fw_tmp[s];
      const int64_t mb = c_.xbar[s] + c_.delta[s + 1] + c_.delta[s] + c_.bw_tmp[s] + d;
      if (mf > m || mb > m) return kInf;
      double T = 0;
      if (s < t) {
        T = Cw(s + 1, t, m - c_.xbar[s], 0);
        if (std::isinf(T)) return kInf;
      }
      if (emit) {
        push(0, s);
        if (s < t) cw_emit(s + 1, t, m - c_.xbar[s], 0);
        push(3, s);
      }
      return c_.fw[s] + c_.bw[s] + T;
    }
    const int sp = ch;  // F_ck s, F_none s+1..sp, (sp+1..t), (s..sp)
    for (int k = s; k <= sp; ++k)
      if (dt + fmem(s, k) > m) return kInf;
    if (c_.x[sp + 1] > m) return kInf;
    const double T2 = Cw(sp + 1, t, m - c_.x[sp + 1], 0);
    if (std::isinf(T2)) return kInf;
    const double T1 = Cw(s, sp, m, d);
    if (std::isinf(T1)) return kInf;
    if (emit) {
      push(1, s);
      for (int k = s + 1; k <= sp; ++k) push(2, k);
      cw_emit(sp + 1, t, m - c_.x[sp + 1], 0);
      cw_emit(s, sp, m, d);
    }
    return fpre_[sp + 1] - fpre_[s] + T1 + T2;
  }

  // The item of the state (D units, a prefetch for a consumer after B s): where its copy
  // starts, which reserves it until the end. 0: at B s (the last op); 1: at the last
  // component (kind 2: all of C(s, sp)); 2: at the op before that component (then v = 0);
  // 3: at B s, but an owner higher up waits for it (the parent's mode 2).
  // choice = kind | v << 2 | sp << 5; kind 0 loss, 1 F_all, 2 F_ck; v 0 keep the input,
  // 1 offload it, prefetch right before its consumer; 2, 3, 4 ... as the sub-sequence's
  // item in mode 0, 1, 2.
  double OCw(int s, int x, int64_t A, const Chan& q, int64_t D, int mode) {
    const int64_t I = input(s, x);
    if (A + I + D > M_) return kInf;
    const uint64_t key = wkey(s, x, A, q, D, mode);
    if (const Memo* hit = oc_.find(key)) return hit->v;
    double best = kInf;
    int32_t arg = 0;
    if (s == L_) {
      best = ocw_choice(s, x, A, q, D, mode, 0, false, -1);
    } else {
      const bool can_off = opt_.offload && I > 0 && may_offload(s) && finite_beta() &&
                           !(D > 0 && mode == 2);
      for (int v = 0; v <= (can_off ? 4 : 0); ++v) {
        int32_t ch = 1 | (v << 2);
        double val = ocw_choice(s, x, A, q, D, mode, ch, false, -1);
        if (val < best) best = val, arg = ch;
        for (int sp = s; sp < L_ && opt_.recompute; ++sp) {
          ch = 2 | (v << 2) | (sp << 5);
          val = ocw_choice(s, x, A, q, D, mode, ch, false, -1);
          if (val < best) best = val, arg = ch;
        }
      }
    }
    oc_.put(key, {best, arg, true});
    return best;
  }

  // `item`: the stage of the state's item, to emit its prefetch where the mode says
  double ocw_choice(int s, int x, int64_t A, const Chan& q, int64_t D, int mode, int32_t ch,
                    bool emit, int item) {
    const int kind = ch & 3, v = (ch >> 2) & 7, sp = ch >> 5;
    const int64_t I = input(s, x);
    const int64_t mb = c_.xbar[s] + c_.delta[s + 1] + c_.delta[s] + c_.bw_tmp[s];
    const double cD = D > 0 ? tcopy(D) : 0.0;  // the item's copy time
    if (D == 0) mode = 0;
    Run run;
    if (kind == 0) {  // the loss: F_all L, B L; the channel finishes the forward's copies first
      if (A + I + mb + D > M_ || mode == 2) return kInf;
      if (!run_w(s, s, true, A + I, I, false, q, run)) return kInf;
      const bool busy = run.next.H > 0;
      double b0 = run.end;  // B L waits for copies to complete (in order) until it fits
      if (busy && A + I + mb + D + run.next.H + run.next.T > M_) {
        const double t_h = b0 + static_cast<double>(run.next.R) / kSub / beta_;
        b0 = A + I + mb + D + run.next.T <= M_ ? t_h : std::max(t_h, run.done);
      }
      if (busy && D > 0) b0 = std::max(b0, run.done);  // its prefetch queues behind them
      if (emit) {
        push(0, s), push(3, s);
        if (D > 0) out_->ops.insert(out_->ops.end() - 1, Op{5, item});
      }
      return std::max({b0 + c_.bw[s], busy ? run.done : 0.0, mode == 3 ? 0.0 : b0 + cD});
    }
    if (A + I + mb + (mode == 1 && kind == 2 ? 0 : D) > M_) return kInf;  // B s
    const bool off = v > 0;
    const int last = kind == 1 ? s : sp;
    if (!run_w(s, last, kind == 1, A + (off ? 0 : I), I, off, q, run)) return kInf;
    const int64_t A2 = off ? A : A + I;
    const int next = last + 1, x2 = kind == 1 ? 1 : 0;
    if (kind == 2 && c_.x[next] > M_) return kInf;
    // what the sub-sequence carries: our input's early prefetch, or our item's (mode 2)
    int64_t D2 = 0;
    int mode2 = 0;
    if (v >= 2) D2 = I, mode2 = v - 2;
    if (mode == 2) D2 = D, mode2 = 3;
    const double T = OCw(next, x2, A2, run.next, D2, mode2);
    if (std::isinf(T)) return kInf;
    const double late = v == 1 ? tcopy(I) : 0.0;  // the consumer waits for the whole copy
    double T1 = c_.bw[s];
    if (kind == 2) {
      const bool through = mode == 1 || mode == 2;  // the item is reserved during all of C
      T1 = Cw(s, sp, M_ - A - I - (through ? D : 0), through ? 0 : D);
      if (std::isinf(T1)) return kInf;
    }
    // the item's copy: from the start of its span to after B s, the parent waits for the rest
    double span = c_.bw[s];
    if (kind == 2 && (mode == 1 || mode == 2)) span = T1;
    if (mode == 2) span += c_.bw[next];
    const double rest = (D > 0 && mode != 3) ? std::max(0.0, cD - span) : 0.0;
    if (emit) {
      if (off) push(4, s);
      push(kind == 1 ? 0 : 1, s);
      for (int k = s + 1; k <= sp && kind == 2; ++k) push(2, k);
      const int32_t sub = oc_.at(wkey(next, x2, A2, run.next, D2, mode2)).ch;
      ocw_choice(next, x2, A2, run.next, D2, mode2, sub, true,
                 v >= 2 ? s : (mode == 2 ? item : -1));
      if (v == 1) push(5, s);
      if (kind == 1) {
        push(3, s);
        if (D > 0 && mode != 2) out_->ops.insert(out_->ops.end() - 1, Op{5, item});
      } else {
        const size_t at = out_->ops.size();
        cw_emit(s, sp, M_ - A - I - (mode == 1 || mode == 2 ? D : 0),
                mode == 1 || mode == 2 ? 0 : D);
        if (D > 0 && mode == 1) out_->ops.insert(out_->ops.begin() + at, Op{5, item});
        if (D > 0 && (mode == 0 || mode == 3))
          out_->ops.insert(out_->ops.end() - 1, Op{5, item});
      }
    }
    return run.end + T + late + T1 + rest;
  }

 public:
  double top_whole() { return OCw(0, 0, 0, Chan(), 0, 0); }
  void emit_top_whole(Result& r) {
    out_ = &r;
    ocw_choice(0, 0, 0, Chan(), 0, 0, oc_.at(wkey(0, 0, 0, Chan(), 0, 0)).ch, true, -1);
    out_ = nullptr;
  }

 private:

  void push(int kind, int stage) { out_->ops.push_back({kind, stage}); }
  bool may_offload(int s) const {
    return static_cast<size_t>(s) >= opt_.no_offload.size() || !opt_.no_offload[s];
  }

  const Chain& c_;
  int L_;
  int64_t M_;
  double beta_;
  Options opt_;
  int64_t big_;
  std::vector<double> fpre_, cpre_;  // prefix sums of fw, of fw + bw (for pruning)
  MemoTable c_memo_, oc_;  // oc_: OC where ocd_ does not fit, and OCw
  std::unique_ptr<OCTable> ocd_;
  int64_t q_ = 1;
  std::unique_ptr<CTable> dense_;
  Result* out_ = nullptr;
};

}  // namespace

Result solve(const Chain& c, int64_t memory, double beta, const Options& opt) {
  Result r;
  Solver solver(c, memory, beta, opt);
  if (opt.whole) {  // ours (issue 14): see "whole-activation mode"
    const double t = solver.top_whole();
    r.states_fwd = solver.n_oc();
    r.states_bwd = solver.n_c();
    if (std::isinf(t) || t >= opt.budget) return r;
    r.feasible = true;
    r.time = t;
    solver.emit_top_whole(r);
    return r;
  }
  const double t = solver.top(opt.budget);
  r.states_fwd = solver.n_oc();
  r.states_bwd = solver.n_c();
  if (std::isinf(t) || t >= opt.budget) return r;
  r.feasible = true;
  r.time = t;
  solver.emit_top(r);
  return r;
}

}  // namespace pofo
}  // namespace vmalloc
