"""Report math (seed 003 Eq. 1-2, GMLake fragmentation) on known traces; text/JSON; CLI."""
import json

import pytest

import vmalloc
from vmalloc import report as _report_fn  # the function
from vmalloc.cli import main
from vmalloc.pluggable import live_report
from vmalloc.replay import Event, Trace, compare
from vmalloc.replay.run import Contender, caching_factory

from vmalloc import report_format as rpt
MiB = 1 << 20


def test_histogram_bins():
    h = rpt.histogram([1, 511, 512, 1023, 1024, 3 * MiB])
    assert [(b["lo"], b["hi"], b["count"]) for b in h] == [
        (0, 512, 2), (512, 1024, 2), (1024, 2048, 1), (2 * MiB, 4 * MiB, 1)]
    assert sum(b["bytes"] for b in h) == 1 + 511 + 512 + 1023 + 1024 + 3 * MiB


@pytest.mark.parametrize("m_r,m_c,expected", [(1, 2 * MiB, 2 * MiB - 1), (2 * MiB, 2 * MiB, 0),
                                               (5 * MiB, 2 * MiB, MiB), (41 * MiB, 40 * MiB, 39 * MiB)])
def test_eq1(m_r, m_c, expected):
    assert rpt.eq1_internal_fragmentation(m_r, m_c) == expected
    assert rpt.eq1_internal_fragmentation(m_r, m_c) < m_c


def test_build_on_known_stats():
    stats = {"requested_current": 3 * MiB, "requested_peak": 10 * MiB, "mapped_current": 4 * MiB,
             "mapped_peak": 12 * MiB, "physical_current": 6 * MiB, "physical_peak": 16 * MiB,
             "num_malloc": 7, "num_free": 5, "num_map": 8, "num_unmap": 2, "num_cache_hits": 3,
             "num_remaps": 4, "chunk_size": 2 * MiB, "driver_seconds": 0.25}
    r = rpt.build(stats, source="vmalloc", sizes=[MiB, 3 * MiB], if_peak=3 * MiB, n_max=4)
    fr = r["fragmentation"]
    assert fr["internal_current"] == MiB
    assert fr["ratio_physical_requested"] == pytest.approx(1.6)
    assert fr["gmlake"] == pytest.approx(1 - 10 / 16)
    assert fr["bound_eq2"] == 8 * MiB and fr["bound_holds"] is True
    text = rpt.to_text(r)
    for needle in ("requested", "physical", "Eq. 1", "Eq. 2", "4 x 2.00 MiB = 8.00 MiB holds",
                   "3 cache hits (42.9%)", "8 map, 2 unmap, 0.2500 s", "37.5%"):
        assert needle in text, needle


def test_report_on_a_known_trace_through_the_model():
    # 3 MiB alloc -> 20 MiB segment; 12 MiB alloc -> split from the same segment's 17 MiB rest
    t = Trace([Event("alloc", 0, 3 * MiB), Event("alloc", 1, 12 * MiB), Event("free", 0, 3 * MiB),
               Event("alloc", 2, 30 * MiB), Event("free", 1, 12 * MiB), Event("free", 2, 30 * MiB)])
    rows = compare(t, [Contender("model", caching_factory(), 2 * MiB)])
    r = rows[0]
    assert r.requested_peak == 42 * MiB
    assert r.physical_peak == 50 * MiB                    # 20 MiB + 30 MiB segments
    assert r.fragmentation == pytest.approx(1 - 42 / 50)
    assert r.min_budget == 50 * MiB                       # the two segments never merge
    text = rpt.side_by_side("known", rows)
    assert "model" in text and "50.00 MiB" in text


def test_vmalloc_rows_on_a_known_trace():
    pytest.importorskip("vmalloc.allocator")
    from vmalloc.replay.run import vmalloc_factory
    chunk = 2 * MiB
    t = Trace([Event("alloc", 0, 3 * MiB), Event("alloc", 1, 5 * MiB + 1), Event("free", 0, 3 * MiB),
               Event("free", 1, 5 * MiB + 1)])
    rows = compare(t, [Contender("vm", vmalloc_factory(chunk), chunk, chunk)])
    r = rows[0]
    # Eq. 1 per allocation: 4 MiB - 3 MiB and 6 MiB - (5 MiB + 1)
    assert r.if_peak == MiB + (MiB - 1)
    assert r.if_bound == 2 * chunk and r.if_peak < r.if_bound
    assert r.mapped_peak == 10 * MiB and r.min_budget == 10 * MiB


def test_save_load_and_cli_report(tmp_path, capsys):
    r = rpt.build({"requested_peak": MiB, "physical_peak": 2 * MiB, "chunk_size": MiB},
                  source="test", timeline={"event": [0, 1], "requested": [0, MiB],
                                           "physical": [0, 2 * MiB]})
    path = tmp_path / "r.json"
    rpt.save(r, str(path))
    assert rpt.load(str(path)) == json.loads(path.read_text())
    assert main(["report", str(path)]) == 0
    assert "vmalloc report: test" in capsys.readouterr().out
    (tmp_path / "x.json").write_text("[1, 2]")
    assert main(["report", str(tmp_path / "x.json")]) == 2
    assert "not a vmalloc report" in capsys.readouterr().err
    txt = tmp_path / "r.txt"
    rpt.save(r, str(txt))
    assert "physical/requested" in txt.read_text()


def test_cli_replay_writes_json(tmp_path, capsys):
    t = Trace([Event("alloc", 0, 3 * MiB), Event("free", 0, 3 * MiB)], {"name": "tiny"})
    p = tmp_path / "tiny.json"
    t.save(p)
    out = tmp_path / "cmp.json"
    pytest.importorskip("vmalloc.allocator")
    assert main(["replay", str(p), "--chunk-size", "2MiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vmalloc 2 MiB" in text and "pytorch caching (model)" in text
    saved = json.loads(out.read_text())
    assert saved["comparison"][0]["rows"][0]["requested_peak"] == 3 * MiB
    assert main(["report", str(out)]) == 0          # a saved comparison prints too
    assert main(["replay", str(tmp_path / "missing.json")]) == 2


def test_live_report_without_cuda_and_sections():
    calls = []
    vmalloc.report.add_section("swap", lambda: calls.append(1) or {"swapped_out_bytes": 4 * MiB})
    try:
        rep = _report_fn(format="json")
        assert rep["swap"] == {"swapped_out_bytes": 4 * MiB} and calls
        assert "swapped_out_bytes: 4.00 MiB" in _report_fn()
        vmalloc.add_report_section("broken", lambda: 1 / 0)
        assert "ZeroDivisionError" in _report_fn(format="json")["broken"]["error"]
    finally:
        live_report.remove_section("swap")
        live_report.remove_section("broken")
    with pytest.raises(ValueError, match="format"):
        _report_fn(format="xml")
    with pytest.raises(TypeError, match="provider"):
        live_report.add_section("x", 42)


def test_torch_native_rows_line_up():
    ts = {"requested_bytes.all.current": 10, "requested_bytes.all.peak": 20,
          "reserved_bytes.all.current": 30, "reserved_bytes.all.peak": 40,
          "allocated_bytes.all.current": 12, "allocated_bytes.all.peak": 24,
          "num_device_alloc": 3, "num_device_free": 1}
    r = rpt.build(rpt.from_torch_stats(ts), source="torch-native")
    assert r["memory"]["physical"] == {"current": 30, "peak": 40}
    assert r["memory"]["allocated"] == {"current": 12, "peak": 24}
    assert r["driver"]["num_map"] == 3
    assert set(r) >= {"memory", "fragmentation", "cache", "driver"}


def test_cli_demo_replays_traces_without_a_gpu(tmp_path, capsys):
    pytest.importorskip("vmalloc.allocator")
    Trace([Event("alloc", 0, 3 * MiB), Event("alloc", 1, 25 * MiB), Event("free", 0, 3 * MiB),
           Event("free", 1, 25 * MiB)], {"name": "tiny"}).save(tmp_path / "tiny.json.gz")
    assert main(["demo", "--replay-only", "--traces", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "trace tiny" in out and "smallest budget that runs" in out
    assert main(["demo", "--replay-only", "--traces", str(tmp_path / "nothing")]) == 2


@pytest.mark.parametrize("name", ["cache", "process", "memory", "history", "comparison"])
def test_add_section_refuses_the_reports_own_keys(name):
    with pytest.raises(ValueError, match=f"'{name}' is one of the report's own keys"):
        live_report.add_section(name, lambda: {"hit_rate": 0.9})
    rep = _report_fn(format="json")          # vmalloc's own figures are still there
    assert set(rep["cache"]) >= {"num_malloc", "hits"} and "pid" in rep["process"]
    assert "vmalloc report" in rpt.to_text(rep)


def test_exit_report_with_a_non_json_section_is_complete_and_says_which(tmp_path, capsys):
    path = tmp_path / "frag.json"
    live_report.add_section("setty", lambda: {"window_bytes": 1 << 30, "streams": {1, 2}})
    try:
        live_report.write_exit_report(str(path))        # no traceback
    finally:
        live_report.remove_section("setty")
    saved = json.loads(path.read_text())        # the whole file, valid JSON
    assert "memory" in saved and "set is not JSON serializable" in saved["setty"]["error"]
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if "no memory timeline" not in line]   # (no PNG: vmalloc did not allocate here)
    assert len(err) == 1 and "'setty'" in err[0], err


def test_save_leaves_the_file_untouched_when_the_report_cannot_be_rendered(tmp_path):
    path = tmp_path / "frag.txt"
    path.write_text("the previous report\n")
    with pytest.raises(KeyError):
        rpt.save({"title": "no memory rows"}, str(path))
    assert path.read_text() == "the previous report\n"


def test_replay_table_keeps_its_columns_for_empty_traces_and_huge_ratios():
    """An empty trace's phys/req is null (JSON has no NaN) and needs 0 B; a ratio of 10000 or
    more must not run into the next column."""
    from vmalloc.report_format import side_by_side_from_json
    row = {"allocator": "vmalloc 2MiB", "requested_peak": 0, "physical_peak": 0, "ratio": None,
           "fragmentation": 0.0, "min_budget": 0, "ok": True, "budget_ratio": None,
           "chunk_size": 2 << 20, "if_peak": 0, "if_bound": 0}
    huge = dict(row, requested_peak=100, physical_peak=20 << 20, ratio=209715.2, min_budget=None)
    text = side_by_side_from_json({"trace": "t", "rows": [row, huge]})
    lines = text.splitlines()
    empty, wide = lines[-2], lines[-1]
    assert "0 B" in empty and " - " in empty
    assert " 209715 " in wide and "MiB209715" not in wide
    assert len(empty) == len(wide)   # same columns


def test_cache_hits_count_mallocs_served_without_a_driver_map():
    """The hit rate divided num_cache_hits (range and slab acquisitions only) by every malloc:
    1000 small malloc/free pairs served by one slab mapped once said "0 cache hits (0.0%)"."""
    from vmalloc import Allocator
    with Allocator("host", chunk_size=64 << 10) as a:
        for _ in range(1000):
            a.free(a.malloc(4096))
        for _ in range(10):                  # large: the first maps, the other 9 are cached
            a.free(a.malloc(200 << 10))
        s = a.stats()
        assert (s["num_malloc"], s["num_remaps"]) == (1010, 2)
        rep = rpt.build(s, source="vmalloc")
    assert rep["cache"]["hits"] == 1008
    assert "1008 cache hits (99.8%)" in rpt.to_text(rep)


def test_pytorchs_own_stats_show_no_made_up_hit_rate():
    ts = {"allocation.all.allocated": 50, "allocation.all.freed": 40, "num_device_alloc": 3}
    r = rpt.build(rpt.from_torch_stats(ts), source="torch-native")
    assert r["cache"]["hits"] is None          # PyTorch's stats do not say
    line = next(x for x in rpt.to_text(r).splitlines() if "cache:" in x)
    assert "cache hits" not in line and "50 mallocs, 40 frees" in line


def test_json_report_with_a_non_json_section_is_json_and_says_which(capsys):
    """report(format="json") returned a set section as it was (json.dumps of the dict then
    failed) and said nothing; the README says such a section comes as {"error": ...}, named in
    one line on stderr, as in the saved file."""
    vmalloc.add_report_section("setty", lambda: {"ids": {1, 2}, "bytes": 5})
    try:
        rep = _report_fn(format="json")
    finally:
        live_report.remove_section("setty")
    json.dumps(rep)
    assert "set is not JSON serializable" in rep["setty"]["error"] and "memory" in rep
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'setty'" in err[0], err


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_section_holding_nan_is_written_as_an_error_not_as_nan(tmp_path, capsys, value):
    """json.dumps wrote NaN/Infinity, which JSON has not (strict readers, jq, refuse the file);
    such a section is one that is not JSON, as the README says: {"error": ...}, named on stderr."""
    path = tmp_path / "frag.json"
    live_report.add_section("mine", lambda: {"v": value, "n": 3})
    try:
        live_report.write_exit_report(str(path))
        rep = _report_fn(format="json")
    finally:
        live_report.remove_section("mine")
    text = path.read_text()
    saved = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the report"))
    assert "memory" in saved and "not JSON" in saved["mine"]["error"]
    assert "not JSON" in rep["mine"]["error"]
    json.dumps(rep, allow_nan=False)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "'mine'" in line]
    assert len(err) == 2, err   # one for the file, one for report(format="json")
