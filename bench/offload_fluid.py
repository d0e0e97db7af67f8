"""A tighter lower bound than Proposition 3 for offload-only schedules: the fluid LP.

Any offload-only schedule runs F_0..F_L then B_L..B_0 (one compute order), so the only
freedom is when the channel moves how much and where compute waits. Relax whole-activation
transfers to a fluid: ``H(t)``, the data on the host, rises at most at the channel's rate
while offloading and falls while prefetching (offloads + prefetches <= bandwidth x time).
The simulator frees an offloaded activation when its copy ends and reserves a prefetch when
it starts, so its ``H`` is never above the fluid one, and each of its constraints holds for
the fluid: during op k, ``need_k - H <= M`` (``need_k`` = the store-all schedule's memory
during op k), likewise in the gap after it with what op k left; ``0 <= H <=`` what is
produced by then; when ``B_i`` starts only ``x_0..x_{i-1}`` may be on the host. The least
total wait over these constraints, plus the compute time, bounds every plan's makespan from
below (every placement, order and subset). It needs scipy (HiGHS); without it: None.

For the benchmark only (seed 000 has no such bound): it says how much of DYNPROG's gap to
Proposition 3 no plan can close.

Not a script (no flags, nothing written): ``bench/offloading.py`` imports
``fluid_lower_bound`` from it.
"""
from __future__ import annotations

from typing import List, Optional

from scheduler import Chain, Plan
from scheduler.plan import Op
from scheduler.planners import offload
from scheduler.simulate import simulate

MIB, MS = 2 ** 20, 1e-3   # LP units (bytes and seconds are badly scaled for HiGHS)


def fluid_lower_bound(chain: Chain, memory: float, bandwidth: float) -> Optional[float]:
    """The fluid LP's optimum in seconds (None: scipy missing or the LP failed)."""
    try:
        import numpy as np
        from scipy.optimize import linprog
    except ImportError:
        return None
    L = chain.L
    ops = [Op("F_all", i) for i in range(L + 1)] + [Op("B", i) for i in range(L, -1, -1)]
    steps = simulate(chain, Plan(ops), None, memory=None).steps
    act = [a / MIB for a in offload.activations(chain)]
    M, beta = memory / MIB, bandwidth / MIB * MS
    need = [st.peak / MIB for st in steps]
    after = [st.memory_after / MIB for st in steps]
    dur = [(st.end - st.start) / MS for st in steps]
    K = len(ops)
    S = 2 * K   # segments: 2k = the gap before op k, 2k+1 = op k
    nv = 2 * S + K   # offloaded, prefetched per segment; gap lengths
    rows: List = []
    ub: List[float] = []

    def H(s: int):   # data on the host at the end of segment s
        r = np.zeros(nv)
        r[:s + 1] = 1
        r[S:S + s + 1] = -1
        return r

    def add(r, bound: float) -> None:
        rows.append(r)
        ub.append(bound)

    produced = [sum(act[:min(op.stage, L) + 1]) if op.kind == "F_all" else sum(act[:L + 1])
                for op in ops]
    for k in range(K):
        g, o = 2 * k, 2 * k + 1
        r = np.zeros(nv)
        r[g], r[S + g], r[2 * S + k] = 1, 1, -beta
        add(r, 0.0)                                   # the gap's channel
        r = np.zeros(nv)
        r[o], r[S + o] = 1, 1
        add(r, beta * dur[k])                         # the op's channel
        before = after[k - 1] if k else act[0]
        for s, m in ((g - 1, before), (g, before), (g, need[k]), (o, need[k])):
            add(-H(s), M - m)                         # m - H <= M
        for s in (g, o):
            add(-H(s), 0.0)
            add(H(s), produced[k] if s == g else (produced[k + 1] if k + 1 < K
                                                  else sum(act[:L + 1])))
        if ops[k].kind == "B":
            add(H(g), sum(act[:ops[k].stage]))
    cost = np.zeros(nv)
    cost[2 * S:] = 1
    res = linprog(cost, A_ub=np.array(rows), b_ub=np.array(ub), bounds=[(0, None)] * nv,
                  method="highs")
    if res.status != 0:
        return None
    return (sum(dur) + res.fun) * MS
