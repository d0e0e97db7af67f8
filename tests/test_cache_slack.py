"""bench/cache_slack.py: the rule that picks cache_slack's default (issue 12 step 4) on made-up
numbers, and the whole script on a tiny recorded-looking trace and on a bundled one."""
import json

import pytest

from bench import cache_slack as cs
from vmalloc.replay.trace import Event, Trace

MiB = 1 << 20


def _trace(name, ratios, remapped, step_s=0.1):
    """A replayed trace as run() leaves it: per candidate a ratio and, per step, the chunks
    remapped (the first step's are ignored by the rule)."""
    rows = []
    for s, ratio in ratios.items():
        per = [{"maps": 10 + n, "unmaps": n, "created": 10 if i == 0 else 0, "remapped": n}
               for i, n in enumerate(remapped[s])]
        rows.append({"cache_slack": s, "label": cs.label(s), "complete": True, "ratio": ratio,
                     "per_step": per})
    floor = ratios[0.0]
    return {"trace": name, "rows": rows, "step_seconds": step_s, "step_time_measured": True,
            "floor_ratio": floor,
            "ratio_limit": max(cs.RATIO_TARGET, floor) + cs.RATIO_TOLERANCE}


CANDS = (0.0, 0.05, 0.25, None)
RATIOS = {0.0: 1.01, 0.05: 1.06, 0.25: 1.26, None: 1.9}
REMAPS = {0.0: [50, 1000, 900], 0.05: [50, 800, 700], 0.25: [50, 300, 300], None: [0, 0, 0]}


def _decide(us_per_remap, traces=None, gpu=True):
    cost = {"gpu": gpu, "us_per_chunk_remapped": us_per_remap, "us_per_chunk_created": 100.0}
    traces = traces or [_trace("a", RATIOS, REMAPS)]
    for t in traces:
        for r in t["rows"]:
            cs.cost_of(r, cost, t["step_seconds"])
    return cs.decide(traces, cost, CANDS, real_traces=True, default=0.25)


def test_a_tiny_remap_cost_picks_the_largest_slack_that_keeps_memory_near_1_05():
    d = _decide(1.0)   # 800 chunks x 1 us = 0.8 ms of a 100 ms step
    assert d["found"] and d["meets_target"] and d["cache_slack"] == 0.05
    assert not d["provisional"] and d["change_default"]
    assert "0.80% of a step" in d["verdict"] and "the data says 0.05" in d["verdict"]


def test_a_huge_remap_cost_says_why_not_and_falls_back_to_no_cap():
    d = _decide(1000.0)   # 300 chunks x 1 ms = 300% of a step even at 0.25
    assert not d["meets_target"] and d["memory_candidate"] == 0.05
    assert d["found"] and d["cache_slack"] is None and d["label"] == "None (no cap)"
    assert "Why not" in d["verdict"] and "800.00% of a step" in d["verdict"]


def test_a_middling_cost_keeps_the_cheapest_slack_under_the_threshold():
    d = _decide(5.0)   # 0.05: 800 x 5 us = 4%; 0.25: 300 x 5 us = 1.5%
    assert not d["meets_target"] and d["cache_slack"] == 0.25 and not d["change_default"]
    assert "keep it" in d["verdict"]


def test_of_slacks_equal_on_the_worst_trace_the_loosest_is_taken():
    """0.25 and no cap reach the same ratio on the worst trace (1.3): 0.25's remaps buy
    memory only where it matters less; no cap is taken (no remaps)."""
    worst = _trace("worst", {0.0: 1.01, 0.05: 1.3, 0.25: 1.3, None: 1.3}, REMAPS)
    other = _trace("other", {0.0: 1.01, 0.05: 1.04, 0.25: 1.1, None: 1.2}, REMAPS)
    d = _decide(5.0, [worst, other])   # 0.05: 4%; 0.25: 1.5%; no cap: 0
    assert not d["meets_target"] and d["cache_slack"] is None
    assert "None (no cap) (worst 0.00%) has the least physical/requested peak on its worst " \
           "trace, 1.300 (worst) (0.25 reach the same there; the loosest remaps least)" in d["verdict"]


def test_memory_target_uses_the_worst_trace_and_the_slack_0_floor():
    # a trace whose slack-0 floor is 1.12 (chunk rounding): 0.05 is within floor + 0.02 there,
    # but on the other trace 0.05 reaches 1.08: only slack 0 fits both
    coarse = _trace("coarse", {0.0: 1.12, 0.05: 1.13, 0.25: 1.3, None: 2.0}, REMAPS)
    loose = _trace("loose", {0.0: 1.01, 0.05: 1.08, 0.25: 1.26, None: 1.9}, REMAPS)
    d = _decide(1.0, [coarse, loose])
    assert d["memory_candidate"] == 0.0 and d["cache_slack"] == 0.0


def test_host_numbers_are_provisional():
    d = _decide(1.0, gpu=False)
    assert d["provisional"] and d["verdict"].startswith("Provisional: no GPU measurement")


def test_remap_cost_prefers_the_cuda_rows(tmp_path):
    host = {"remap": [{"k": 2, "us_per_chunk_remapped": 5.0}], "fresh": []}
    c = cs.remap_cost({"host": host, "cuda": {"skipped": "no CUDA device"}})
    assert c["source"] == "host" and not c["gpu"] and c["us_per_chunk_remapped"] == 5.0
    cuda = {"device": "Fake GPU", "vmalloc_remap": [{"k": 2, "us_per_chunk_remapped": 30.0},
                                                    {"k": 8, "us_per_chunk_remapped": 40.0}],
            "vmalloc_fresh": [{"k": 1, "us_per_chunk_create_map_unmap_release": 90.0}]}
    c = cs.remap_cost({"host": host, "cuda": cuda})
    assert c["source"] == "cuda" and c["gpu"] and c["us_per_chunk_remapped"] == 40.0
    assert c["us_per_chunk_created"] == 90.0


def _tiny_gpu_trace(path):
    """Three steps of a static 4 MiB weight plus activations of 12, 6 and 10 MiB: a slack of 0
    remaps the cached chunks, no cap keeps creating."""
    ev, nid, starts = [Event("alloc", 0, 4 * MiB)], 1, []
    for step in range(3):
        starts.append(len(ev))
        ids = []
        for mib in (12, 6, 10):
            ev.append(Event("alloc", nid, (mib + step) * MiB))
            ids.append((nid, (mib + step) * MiB))
            nid += 1
        ev += [Event("free", i, n) for i, n in reversed(ids)]
    meta = {"real_gpu_trace": True, "step_starts": starts, "step_seconds": [0.5, 0.02, 0.02],
            "gpu": "Fake GPU", "model": "tiny", "batch": 1}
    Trace(ev, meta).save(path)


@pytest.fixture
def only_given_traces(tmp_path, monkeypatch):
    """The script reads --traces-dir, then bench/traces, which holds real GPU traces once a GPU
    session recorded them: these tests see only the traces they make."""
    empty = tmp_path / "no-bench"
    (empty / "traces").mkdir(parents=True)
    monkeypatch.setattr(cs, "HERE", str(empty))


def test_the_script_on_a_tiny_recorded_trace(tmp_path, monkeypatch, only_given_traces):
    monkeypatch.setattr(cs, "missing_gpu_traces", lambda paths: [])   # it stands for them all
    _tiny_gpu_trace(tmp_path / "tiny-b1-native-gpu.json.gz")
    micro = {"host": {"remap": [{"k": 2, "us_per_chunk_remapped": 5.0}], "fresh": []},
             "cuda": {"device": "Fake GPU",
                      "vmalloc_remap": [{"k": 2, "us_per_chunk_remapped": 20.0}],
                      "vmalloc_fresh": [{"k": 1, "us_per_chunk_create_map_unmap_release": 80.0}]}}
    (tmp_path / "am.json").write_text(json.dumps(micro))
    assert cs.main(["--traces-dir", str(tmp_path), "--alloc-micro", str(tmp_path / "am.json"),
                    "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "cache_slack.json").read_text())
    assert d["traces_used"] == "recorded on a GPU" and d["remap_cost"]["source"] == "cuda"
    (t,) = d["traces"]
    assert t["steps"] == 3 and t["step_cut"].startswith("recorded")
    assert t["step_seconds"] == pytest.approx(0.02) and t["step_time_measured"]
    by = {r["label"]: r for r in t["rows"]}
    assert set(by) == {cs.label(s) for s in cs.CANDIDATES}
    for r in t["rows"]:   # the set-up (the weight, before step 0) and the steps add up
        assert len(r["per_step"]) == 3 and r["setup"]["created"] == 2
        assert sum(s["maps"] for s in r["per_step"]) + r["setup"]["maps"] == r["maps"]
        assert sum(s["created"] for s in r["per_step"]) + r["setup"]["created"] == r["created"]
    # the steady steps are those after the first training step (which fills the cache)
    free_run = {r["label"]: r for r in t["rows"]}["None (no cap)"]
    first, *rest = free_run["per_step"]
    assert first["created"] == 14   # 12 + 6 + 10 MiB in 2 MiB chunks
    assert free_run["steady_created_max"] == max(s["created"] for s in rest) < 14
    assert by["0"]["ratio"] <= by["None (no cap)"]["ratio"]
    assert by["0"]["unmaps"] > 0 and by["None (no cap)"]["unmaps"] == 0
    assert not d["decision"]["provisional"] and d["verdict"] == d["decision"]["verdict"]
    assert d["meta"]["remap_cost_measured_on"] == "Fake GPU"


def test_quick_run_on_a_bundled_trace_says_provisional(tmp_path, capsys):
    assert cs.main(["--quick", "--cpu-traces", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "cache_slack.json").read_text())
    assert d["traces_used"].startswith("bundled") and d["decision"]["provisional"]
    assert "no real GPU traces" in d["verdict"]
    assert d["traces"][0]["step_cut"].startswith("where no allocation is live")
    assert "Provisional" in capsys.readouterr().out


def test_prefer_remap_is_slack_0_without_a_budget():
    """Why the script has no prefer_remap axis."""
    import vmalloc
    from vmalloc.replay import replay

    sizes = [m * MiB for m in (3, 9, 5, 12, 7, 20, 4)]
    ev = [Event("alloc", 0, sizes[0])]
    for i in range(1, len(sizes)):   # each allocation lives until the next one's successor
        ev += [Event("alloc", i, sizes[i]), Event("free", i - 1, sizes[i - 1])]
    t = Trace(ev, {})
    stats = []
    for kw in ({"cache_slack": 0.0}, {"prefer_remap": True, "cache_slack": 0.25}):
        with vmalloc.Allocator("host", chunk_size=2 * MiB, **kw) as a:
            stats.append({k: v for k, v in replay(t, a).stats.items() if k.startswith("num_")
                          or k.endswith("_peak")})
    assert stats[0] == stats[1]


def test_step_time_from_a_gpu_e2e_result(tmp_path):
    rows = [{"model": "gpt2-s1024", "batch_size": 8, "method": "native", "throughput": 16384.0,
             "unit": "tokens/s"},
            {"model": "resnet50", "batch_size": 256, "method": "native", "throughput": 512.0,
             "unit": "images/s"}]
    (tmp_path / "e2e-cpu-x.json").write_text(json.dumps({"meta": {"gpu": "cpu"}, "results": rows}))
    assert cs.e2e_step_seconds("resnet50", 256, str(tmp_path)) is None   # CPU numbers: no
    (tmp_path / "e2e-H100-x.json").write_text(json.dumps({"meta": {"gpu": "H100"}, "results": rows}))
    secs, how = cs.e2e_step_seconds("resnet50", 256, str(tmp_path))
    assert secs == pytest.approx(0.5) and "H100" in how
    assert cs.e2e_step_seconds("gpt2-s1024", 8, str(tmp_path))[0] == pytest.approx(0.5)
    assert cs.e2e_step_seconds("bert-dyn", 8, str(tmp_path)) is None


def test_a_tighter_slack_that_remaps_less_is_taken_when_the_largest_costs_too_much():
    remaps = {**REMAPS, 0.0: [50, 200, 200], 0.05: [50, 800, 700]}
    d = _decide(5.0, [_trace("a", RATIOS, remaps)])   # 0: 1%, 0.05: 4%
    assert d["meets_target"] and d["cache_slack"] == 0.0
    assert "0.05 keeps the memory target too, but its remaps cost 4.00% of a step" in d["verdict"]


def test_traces_without_time_left_are_left_out_and_said_so(tmp_path, only_given_traces):
    _tiny_gpu_trace(tmp_path / "a-gpu.json.gz")
    _tiny_gpu_trace(tmp_path / "b-gpu.json.gz")
    micro = {"cuda": {"device": "Fake GPU",
                      "vmalloc_remap": [{"k": 2, "us_per_chunk_remapped": 20.0}]}}
    (tmp_path / "am.json").write_text(json.dumps(micro))
    # the call's end has passed: the first trace still runs, the second is left out
    assert cs.main(["--traces-dir", str(tmp_path), "--alloc-micro", str(tmp_path / "am.json"),
                    "--out", str(tmp_path), "--stop-at", "0"]) == 0
    d = json.loads((tmp_path / "cache_slack.json").read_text())
    assert len(d["traces"]) == 1 and len(d["left_out"]) == 1
    assert d["decision"]["provisional"] and "left out for time" in d["verdict"]


def test_provisional_data_never_asks_for_a_new_default():
    # host remap costs (no GPU): the choice is said, but the default changes on a GPU's data
    d = _decide(1.0, gpu=False)
    assert d["provisional"] and d["cache_slack"] == 0.05 and not d["change_default"]
    assert "this provisional data says 0.05" in d["verdict"]


def test_gpu_traces_of_some_jobs_only_are_provisional(tmp_path, only_given_traces):
    """A traces step cut short records some of record_gpu.py's jobs: a decision on those would
    stand for all of them."""
    from bench.traces.record_gpu import JOBS
    _tiny_gpu_trace(tmp_path / f"{JOBS[0].stem}.json.gz")
    micro = {"cuda": {"device": "Fake GPU",
                      "vmalloc_remap": [{"k": 2, "us_per_chunk_remapped": 20.0}]}}
    (tmp_path / "am.json").write_text(json.dumps(micro))
    assert cs.main(["--traces-dir", str(tmp_path), "--alloc-micro", str(tmp_path / "am.json"),
                    "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "cache_slack.json").read_text())
    assert d["decision"]["provisional"] and not d["decision"]["change_default"]
    why = " ".join(d["decision"]["provisional_why"])
    assert f"no GPU trace yet of {JOBS[1].stem}" in why and JOBS[0].stem not in why
