"""Plan.to_json writes strict JSON: pofo's plans where no DP found a sequence carried
dp_time = dp_value = inf in meta, written as ``Infinity`` (which strict parsers and other
languages refuse). Those values are None now, and to_json refuses a non-finite number,
naming where it is, so it cannot come back unseen."""
import json
import math
import re

import pytest

from scheduler import Chain, Plan
from scheduler.planners import pofo


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_pofos_plan_without_a_dp_value_is_strict_json():
    c = Chain.random(1, seed=1)
    p = pofo.solve(c, 29, 1)     # the DP's 50-slot grid finds nothing: a heuristic's plan
    assert p.meta["dp_time"] is None and p.meta["dp_value"] is None
    assert p.meta["paper_dp_value"] is None
    d = _strict(p.to_json())
    assert d["meta"]["dp_value"] is None
    back = Plan.from_json(p.to_json())
    assert back.ops == p.ops and back.memory_limit == p.memory_limit


@pytest.mark.parametrize("meta, where", [
    ({"t": math.inf}, "plan.meta.t = inf"),
    ({"runs": [1.0, {"x": -math.inf}]}, "plan.meta.runs[1].x = -inf"),
    ({"v": math.nan}, "plan.meta.v = nan"),
])
def test_to_json_refuses_a_non_finite_number_naming_it(meta, where):
    plan = Plan([("F_all", 0), ("B", 0)], meta=meta)
    with pytest.raises(ValueError, match=re.escape(f"Plan.to_json: {where} is not finite")):
        plan.to_json()


def test_an_instant_channel_still_round_trips():
    # (bandwidth inf is written as the string "inf", as before)
    text = Plan([("F_all", 0), ("B", 0)], bandwidth=math.inf).to_json()
    assert _strict(text)["bandwidth"] == "inf" and Plan.from_json(text).bandwidth == math.inf
