import pytest

from scheduler import Chain, Plan


def test_chain_roundtrip_and_validation():
    c = Chain.random(5, seed=3)
    assert c.L == 5 and c.is_integer
    assert Chain.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match=r"Chain.bw: length 2"):
        Chain(fw=[1, 1, 1], bw=[1, 1], x=[1, 1, 1], xbar=[1, 1, 1], delta=[1, 1, 1])
    with pytest.raises(ValueError, match=r"Chain.x\[1\]"):
        Chain(fw=[1, 1], bw=[1, 1], x=[1, -2], xbar=[1, 1], delta=[1, 1])


def test_fck_tmp_defaults_to_fw_tmp_and_round_trips():
    c = Chain(fw=[1, 1], bw=[1, 1], x=[2, 3], xbar=[4, 0], delta=[2, 3], fw_tmp=[5, 0])
    assert c.fck_tmp == c.fw_tmp == (5, 0)
    assert "fck_tmp" not in c.to_dict()  # the default is not written: old files read the same
    assert Chain.from_json(c.to_json()) == c
    # a defaulted fck_tmp follows fw_tmp through replace; a given one stays
    assert c.replace(fw_tmp=[7, 1]).fck_tmp == (7, 1)
    d = c.replace(fck_tmp=[9, 0])
    assert d.to_dict()["fck_tmp"] == [9, 0] and Chain.from_json(d.to_json()) == d
    assert d.replace(fw_tmp=[7, 1]).fck_tmp == (9, 0)
    # positional construction keeps its meaning (fck_tmp comes after name and meta)
    assert Chain([1], [1], [2], [0], [2], [3], [4], "n").fck_tmp == (3,)
    with pytest.raises(ValueError, match="fck_tmp"):
        c.replace(fck_tmp=[1])
    r = Chain.random(4, seed=3, split_tmp=True)
    assert r.fck_tmp != r.fw_tmp and Chain.random(4, seed=3).x == r.x


def test_plan_validation_and_json():
    p = Plan([("F_all", 0), ("B", 0)], planner="test", predicted_time=2)
    assert Plan.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match=r"ops\[1\]: unknown kind 'Fwd'"):
        Plan([("F_all", 0), ("Fwd", 1)])


def test_a_plan_carries_its_bandwidth_to_simulate_and_describe():
    from scheduler import InvalidPlanError, simulate
    from scheduler.planners import offload
    chain = Chain.random(6, seed=1)
    plan = offload.dynprog(chain, 0.6 * (chain.x[0] + sum(chain.xbar)), 12e9)
    assert plan.count("offload") > 0
    plan.bandwidth = 12e9  # (the planners record it themselves)
    assert simulate(chain, plan).makespan == simulate(chain, plan, 12e9).makespan
    assert "bandwidth 1.2e+10 B/s" in plan.describe(chain)  # simulated: no bandwidth needed
    with pytest.raises(InvalidPlanError, match="bandwidth"):
        simulate(chain, plan, None)  # None still means: no transfer channel
    back = Plan.from_json(plan.to_json())
    assert back.bandwidth == 12e9 and back == plan
    for bad in (0, -1.0, float("nan"), True, "12GB"):
        with pytest.raises(ValueError, match=r"Plan\.bandwidth: .* got"):
            Plan([("F_all", 0), ("B", 0)], bandwidth=bad)


def test_a_plan_with_instant_transfers_writes_strict_json():
    import json
    plan = Plan([("F_all", 0), ("B", 0)], bandwidth=float("inf"))
    text = plan.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert Plan.from_json(text).bandwidth == float("inf")


def test_chain_json_files_by_pathlib_path(tmp_path):
    """A ``pathlib.Path`` is a path (before, ``from_json`` refused it), even one whose name
    starts like JSON text."""
    c = Chain.random(4, seed=1)
    for name in ("chain.json", "{odd}.json"):
        c.to_json(tmp_path / name)
        assert Chain.from_json(tmp_path / name) == c


@pytest.mark.parametrize("L", [-1, True, 2.0, "3"])
def test_checkpoint_plan_refuses_a_bad_block_count(L):
    """Its ops are made unchecked (twice as fast: Mimose makes one per new input size), so
    the block count they come from is checked once, named."""
    from scheduler.plan import checkpoint_plan
    with pytest.raises(ValueError, match=r"checkpoint_plan: L must be a non-negative int"):
        checkpoint_plan(L, [])
    assert [tuple(op) for op in checkpoint_plan(2, [0]).ops] == [
        ("F_ck", 0), ("F_all", 1), ("F_all", 2), ("B", 2), ("B", 1), ("F_all", 0), ("B", 0)]
