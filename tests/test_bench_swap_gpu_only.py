"""bench/swap.py --gpu-only, as a device session runs it: the GPU comparison alone into the
committed results file's ``gpu`` key (the CPU part kept), written after every worker, stopped
by --stop-at and resumed from the rows already there. Workers and the GPU are faked."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from _subproc import ROOT

# appended, never first: a child process (multiprocessing spawn) takes this sys.path, and the
# checkout's unbuilt vmalloc must not come before the installed one
if ROOT not in sys.path:
    sys.path.append(ROOT)
from bench import swap as bench_swap  # noqa: E402


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "swap.json").write_text(json.dumps(
        {"meta": {"torch": "2.13.0+cpu"}, "cpu_overhead": [{"model": "mlp"}]}))
    monkeypatch.setattr(bench_swap, "RESULTS", results)
    monkeypatch.setattr(bench_swap.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_swap.torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(bench_swap, "_available", lambda method: None)
    monkeypatch.setattr(bench_swap, "gpu_plot", lambda rows, path: None)
    import bench.common
    monkeypatch.setattr(bench.common, "run_meta",
                        lambda command, device="cpu": {"gpu": "Fake GPU", "command": command})
    state = {"clock": 0.0, "ran": [], "oom": set(), "hang": set(), "timeouts": []}

    def run(cmd, **kw):   # one worker: ok, out of memory or hung for the (method, batch) listed
        cfg = json.loads(cmd[-1])
        key = (cfg["model"]["name"], cfg["method"], cfg["batch"])
        state["ran"].append(key)
        state["timeouts"].append(kw.get("timeout"))
        state["clock"] += 10.0
        if key[1:] in state["hang"]:
            raise subprocess.TimeoutExpired(cmd, kw["timeout"])
        status = "oom" if key[1:] in state["oom"] else "ok"
        row = dict(cfg, status=status, throughput=1.0, unit="items/s")
        return subprocess.CompletedProcess(cmd, 0, json.dumps(row) + "\n", "")
    monkeypatch.setattr(bench_swap.subprocess, "run", run)
    monkeypatch.setattr(bench_swap.time, "time", lambda: state["clock"])
    return results / "swap.json", state


def _args(**kw):
    # --out names the results folder, as scripts/gpu-check does: --quick writes only with --out
    return SimpleNamespace(**{"quick": True, "cpu_only": False, "budget": "16GiB",
                              "window": "2GiB", "stop_at": None,
                              "out": str(bench_swap.RESULTS), **kw})


def test_stopped_in_time_then_resumed_without_running_a_worker_twice(fake_gpu):
    path, state = fake_gpu
    state["oom"] = {("none", 256)}   # plain training: the larger batch does not fit
    bench_swap.gpu_only(_args(stop_at=35.0))   # workers at t=0, 10, 20, 30; none after 35
    doc = json.loads(path.read_text())
    assert doc["cpu_overhead"] == [{"model": "mlp"}]   # the committed CPU part is kept
    first = state["ran"][:]
    assert len(first) == 4 and doc["gpu"]["incomplete"] and doc["gpu"]["not_run"] > 0
    assert [(r["model"], r["method"], r["batch"]) for r in doc["gpu"]["rows"]] == [
        ("resnet50", m, b) for m, b in
        [("none", 64), ("none", 256), ("save_on_cpu", 64), ("save_on_cpu", 256)]]
    assert doc["meta"]["cuda"] == "Fake GPU" and "--stop-at" not in doc["gpu"]["meta"]["command"]

    bench_swap.gpu_only(_args())
    doc = json.loads(path.read_text())
    again = state["ran"][len(first):]
    assert not set(again) & set(first)   # the rows kept are not measured again
    assert not doc["gpu"]["incomplete"] and doc["gpu"]["not_run"] == 0
    n_methods, n_models, n_batches = len(bench_swap.GPU_METHODS), 2, 2
    assert len(doc["gpu"]["rows"]) == n_methods * n_models * n_batches
    assert ("gpt2", "none", 16) in again and ("gpt2", "none", 32) not in again  # --quick: 8, 16


def test_an_out_of_memory_batch_ends_its_method_and_rows_in_error_run_again(fake_gpu):
    path, state = fake_gpu
    state["oom"] = {("lms", 64)}
    bench_swap.gpu_only(_args())
    assert ("resnet50", "lms", 256) not in state["ran"]   # larger batches would not fit
    doc = json.loads(path.read_text())
    doc["gpu"]["rows"][0]["status"] = "error"   # a crashed worker
    path.write_text(json.dumps(doc))
    state["ran"].clear()
    bench_swap.gpu_only(_args())
    assert state["ran"] == [("resnet50", "none", 64)]


def test_rows_of_another_gpu_or_grid_are_not_kept(fake_gpu, monkeypatch):
    """One table is one GPU's: a file resumed on another GPU (or with --quick changed) starts
    over rather than mix them."""
    import bench.common
    path, state = fake_gpu
    bench_swap.gpu_only(_args())
    n = len(state["ran"])
    monkeypatch.setattr(bench.common, "run_meta",
                        lambda command, device="cpu": {"gpu": "Other GPU", "command": command})
    bench_swap.gpu_only(_args())
    assert len(state["ran"]) == 2 * n


def test_a_hung_worker_is_killed_and_kept_as_a_timeout_row(fake_gpu):
    """A worker past --worker-timeout (default 180 s, well under gpu-check's 420 s step) is
    killed; its row says ``timeout``, ends its method's batches like an OOM, and a resumed
    run keeps it rather than hang again."""
    path, state = fake_gpu
    state["hang"] = {("lms", 64)}
    bench_swap.gpu_only(_args())
    assert set(state["timeouts"]) == {180.0}
    assert ("resnet50", "lms", 256) not in state["ran"]
    doc = json.loads(path.read_text())
    (row,) = [r for r in doc["gpu"]["rows"] if r["status"] == "timeout"]
    assert (row["model"], row["method"], row["batch"]) == ("resnet50", "lms", 64)
    assert "--worker-timeout 180" in row["error"] and not doc["gpu"]["incomplete"]
    assert "timeout" in bench_swap.gpu_table(doc["gpu"]["rows"])
    state["ran"].clear()
    bench_swap.gpu_only(_args(worker_timeout=30.0))
    assert state["ran"] == [] and state["timeouts"][-1] == 180.0   # nothing ran again


def test_worker_timeout_flag(fake_gpu):
    path, state = fake_gpu
    assert bench_swap.parse_args([]).worker_timeout == 180.0
    args = bench_swap.parse_args(["--quick", "--gpu-only", "--worker-timeout", "45",
                                  "--out", str(path.parent)])
    bench_swap.gpu_only(args)
    assert set(state["timeouts"]) == {45.0}


def test_quick_without_out_neither_resumes_nor_writes(fake_gpu, capsys):
    """A smoke run (--quick, no --out) measures and prints its table; the results file is
    neither read (no rows kept) nor written (bench.common.output_dir)."""
    path, state = fake_gpu
    bench_swap.gpu_only(_args())   # with --out: the file gets every row
    before = path.read_text()
    n = len(state["ran"])
    bench_swap.gpu_only(_args(out=None))
    assert len(state["ran"]) == 2 * n   # all measured again: nothing resumed
    assert path.read_text() == before
    assert "nothing written" in capsys.readouterr().out
