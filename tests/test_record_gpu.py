"""bench/traces/record_gpu.py's CPU half: a snapshot becomes a bundled trace with PyTorch's own
figures beside it, and the caching model's error is computed against them."""
import pickle

import pytest

from bench.traces import record_gpu
from vmalloc.replay import load

MiB = 1 << 20


def _snapshot():
    e = lambda a, addr, size, t: {"action": a, "addr": addr, "size": size, "stream": 0,
                                  "time_us": t, "frames": []}
    trace = [e("alloc", 0x1000, 3 * MiB, 1), e("alloc", 0x2000, 12 * MiB, 2),
             e("free_requested", 0x1000, 3 * MiB, 3), e("free_completed", 0x1000, 3 * MiB, 4),
             e("alloc", 0x1000, 2 * MiB, 5)]
    return {"segments": [], "device_traces": [trace]}


def test_convert_writes_a_recorded_trace_and_the_model_error(tmp_path):
    snap = tmp_path / "s.pickle"
    snap.write_bytes(pickle.dumps(_snapshot()))
    job = record_gpu.Job("resnet50", 4, "native")
    figures = {"reserved_peak": 20 * MiB, "allocated_peak": 15 * MiB, "gpu": "test"}
    row = record_gpu.convert(str(snap), job, figures, 1, tmp_path / "traces")
    t = load(tmp_path / "traces" / "resnet50-b4-native-gpu.json.gz")
    assert t.meta["real_gpu_trace"] is True and "recorded" in t.meta["source"]
    assert t.meta["reserved_peak"] == 20 * MiB
    assert row["events"] == len(t) == 4 and row["peak_requested"] == 15 * MiB
    # the caching model: 3 MiB opens a 20 MiB segment (requests < 10 MiB), 12 MiB and then
    # 2 MiB are split from what is left of it: 20 MiB
    assert row["model_reserved_peak"] == 20 * MiB
    assert row["model_error_percent"] == pytest.approx(0.0)


def test_without_cuda_it_records_nothing_and_says_so(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: recording would run")
    assert record_gpu.main(["--out", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_step_starts_count_recorded_allocations_after_the_pre_existing_blocks(tmp_path):
    """The child counts PyTorch's allocations at each step's start; a block allocated before the
    recording (its free is in the trace) becomes an allocation at the trace's start, which the
    counts skip."""
    snap = _snapshot()
    pre = {"action": "free_completed", "addr": 0x9000, "size": MiB, "stream": 0, "time_us": 0,
           "frames": []}
    snap["device_traces"][0].insert(0, pre)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap))
    job = record_gpu.Job("resnet50", 4, "native")
    # step 1: the first two allocations; step 2: the third (after the 3 MiB block's free)
    figures = {"reserved_peak": 20 * MiB, "allocated_peak": 15 * MiB, "gpu": "test",
               "step_seconds": [0.3, 0.1], "step_allocs": [0, 2, 3]}
    record_gpu.convert(str(path), job, figures, 2, tmp_path / "traces")
    t = load(tmp_path / "traces" / "resnet50-b4-native-gpu.json.gz")
    # the pre-existing block: allocated at the start, freed by the first entry
    assert [(e.action, e.size) for e in t.events[:2]] == [("alloc", MiB), ("free", MiB)]
    assert t.meta["step_starts"] == [2, 5]
    assert (t.events[2].size, t.events[5].size) == (3 * MiB, 2 * MiB)
    assert t.meta["step_seconds"] == [0.3, 0.1] and t.meta["model"] == "resnet50"
    # counts the trace cannot hold (the history ring dropped entries): no cut, not a wrong one
    assert record_gpu.step_starts(t, [0, 2, 9]) is None
    assert record_gpu.step_starts(t, None) is None


def test_the_trace_counts_what_pytorch_reserved_and_says_when_the_model_cannot_compare():
    # torch 2.11's own entries: segments mapped and freed during the recording, on top of a
    # segment reserved before it began (in ``segments`` at snapshot time), an oom entry (its
    # free bytes where an address would be)
    seg = lambda a, size: {"action": a, "addr": 0x100000, "size": size, "stream": 0,
                           "time_us": 0, "frames": []}
    snap = {"segments": [{"device": 0, "total_size": 2 * MiB, "blocks": []},
                         {"device": 0, "total_size": 20 * MiB, "blocks": []}],
            "device_traces": [[seg("segment_alloc", 20 * MiB), seg("alloc", MiB),
                               seg("segment_alloc", 40 * MiB), seg("segment_free", 40 * MiB)]],
            "allocator_settings": {"expandable_segments": False}}
    got = record_gpu.segment_figures(snap, 0, max_entries=100)
    assert got["trace_reserved_peak"] == 2 * MiB + 60 * MiB
    assert got["trace_actions"]["segment_free"] == 1
    unfair = " ".join(got["model_comparison_unfair"])
    assert "released" in unfair and "began with memory reserved" in unfair
    assert "ring" not in unfair and "expandable" not in unfair
    clean = {"segments": [{"device": 0, "total_size": 20 * MiB}],
             "device_traces": [[seg("segment_alloc", 20 * MiB), seg("alloc", MiB)]]}
    assert record_gpu.segment_figures(clean, 0, 100)["model_comparison_unfair"] == []
    clean["allocator_settings"] = {"expandable_segments": True}
    assert record_gpu.segment_figures(clean, 0, 2)["model_comparison_unfair"] == [
        "the history ring was full: early events lost", "expandable segments"]


def test_a_trace_already_recorded_is_kept_not_recorded_again(monkeypatch, tmp_path):
    """A call cut off at its time limit resumes: the jobs whose trace is in --out are not
    recorded again (their row from traces-gpu.json, else rebuilt from the trace's meta);
    --fresh records them all."""
    import json
    torch = pytest.importorskip("torch")
    import bench.e2e
    snap = tmp_path / "s.pickle"
    snap.write_bytes(pickle.dumps(_snapshot()))
    out, results = tmp_path / "traces", tmp_path / "results"
    figures = {"reserved_peak": 20 * MiB, "allocated_peak": 15 * MiB, "gpu": "test",
               "step_seconds": [0.2]}
    first, second = record_gpu.JOBS[:2]
    row = record_gpu.convert(str(snap), first, figures, 1, out)
    record_gpu.convert(str(snap), second, figures, 1, out)   # killed before its row was written
    results.mkdir()
    (results / "traces-gpu.json").write_text(json.dumps(
        {"meta": {}, "rows": [{**row, "status": "ok", "earlier": True}]}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.e2e, "meta", lambda device, command: {"gpu": "Fake GPU"})
    recorded = []

    def record(job, args, tmp, env):
        recorded.append(job.stem)
        return {"trace": job.stem, "status": "ok"}
    monkeypatch.setattr(record_gpu, "_record", record)
    assert record_gpu.main(["--out", str(out), "--results", str(results)]) == 0
    assert recorded == [j.stem for j in record_gpu.JOBS[2:]]
    rows = json.loads((results / "traces-gpu.json").read_text())["rows"]
    assert [r["trace"] for r in rows[:2]] == [f"{first.stem}.json.gz", f"{second.stem}.json.gz"]
    assert rows[0]["earlier"] is True                  # kept as it was
    same = lambda r: {k: v for k, v in r.items() if k not in ("status", "bytes_on_disk")}
    assert same(rows[1]) == same({**row, "trace": f"{second.stem}.json.gz",
                                  "model": second.model, "batch": second.batch,
                                  "method": second.method})
    assert rows[1]["status"] == "ok"
    recorded.clear()
    assert record_gpu.main(["--out", str(out), "--results", str(results), "--fresh"]) == 0
    assert recorded == [j.stem for j in record_gpu.JOBS]
