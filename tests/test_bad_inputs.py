"""Errors that name the parameter and its value (issue 16 item 10): one case per bad input."""
import json

import numpy as np
import pytest

from scheduler import Chain, InfeasibleError, Op, Plan
from scheduler.planners import revolve, rotor

CHAIN = Chain.random(5, seed=1)
FRACTIONAL = Chain(fw=[1.0, 1, 1], bw=[1.0, 1, 1], x=[1.5, 2.5, 1.5], xbar=[3.5, 3.5, 2.5],
                   delta=[1.5, 2.5, 1.5])
HUGE = Chain.random(3, max_size=2**62)
GOOD = {"fw": [1], "bw": [1], "x": [1], "xbar": [1], "delta": [1]}
GOOD3 = {k: [1] * 3 for k in GOOD}


def chain_json(**change):
    return json.dumps(dict(GOOD, **change))


@pytest.mark.parametrize("call, error, match", [
    (lambda: rotor.solve(CHAIN, 100, slots=1), ValueError, r"slots=1 is too few .* slots >= 6"),
    (lambda: revolve.solve(CHAIN, 100, slots=2), ValueError, r"slots=2 is too few"),
    (lambda: rotor.solve(CHAIN, 1e-300), InfeasibleError,
     r"memory=1e-300 B with 500 slots; the smallest memory that works is 43 B"),
    (lambda: rotor.solve(FRACTIONAL, 1e-300), InfeasibleError, r"memory=1e-300 .* is 11\.5"),
    (lambda: rotor.solve(CHAIN, 1e-300, slots=None), InfeasibleError,
     r"memory=1e-300 B with exact units"),
    (lambda: rotor.solve(HUGE, 2**63, slots=None), ValueError,
     r"slots=None \(exact units\): Chain\.x\[0\]=\d+ is too large"),
    (lambda: rotor.solve(CHAIN, 0), ValueError, r"memory: must be a positive finite number of bytes"),
    (lambda: rotor.solve(CHAIN, 100, slots=0), ValueError, r"slots: expected a positive int"),
    (lambda: Op("bogus", 1), ValueError, r"Op: unknown kind 'bogus'"),
    (lambda: Op("B", -1), ValueError, r"Op: stage must be a non-negative int, got -1"),
    (lambda: Plan.from_json("{}"), ValueError, r"Plan: missing field 'ops'"),
    (lambda: Plan.from_json("[]"), ValueError, r"Plan: expected a JSON object, got list"),
    (lambda: Plan.from_json("nope"), ValueError, r"Plan\.from_json: not JSON"),
    (lambda: Plan.from_json('{"ops": 3}'), ValueError, r"Plan\.ops: expected a list"),
    (lambda: Plan.from_json('{"ops": [["B", "x"]]}'), ValueError,
     r"Plan\.ops\[0\]: stage must be a non-negative int, got 'x'"),
    (lambda: Plan.from_json('{"ops": [7]}'), ValueError, r"Plan\.ops\[0\]: expected \(kind"),
    (lambda: Plan.from_json('{"ops": [], "planner": 1}'), ValueError, r"Plan\.planner"),
    (lambda: Plan.from_json('{"ops": [], "predicted_time": "x"}'), ValueError,
     r"Plan\.predicted_time: expected a number"),
    (lambda: Plan.from_json('{"ops": [], "meta": [1]}'), ValueError, r"Plan\.meta"),
    (lambda: Chain.from_json(chain_json(fw=3)), ValueError, r"Chain\.fw: expected a sequence"),
    (lambda: Chain.from_json(chain_json(x={})), ValueError, r"Chain\.x: expected a sequence"),
    (lambda: Chain.from_json(chain_json(bw="1")), ValueError, r"Chain\.bw: expected a sequence"),
    (lambda: Chain.from_json(chain_json(fw=["a"])), ValueError,
     r"Chain\.fw\[0\]: expected a number, got 'a'"),
    (lambda: Chain.from_json(chain_json(xbar=[None])), ValueError, r"Chain\.xbar\[0\]"),
    (lambda: Chain.from_json(chain_json(name=5)), ValueError, r"Chain\.name: expected a string"),
    (lambda: Chain.from_json(chain_json(meta=3)), ValueError, r"Chain\.meta: expected an object"),
    (lambda: Chain.from_json("[1]"), ValueError, r"Chain: expected a JSON object, got list"),
    (lambda: Chain.from_json("{nope"), ValueError, r"Chain\.from_json: the text is not JSON"),
    (lambda: Chain.from_json("/nonexistent/chain.json"), ValueError,
     r"cannot read '/nonexistent/chain\.json'"),
    # numpy values: what .item() gives must be a number too, and a 0-d array is no sequence
    # (were TypeErrors "must be real number, not str" / "len() of unsized object", and
    # np.True_ was taken as 1 where True is refused)
    (lambda: Chain(**dict(GOOD3, fw=np.array(["1", "2", "3"]))), ValueError,
     r"Chain\.fw\[0\]: expected a number, got np\.str_\('1'\)"),
    (lambda: Chain(**dict(GOOD3, fw=np.array(3))), ValueError,
     r"Chain\.fw: expected a sequence of numbers, got array\(3\)"),
    (lambda: Chain(**dict(GOOD3, fw=[np.True_, 1, 1])), ValueError,
     r"Chain\.fw\[0\]: expected a number, got np\.True_"),
    (lambda: Chain(**dict(GOOD3, x=[True, 1, 1])), ValueError,
     r"Chain\.x\[0\]: expected a number, got True"),
    (lambda: Chain(**dict(GOOD3, x=[1, np.float32("nan"), 1])), ValueError,
     r"Chain\.x\[1\]: must be finite and non-negative, got nan"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_numpy_values_are_still_taken():
    c = Chain(**dict(GOOD3, fw=np.array([1, 2, 3]), x=np.array([1.5, 2, 3], dtype=np.float32),
                     xbar=[np.int64(1), np.uint8(2), 3]))
    assert c.fw == (1, 2, 3) and c.x == (1.5, 2.0, 3.0) and c.xbar == (1, 2, 3)
    assert all(type(v) is int for v in c.fw + c.xbar)
    with pytest.raises(ValueError, match=r"Chain\.x\[0\]: an int of \d+ bits is too large for a float"):
        Chain(**dict(GOOD3, x=[10 ** 400, 1, np.int64(1)]))  # (refused by name, no overflow)


def test_a_good_chain_and_plan_still_round_trip():
    plan = rotor.solve(CHAIN, 100)
    assert Plan.from_json(plan.to_json()) == plan
    assert Chain.from_json(CHAIN.to_json()) == CHAIN
    assert rotor.solve(CHAIN, 2**70, slots=None).predicted_time == CHAIN.total_compute()
