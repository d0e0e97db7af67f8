"""pofo's memory bound and the limits its errors name (pofo.min_memory, pofo.solve's and
autocapper's InfeasibleError), on random small chains: physical ones (xbar[s] >= x[s+1]) and
free ones, zeros, ties, one huge transient.

min_memory is a lower bound: no plan of pofo's class (every persistent sequence x every
offload subset, enumerated on tiny chains) and no planner's plan peaks below it. It is not
always met, so solve's error names a limit it was checked to plan at (in exact units the
least whole one), never one solve then refuses."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from _oracle import first_use, pofo_class
from scheduler import Chain, InfeasibleError, InvalidPlanError, Plan, simulate
from scheduler.plan import Op
from scheduler.planners import improve, offload, pofo, pofo_heuristics, rotor


@st.composite
def chains(draw, max_L=3):
    """A small integer chain; ``physical``: xbar[s] holds x[s+1] (what profiles give)."""
    L = draw(st.integers(0, max_L))
    n = L + 1
    size = st.integers(0, 12)
    col = lambda vals=size: draw(st.lists(vals, min_size=n, max_size=n))  # noqa: E731
    x, xbar = col(), col(st.integers(0, 16))
    if draw(st.booleans()):
        xbar = [max(xbar[s], x[s + 1]) if s < L else xbar[s] for s in range(n)]
    fw_tmp, bw_tmp = col(st.integers(0, 6)), col(st.integers(0, 6))
    big = draw(st.sampled_from([None, "fw_tmp", "bw_tmp"]))   # one huge transient
    if big is not None:
        (fw_tmp if big == "fw_tmp" else bw_tmp)[draw(st.integers(0, L))] = \
            draw(st.sampled_from([40, 100]))
    return Chain(fw=col(st.integers(0, 5)), bw=col(st.integers(0, 8)), x=x, xbar=xbar,
                 delta=x if draw(st.booleans()) else col(), fw_tmp=fw_tmp, bw_tmp=bw_tmp,
                 fck_tmp=col(st.integers(0, 8)) if draw(st.booleans()) else ())


def class_plans(c: Chain):
    """Every persistent sequence x every subset of its forward-phase heads' inputs
    offloaded (right before the head), each prefetched right before its first use in the
    backward: pofo's class, with the prefetches placed where they hold memory least."""
    for ops, loss, sub in pofo_class(c):
        use = {}
        for i in sub:
            use.setdefault(first_use(ops, loss, ops[i].stage), []).append(ops[i].stage)
        out = []
        for i, op in enumerate(ops):
            out += [Op("offload", op.stage)] if i in sub else []
            out += [Op("prefetch", s) for s in use.get(i, [])]
            out.append(op)
        yield Plan(out), bool(sub)


SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


@SETTINGS
@given(c=chains(), bw=st.sampled_from([0.5, 1.0, 4.0]))
def test_no_plan_of_pofos_class_peaks_below_the_bound(c, bw):
    """Exhaustive on tiny chains: the bound is at most every plan's peak (a limit is positive,
    so a chain of zeros has the bound 1)."""
    bound = pofo.min_memory(c)
    for plan, transfers in class_plans(c):
        try:
            peak = simulate(c, plan, bw if transfers else None, memory=None).peak_memory
        except InvalidPlanError:
            continue
        assert bound <= max(1, peak), [str(op) for op in plan.ops]


@SETTINGS
@given(c=chains(max_L=4), bw=st.sampled_from([0.5, 1.0, 4.0]))
def test_no_planner_plans_below_the_bound(c, bw):
    """rotor plans at its exact minimum, and no planner (rotor, GREEDY, DYNPROG, pofo itself)
    finds a plan below the bound; pofo finds one wherever rotor or GREEDY do (it refused
    limits both planned at: its bound counted delta[s+1] beside F_all s, which can run in
    the forward phase)."""
    bound = pofo.min_memory(c)
    least = rotor.min_memory(c)
    assert bound <= least
    for M in range(max(1, bound - 2), bound + 3):
        fit = []
        for name, planner in (("rotor", lambda: rotor.solve(c, M, slots=None)),
                              ("greedy", lambda: offload.greedy(c, M, bw)),
                              ("dynprog", lambda: offload.dynprog(c, M, bw, slots=None))):
            try:
                plan = planner()
            except InfeasibleError:
                continue
            assert simulate(c, plan, bw if plan.has_transfers else None).peak_memory <= M
            fit.append(name)
        assert not fit or M >= bound, fit
        try:
            pofo.solve(c, M, bw, slots=None)
        except InfeasibleError:
            assert not fit, f"pofo refused {M}, where {fit} plan"
        else:
            assert M >= bound


# a huge F_all transient at stage 0: the bound said 57, rotor plans at 54
HUGE_FW_TMP = Chain(fw=[5, 4, 2, 4, 1], bw=[6, 2, 2, 1, 7], x=[10, 3, 3, 8, 8],
                    xbar=[4, 15, 8, 8, 2], delta=[10, 3, 3, 8, 8], fw_tmp=[40, 3, 5, 1, 1],
                    bw_tmp=[0, 5, 4, 2, 2])
# one byte more memory gave a slower plan (54: 33 s, 55: 34 s)
SLOWER_AT_55 = Chain(fw=[1, 1, 3, 3], bw=[5, 1, 2, 5], x=[6, 1, 7, 1], xbar=[14, 11, 4, 6],
                     delta=[6, 1, 7, 1], fw_tmp=[1, 1, 40, 2], bw_tmp=[3, 3, 1, 2])


def test_the_reviewers_chains_plan_at_the_limit_rotor_and_greedy_meet():
    c = HUGE_FW_TMP
    assert pofo.min_memory(c) <= rotor.min_memory(c) == 54
    for slots in (None, 50):
        p = pofo.solve(c, 54, 5, slots=slots)
        assert p.predicted_time <= rotor.solve(c, 54, slots=None).predicted_time
    # ordinary sizes: GREEDY plans at 28, the bound said 29
    c = Chain(fw=[2, 2, 5, 2, 4], bw=[1, 7, 1, 7, 8], x=[2, 10, 5, 4, 0],
              xbar=[10, 5, 15, 2, 14], delta=[5, 5, 2, 5, 3], fw_tmp=[5, 0, 4, 3, 3],
              bw_tmp=[3, 4, 1, 1, 0])
    g = offload.greedy(c, 28, 1)
    assert pofo.solve(c, 28, 1, slots=None).predicted_time <= g.predicted_time


def _named(c, M, bw, slots):
    """The limit pofo.solve's error names at M, or None if it plans there."""
    try:
        pofo.solve(c, M, bw, slots=slots)
        return None
    except InfeasibleError as e:
        assert e.min_memory is not None and e.min_memory > M, str(e)
        return e.min_memory


@SETTINGS
@given(c=chains(), bw=st.sampled_from([0.5, 2.0]), below=st.integers(1, 4))
@example(c=HUGE_FW_TMP, bw=2.0, below=1)   # named 54, then refused it (below its bound, 57)
def test_the_named_limit_passes_solve_and_is_the_least_in_exact_units(c, bw, below):
    """The error names a limit solve plans at (its bound check included) and, in exact units,
    one byte less is refused: the least limit that works (the bound is not always met)."""
    M = max(1, min(pofo.min_memory(c), rotor.min_memory(c)) - below)
    need = _named(c, M, bw, None)
    if need is None:
        return
    p = pofo.solve(c, need, bw, slots=None)
    assert simulate(c, p, bw).peak_memory <= need
    if need - 1 > M:
        with pytest.raises(InfeasibleError):
            pofo.solve(c, need - 1, bw, slots=None)


MiB = 1 << 20


@pytest.mark.parametrize("seed", range(8))
def test_the_named_limit_passes_solve_on_the_slot_grid(seed):
    """Sizes in MiB (slots=50 rounds real byte counts up): below the bound and at it, a
    refusal names a limit solve plans at; its message prints sizes with format_bytes."""
    c = Chain.random(1 + seed % 5, seed=seed)
    c = c.replace(**{f: [v * MiB for v in getattr(c, f)]
                     for f in ("x", "xbar", "delta", "fw_tmp", "bw_tmp", "fck_tmp")})
    lo = pofo.min_memory(c)
    for M in (lo - MiB, lo, lo + MiB // 2):
        try:
            pofo.solve(c, M, MiB)
            continue
        except InfeasibleError as e:
            need, text = e.min_memory, str(e)
        assert need is not None and need > M
        assert f"{M} B (" in text and f"at {need} B (" in text, text   # format_bytes
        pofo.solve(c, need, MiB)


def test_the_slot_grid_message_prints_readable_sizes():
    # (it printed "no sequence fits memory 35651584 with slots=50 (... at 38797312 ...)")
    c = Chain.random(5, seed=5)
    c = c.replace(**{f: [v * MiB for v in getattr(c, f)]
                     for f in ("x", "xbar", "delta", "fw_tmp", "bw_tmp", "fck_tmp")})
    with pytest.raises(InfeasibleError) as e:
        pofo.solve(c, 34 * MiB, MiB)
    assert "fits memory 35651584 B (34.00 MiB) with slots=50" in str(e.value)
    assert f"at {e.value.min_memory} B (" in str(e.value)


def test_a_plan_found_one_byte_lower_is_not_lost():
    """At 54 the DP's plan, its transfers re-placed, takes 33 s; at 55 and 56 the DP gives the
    same plan, but a candidate (the DP for a slower link, 34 s) beat it before placement and
    it was dropped: 34 s for more memory. The placement search now starts from both."""
    times = [pofo.solve(SLOWER_AT_55, M, 0.5, slots=None).predicted_time for M in (54, 55, 56)]
    assert times == sorted(times, reverse=True) and times[0] == 33


@settings(max_examples=30, deadline=None, derandomize=True)
@given(c=chains(max_L=4), bw=st.sampled_from([0.5, 1.0, 2.0]), frac=st.floats(0, 1))
@example(c=SLOWER_AT_55, bw=0.5, frac=1 / 6)   # the limit 55
def test_solve_is_never_slower_than_the_papers_plan_with_its_transfers_re_placed(c, bw, frac):
    """The plan the improvement step starts from (the paper's pipeline: improve=False,
    model="paper"), its transfers re-placed by the local search, is a floor for solve."""
    lo, hi = pofo.min_memory(c), pofo.max_memory(c)
    M = max(1, round(lo + frac * (hi - lo)))
    try:
        paper = pofo.solve(c, M, bw, slots=None, improve=False, model="paper")
    except InfeasibleError:
        return
    placed = improve.improve_transfers(c, paper, M, bw)[1].makespan
    assert pofo.solve(c, M, bw, slots=None).predicted_time <= placed * (1 + 1e-12)


def test_autocapper_names_the_store_all_peak_where_rotors_least_fails(monkeypatch):
    """autocapper's error tried pofo's bound, then rotor's least limit alone: where neither
    works it named nothing. It takes the least of them and the store-all peak (where it
    finds the store-all plan) that works, checked."""
    c = Chain.random(2, seed=11)
    M = pofo.min_memory(c)   # autocapper fails here and one byte higher
    # rotor's least limit on the grid, as if autocapper failed there: one byte higher
    monkeypatch.setattr(pofo_heuristics, "_rotor_min", lambda chain, slots, memory: M + 1)
    with pytest.raises(InfeasibleError) as e:
        pofo.autocapper(c, M, 1.0, slots=None)
    need = e.value.min_memory
    assert need is not None and M + 1 < need <= pofo.max_memory(c)
    assert simulate(c, pofo.autocapper(c, need, 1.0, slots=None), 1.0).peak_memory <= need
