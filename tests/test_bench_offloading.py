"""bench/offloading.py on a DYNPROG that fell back to GREEDY: the planner then has no DP value
(``meta["relaxed_time"]`` is None, strict JSON), and the bench must count it, not crash on it."""
import os

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture
def offloading(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)   # the bench imports its siblings as top-level modules
    import offloading
    return offloading


def test_a_greedy_fallback_is_counted_not_divided(offloading, monkeypatch):
    from scheduler import Chain
    chain = Chain.from_json(os.path.join(BENCH, "chains", "resnet18-i224-b32.json"))
    real = offloading.offload.dynprog
    calls = []

    def first_falls_back(*args, **kwargs):
        plan = real(*args, **kwargs)
        if not calls and "transfer_chunk" not in kwargs:
            plan.meta["relaxed_time"] = None   # what dynprog records when it fell back
        calls.append(kwargs)
        return plan

    monkeypatch.setattr(offloading.offload, "dynprog", first_falls_back)
    rows = offloading.run_chain(chain, points=2, slots=50, vdnn_max_L=0)["rows"]
    assert [r["dynprog_relaxed"] is None for r in rows] == [True, False]
    summary = offloading.summary_of(rows)
    assert summary["dynprog_fallbacks"] == 1
    assert summary["dynprog_relaxed_max_ratio"] == rows[1]["dynprog_relaxed"]
