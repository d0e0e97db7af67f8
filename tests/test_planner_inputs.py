"""The planners' and the simulator's inputs: bad ones are named, and an integer memory limit
is kept to the byte."""
import math

import pytest

from scheduler import Chain, Plan, simulate
from scheduler.errors import InvalidPlanError
from scheduler.planners import best, offload, periodic, rotor
from scheduler.planners.swap_schedule import VariableSequence


@pytest.mark.parametrize("memory, match", [
    (math.nan, "memory: must be a positive finite number of bytes, got nan"),
    (-1, "memory: must be a positive finite number of bytes, got -1"),
    ("abc", "memory: cannot read 'abc' as a byte size"),
])
def test_periodic_best_names_a_bad_memory(memory, match):
    with pytest.raises(ValueError, match=match):
        periodic.best(Chain.random(3, seed=1), memory)


def test_periodic_best_reads_a_size_string():
    c = Chain.random(3, seed=1)
    assert periodic.best(c, "16GiB").ops == periodic.best(c, 16 << 30).ops


@pytest.mark.parametrize("d, match", [
    ({"sizes": [1]}, r"missing field\(s\) \['steps'\]"),
    ([1, 2], "expected a JSON object, got list"),
    ({"steps": [0, 1], "sizes": [1, 1]}, r"steps\[0\]: expected a sequence of variable ids, got 0"),
    ({"steps": [[0]], "sizes": [1], "times": [math.nan]}, r"times\[0\]: .* got nan"),
    ({"steps": [[0]], "sizes": [1], "times": [-1.0]}, r"times\[0\]: .* got -1.0"),
    ({"steps": [[0]], "sizes": [1], "times": ["x"]}, r"times\[0\]: .* got 'x'"),
])
def test_variable_sequence_names_bad_fields(d, match):
    with pytest.raises(ValueError, match=match):
        VariableSequence.from_dict(d)


@pytest.mark.parametrize("value", [math.nan, -1.0])
def test_plan_from_dict_refuses_a_nan_or_negative_prediction(value):
    with pytest.raises(ValueError, match=r"Plan.predicted_time: expected a number >= 0 or null"):
        Plan.from_dict({"ops": [], "predicted_time": value})


def test_an_integer_limit_is_kept_to_the_byte():
    # 1e-9 of 10 GB is 10 bytes: a relative tolerance let this plan through at limit + 1
    c = Chain(fw=[1, 1], bw=[1, 1], x=[10 ** 10, 1], xbar=[1, 0], delta=[0, 0])
    plan = Plan([("F_all", 0), ("F_all", 1), ("B", 1), ("B", 0)], memory_limit=10 ** 10)
    with pytest.raises(InvalidPlanError, match="needs 1 more but 10000000000 of the limit "
                                               "10000000000 is in use"):
        simulate(c, plan)
    assert simulate(c, plan, memory=10 ** 10 + 1).peak_memory == 10 ** 10 + 1


def test_offload_plans_keep_an_integer_limit_to_the_byte():
    # greedy planned 1000001008 bytes under a limit of 1000001007 through that tolerance
    c = Chain(fw=(3, 3, 0), bw=(3, 7, 2), x=(1000, 2, 0), xbar=(1000, 2, 5),
              delta=(0, 5, 10 ** 9), fw_tmp=(2, 5, 1000), bw_tmp=(0, 0, 1),
              fck_tmp=(5, 10 ** 9, 10 ** 9))
    m = 1000001007
    for planner in (offload.greedy, offload.dynprog, offload.vdnn):
        plan = planner(c, m, 3)
        assert plan.predicted_peak == simulate(c, plan, 3).peak_memory <= m


@pytest.mark.parametrize("slots", [None, 500])
def test_a_chain_of_zeros_has_a_least_limit_that_solve_takes(slots):
    from scheduler.planners import rotor
    c = Chain(fw=[1, 2], bw=[1, 2], x=[0, 0], xbar=[0, 0], delta=[0, 0])
    least = rotor.min_memory(c, slots=slots)  # was 0 (refused by solve) or a ZeroDivisionError
    assert least == 1
    assert simulate(c, rotor.solve(c, least, slots=slots)).peak_memory == 0


def test_every_planner_takes_its_least_limit_on_a_chain_of_zeros():
    from scheduler.planners import pofo
    c = Chain(fw=[1, 2], bw=[1, 2], x=[0, 0], xbar=[0, 0], delta=[0, 0])
    for least, solve in ((pofo.min_memory(c), lambda m: pofo.solve(c, m, 1)),
                         (offload.min_memory(c), lambda m: offload.dynprog(c, m, 1)),
                         (offload.min_memory(c), lambda m: offload.greedy(c, m, 1))):
        assert least == 1
        assert simulate(c, solve(least)).peak_memory == 0
        with pytest.raises(ValueError, match="memory: must be a positive finite number of bytes, got 0"):
            solve(0)  # (was a ZeroDivisionError in the slot grids)


def test_vdnn_without_a_transfer_channel_offloads_nothing():
    c = Chain.random(4, seed=3)
    plan = offload.vdnn(c, offload.peak_memory(c), 0)  # was a ZeroDivisionError
    assert plan.count("offload") == 0 and plan.bandwidth is None


def test_transferring_planners_record_their_bandwidth():
    from scheduler.planners import pofo
    c = Chain.random(6, seed=1)
    m = 0.6 * (c.x[0] + sum(c.xbar))
    for plan in (offload.greedy(c, m, 12e9), offload.dynprog(c, m, "12GB/s"),
                 pofo.solve(c, m, 12e9)):
        if plan.count("offload"):
            assert plan.bandwidth == 12e9
            assert simulate(c, plan).makespan == plan.predicted_time  # at its own bandwidth
        else:
            assert plan.bandwidth is None


def test_pofo_predicts_the_time_of_the_plan_it_returns():
    # the improvement step replaced the DP's candidate; the DP's time stayed as the prediction
    from scheduler.planners import pofo
    c = Chain(fw=(1, 2, 2, 1), bw=(0, 2, 0, 3), x=(4, 4, 4, 4), xbar=(4, 4, 4, 4),
              delta=(4, 4, 4, 4), fw_tmp=(0, 0, 4, 0), bw_tmp=(4, 0, 4, 0), fck_tmp=(4, 4, 4, 4))
    plan = pofo.solve(c, 24, 0.5)
    assert plan.predicted_time == simulate(c, plan, 0.5).makespan


def test_pofo_names_a_limit_that_works_when_the_slot_grid_fails():
    from scheduler import InfeasibleError
    from scheduler.planners import pofo
    failed = 0
    for seed in range(40):
        c = Chain.random(5, seed=seed)
        m = pofo.min_memory(c)  # a bound in exact units: slots=50 may need more
        try:
            pofo.solve(c, m, 1)
            continue
        except InfeasibleError as e:
            need = e.min_memory
        failed += 1
        assert need > m
        assert simulate(c, pofo.solve(c, need, 1), 1).peak_memory <= need
    assert failed > 0  # (the case this test is about happens on these chains)


def test_mimose_refuses_a_nan_or_negative_measurement():
    from scheduler.planners.mimose import Mimose
    m = Mimose(2)
    for xbar in ([1.0, math.nan], [1.0, -2.0]):
        with pytest.raises(ValueError, match="Estimator.observe: measurements at input size 10"):
            m.observe(10, 100.0, xbar, [1.0, 1.0], [1e-3, 1e-3])


def test_the_least_limit_search_ends_for_a_fractional_limit_on_an_integer_chain(monkeypatch):
    # the bisection in whole bytes started from a fractional limit, and its mid stuck at lo
    from scheduler import InfeasibleError
    from scheduler.planners import rotor
    c = Chain(fw=[0.5, 1, 1, 0, 1, 1e6, 1e-9], bw=[1e6, 0.5, 0, 0, 0.7, 0, 3],
              x=[1, 1, 5, 0, 1, 1, 0], xbar=[1, 2, 2, 5, 2, 1, 5], delta=[1, 0, 1, 1, 1, 1, 2],
              fw_tmp=[1, 1, 2, 1, 1, 5, 1], bw_tmp=[1, 0, 5, 1, 2, 5, 0],
              fck_tmp=[2, 1, 1, 1, 1, 1, 5])
    discretize, calls = rotor.discretize, []

    def counted(*args, **kwargs):
        calls.append(args[1])
        assert len(calls) < 500, f"the search does not end: last limits {calls[-4:]}"
        return discretize(*args, **kwargs)
    monkeypatch.setattr(rotor, "discretize", counted)
    for k in range(40):
        calls.clear()
        try:
            rotor.solve(c, 14 + 8 * k / 39, slots=7)
        except InfeasibleError:
            pass


MiB = 1 << 20


def _in_mib(c):
    return c.replace(**{f: [v * MiB for v in getattr(c, f)]
                        for f in ("x", "xbar", "delta", "fw_tmp", "bw_tmp", "fck_tmp")})


@pytest.mark.parametrize("planners", [None, ["greedy"], ["dynprog", "autocapper"]])
def test_best_names_a_limit_above_the_refused_one_that_works(planners):
    """best.solve named the limit it refused ("the smallest limit one of them can meet is
    33554432" at 33554432, the MiB chain of Chain.random(2, seed=0)): autocapper named pofo's
    bound, and best took the least any planner named (L = 2, seed 11 at 43 MiB today). It
    names one it then meets, or None."""
    from scheduler import InfeasibleError
    from scheduler.planners import pofo
    failed = 0
    for L in (1, 2, 3):
        for seed in range(12):
            c = _in_mib(Chain.random(L, seed=seed))
            lo = pofo.min_memory(c)
            for m in (lo - MiB, lo):
                try:
                    best.solve(c, m, MiB, planners=planners)
                    continue
                except InfeasibleError as e:
                    need, text = e.min_memory, str(e)
                failed += 1
                if need is None:
                    assert "none of them named a limit that works" in text
                    continue
                assert need > m
                assert simulate(c, best.solve(c, need, MiB, planners=planners)).peak_memory <= need
    assert failed >= 6


@pytest.mark.parametrize("call, match", [
    (lambda c: rotor.solve(c, 2 ** 1024),
     r"memory: must be a positive finite number of bytes, got 17976931348623159\d+\.\.\. "
     r"\(309 characters\) \(too large for a float\)"),
    (lambda c: offload.greedy(c, 60, 10 ** 400),
     r"offload\.greedy: bandwidth must be non-negative bytes/s .* got 1000+\.\.\. "
     r"\(401 characters\) \(too large for a float\)"),
    (lambda c: simulate(c, periodic.solve(c, 1), memory=10 ** 400),
     r"memory: must be a non-negative finite number of bytes, got 1000+\.\.\."),
    (lambda c: periodic.best(c, 10 ** 400), r"memory: must be a positive finite number"),
])
def test_a_limit_or_rate_past_a_float_is_named(call, match):
    # (was OverflowError: int too large to convert to float)
    with pytest.raises(ValueError, match=match):
        call(Chain.random(5, seed=3))


def test_numpy_limits_and_segments_are_taken_as_numbers():
    np = pytest.importorskip("numpy")
    from scheduler.planners import pofo
    c = Chain.random(5, seed=3)
    want = rotor.solve(c, 100)
    for m in (np.int64(100), np.float32(100), np.float64(100.0), np.uint16(100)):
        got = rotor.solve(c, m)   # was "memory: expected a number, got np.int64(100)"
        assert got.ops == want.ops and got.memory_limit == 100
    assert type(rotor.solve(c, np.int64(100)).memory_limit) is int   # ints stay ints
    assert pofo.solve(c, np.int64(60), np.float32(1)).ops == pofo.solve(c, 60, 1).ops
    assert best.solve(c, np.int64(60), np.int64(1)).ops == best.solve(c, 60, 1).ops
    assert periodic.solve(c, np.int64(2)).ops == periodic.solve(c, 2).ops
    for bad in (np.True_, True):
        with pytest.raises(ValueError, match="memory: expected a number"):
            rotor.solve(c, bad)
        with pytest.raises(ValueError, match="segments: expected an int"):
            periodic.solve(c, bad)


@pytest.mark.parametrize("call, match", [
    (lambda c: rotor.solve(c, 60, slots=2 ** 63),
     r"slots: at most 2\*\*50 .* got 9223372036854775808"),
    (lambda c: offload.dynprog(c, 60, 1, slots=10 ** 30), r"slots: at most 2\*\*50"),
    (lambda c: rotor.min_memory(c, 10 ** 30),
     r"slots: at most 2\*\*50"),
    (lambda c: best.solve(c, 60, 1, planners=5),
     r"planners: expected a non-empty list of rotor, .* got 5"),
    (lambda c: periodic.best(None), r"chain: expected a scheduler\.Chain, got NoneType"),
])
def test_a_bad_slot_count_planner_list_or_chain_is_named(call, match):
    # (were nanobind's TypeError, "'int' object is not iterable" and an AttributeError)
    with pytest.raises(ValueError, match=match):
        call(Chain.random(5, seed=3))
