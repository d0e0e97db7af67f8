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


def test_plan_validation_and_json():
    p = Plan([("F_all", 0), ("B", 0)], planner="test", predicted_time=2)
    assert Plan.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match=r"ops\[1\]: unknown kind 'Fwd'"):
        Plan([("F_all", 0), ("Fwd", 1)])
