"""bench/e2e.py's GPU-only paths, checked on the CPU with fakes: what keeps a lent GPU session
from being wasted (a missing torchtune, a hung job, pinned host memory past the host's RAM,
the coexist pair alone) and what keeps its numbers right (bert-dyn's steady state, the
reference run without the cap, the workers' environment)."""
import argparse
import gc
import io
import json
import subprocess
import sys
import weakref

import pytest
import torch

from bench import e2e, e2e_grid, e2e_workers
from _e2e_fakes import jobs_run, jobs_take


def row(model, method, batch, status="ok", **kw):
    return e2e.JobResult(model, method, batch, 1.0 if status == "ok" else None, "images/s",
                         None, 16 << 30, status, kw.pop("note", ""), **kw)


# ---------------------------------------------------------------- unavailable (review item 3)
def test_a_method_whose_package_does_not_import_is_unavailable_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtune", None)   # import torchtune -> ImportError
    monkeypatch.setitem(sys.modules, "torchtune.training", None)
    factory = lambda: e2e.build_workload("gpt2-s32", 2, torch.device("cpu"), True, 0)  # noqa: E731
    r = e2e.run_job(e2e.BY_NAME["torchtune-offload"], factory, None, torch.device("cpu"),
                    steps=1, warmup=0, seed=0)
    assert r.status == "unavailable"
    assert "torchtune" in r.note and r.row()["error"] == r.note
    assert "error" not in row("resnet50", "native", 64).row()   # other rows keep their shape


def test_resume_reruns_only_error_rows(tmp_path):
    statuses = ("ok", "oom", "infeasible", "crashed", "timeout", "unavailable", "error")
    rows = [row("resnet50", "native", 64 * (i + 1), st) for i, st in enumerate(statuses)]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": [r.row() for r in rows]}))
    assert [r.status for r in e2e.load_resume(path)] == list(statuses[:-1])
    # infeasible for host memory: an estimate against the free memory of the time, judged again
    host = row("resnet50", "save_on_cpu", 1440, "infeasible")
    host.note = e2e.HOST_NOTE + " offloads ~300 GiB pinned"
    path.write_text(json.dumps({"results": [r.row() for r in rows + [host]]}))
    assert [r.status for r in e2e.load_resume(path)] == list(statuses[:-1])


# ------------------------------------------------------------------ --coexist-only (item 2)
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(e2e, "meta", lambda device, command: {
        "gpu": "FakeGPU", "driver": None, "torch": torch.__version__, "date": "2026-11-26",
        "command": command})
    monkeypatch.setattr(e2e, "plots", lambda rows, stem, grid: [])


def test_coexist_only_runs_the_pair_and_no_model_grid(tmp_path, monkeypatch):
    fake_gpu(monkeypatch)
    monkeypatch.setattr(e2e, "run_workers", lambda *a, **k: pytest.fail("the grid ran"))
    batches = []

    class Worker:
        returncode = 0

        def __init__(self, allocator, spec, env=None):
            [batch] = spec["models"]["resnet50"]
            batches.append(batch)
            # no plain-training reference: two at once, uncapped, would not fit the GPU
            assert spec["reference"] is False
            r = row("resnet50", "window+vmalloc", batch)
            self.stdout = io.StringIO(f"{e2e.ROW} {json.dumps(r.row())}\n")

        def wait(self):
            return 0

    monkeypatch.setattr(e2e_workers, "_start_worker", Worker)
    out = tmp_path / "coexist.json"
    kept = row("resnet50", "window+vmalloc", 64).row()   # an earlier grid row: kept as is
    out.write_text(json.dumps({"meta": {}, "results": [kept]}))
    assert e2e.main(["--coexist-only", "--models", "resnet50", "--methods", "window+vmalloc",
                     "--resume", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert batches == [512, 512]   # the default batch, two processes
    assert kept in doc["results"] and len(doc["results"]) == 3
    assert not doc["meta"].get("incomplete")
    # resumed again: the pair is done, nothing runs
    monkeypatch.setattr(e2e_workers, "_start_worker", lambda *a, **k: pytest.fail("ran again"))
    assert e2e.main(["--coexist-only", "--coexist", "512", "--resume", str(out)]) == 0
    assert len(json.loads(out.read_text())["results"]) == 3


def test_coexist_only_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a GPU"):
        e2e.main(["--coexist-only"])


# ---------------------------------------------------------------- the watchdog (item 4)
def script_worker(lines, sleep):
    """A real process printing ``lines`` and then silent for ``sleep`` seconds."""
    code = (f"import sys, time\nfor l in {lines!r}: print(l, flush=True)\n"
            f"time.sleep({sleep})\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_silent_worker_is_killed_its_job_timed_out_and_the_next_worker_goes_on(monkeypatch):
    grid = e2e.Grid({"resnet50": [64, 512, 768]}, [e2e.BY_NAME["native"]], 16 << 30, 1, 0)
    first = row("resnet50", "native", 64, seconds=2.0)
    after = row("resnet50", "native", 768, seconds=3.0)
    start = lambda b: f"{e2e.START} {json.dumps(['resnet50', 'native', b])}"  # noqa: E731
    specs, procs = [], []

    def start_worker(allocator, spec, env=None):
        specs.append(spec)
        if len(specs) == 1:   # the reference, one job, then hangs in the second
            p = script_worker([f"{e2e.REF} {json.dumps({'resnet50': [2.5]})}", start(64),
                               f"{e2e.BEAT} null", f"{e2e.ROW} {json.dumps(first.row())}",
                               start(512), f"{e2e.BEAT} null"], sleep=60)
        else:
            p = script_worker([start(768), f"{e2e.ROW} {json.dumps(after.row())}"], sleep=0)
        procs.append(p)
        return p

    monkeypatch.setattr(e2e_workers, "_start_worker", start_worker)
    plan = e2e.Plan.of(grid)
    rows = e2e.run_workers(grid, plan, job_timeout=1.5)
    assert [(r.batch_size, r.status) for r in rows] == [(64, "ok"), (512, "timeout"),
                                                        (768, "ok")]
    assert "killed after 1.5 s without output during this job" in rows[1].note
    assert procs[0].poll() is not None            # killed, not left running
    # the second worker skips what the first did (and its reference, already had)
    assert {tuple(k) for k in specs[1]["done"]} == {("resnet50", "native", 64),
                                                    ("resnet50", "native", 512)}
    assert specs[1]["references"] == []
    assert plan.durations[("resnet50", 512)] >= 1.5   # the margin of its batch next time


def test_a_jobs_first_step_gets_longer_than_the_next_ones(monkeypatch):
    """Building the model, planning and pinning before a job's first step are healthy and
    silent: FIRST_STEP_GRACE x the timeout until the first BEAT, the timeout after it."""
    start = f"{e2e.START} {json.dumps(['resnet50', 'native', 64])}"
    code = (f"import sys, time\nprint({start!r}, flush=True)\ntime.sleep(1.5)\n"
            f"print({e2e.ALIVE + ' null'!r}, flush=True)\ntime.sleep(1.5)\n"
            f"print({e2e.BEAT + ' null'!r}, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    watch = e2e.Watch(proc, 1.0)
    kinds = [line.split(" ", 1)[0] for line in watch]
    assert kinds == [e2e.START, e2e.ALIVE, e2e.BEAT] and watch.timed_out
    assert proc.wait(timeout=30) is not None


# ---------------------------------------------- pinned memory given back between jobs (item 8)
def test_the_host_cache_is_emptied_after_the_job_is_gone(monkeypatch):
    """A wrapped model and its pinned pool may sit in a reference cycle: collected before
    PyTorch's pinned cache is emptied, or their blocks stay cached into the next job."""
    pools, seen = [], []

    class Pool:
        pass

    def job(method, factory, budget, device, *args, **kwargs):
        p = Pool()
        p.cycle = p
        pools.append(weakref.ref(p))
        return row("gpt2-s32", method.name, 2)

    monkeypatch.setattr(e2e_grid, "run_job", job)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch._C, "_host_emptyCache",
                        lambda: seen.append([p() is None for p in pools]), raising=False)
    gc.disable()
    try:
        grid = e2e.Grid({"gpt2-s32": [2]}, [e2e.BY_NAME["pofo"]], None, 1, 0)
        e2e.run_grid(grid, grid.methods, torch.device("cuda"))
    finally:
        gc.enable()
    assert seen == [[True], [True, True]]   # after the reference, after the job


# ------------------------------------------------------- the host-memory floor (item 1)
def meminfo(tmp_path, gib):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: {200 << 20} kB\nMemAvailable: {gib << 20} kB\n")
    return path


def test_pinned_blocks_round_up_to_powers_of_two():
    assert [e2e.pinned_size(n) for n in (0, 1, 2, 3, 1000, 1024, 1025)] == [
        0, 1, 2, 4, 1024, 1024, 2048]


def test_the_host_pool_costs_its_buffers_own_size():
    from scheduler.runtime.host_pool import ALIGN, DIRECT_BELOW
    n = 1440 * 49 * 64 * 4
    assert e2e.pool_size(n) == n < e2e.pinned_size(n)  # carved from a slab, not rounded
    assert e2e.pool_size(DIRECT_BELOW + 1) == DIRECT_BELOW + ALIGN
    assert e2e.pool_size(1000) == 1024  # a small buffer: a pinned block of its own


def test_offloading_jobs_past_the_hosts_memory_are_infeasible(tmp_path):
    host = meminfo(tmp_path, 120)
    big = e2e.host_floor_note("resnet50", e2e.BY_NAME["save_on_cpu"], 1440, 16 << 30, host)
    assert big.startswith("host memory: offloads ~") and "MemAvailable 120.00 GiB" in big
    assert e2e.host_floor_note("resnet50", e2e.BY_NAME["window"], 1440, 16 << 30, host)
    assert e2e.host_floor_note("resnet50", e2e.BY_NAME["save_on_cpu"], 64, 16 << 30, host) == ""
    # methods that offload nothing, and hosts that cannot say, are never held back
    assert e2e.host_floor_note("resnet50", e2e.BY_NAME["rotor"], 1440, 16 << 30, host) == ""
    assert e2e.host_floor_note("resnet50", e2e.BY_NAME["save_on_cpu"], 1440, 16 << 30,
                               tmp_path / "none") == ""
    # the swap runtimes offload only what the budget does not keep
    window = e2e.pinned_need("resnet50", e2e.BY_NAME["window"], 512, 16 << 30)
    assert 0 < window < e2e.pinned_need("resnet50", e2e.BY_NAME["window"], 512, None)


def test_run_grid_marks_host_floor_jobs_infeasible_without_running_them(monkeypatch):
    ran = jobs_run(monkeypatch, e2e_grid)
    grid = e2e.Grid({"gpt2-s32": [2]}, [e2e.BY_NAME[n] for n in ("rotor", "save_on_cpu")],
                    None, 1, 0)
    floor = lambda model, m, b, budget: "host memory: too much" if m.name == "save_on_cpu" else ""  # noqa: E731
    rows, _ = e2e.run_grid(grid, grid.methods, torch.device("cpu"), host_floor=floor)
    assert ran == ["native", "rotor"]
    assert {r.method: r.status for r in rows} == {"rotor": "ok", "save_on_cpu": "infeasible"}


# ------------------------------------------ the --stop-at margin of a batch (item 10)
def test_the_margin_is_the_longest_job_recorded_at_the_same_batch(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(e2e_grid, "clock", lambda: now[0])
    plan = e2e.Plan(stop_at=1000.0, durations=[("resnet50", 1440, 150.0)])
    now[0] = 860.0                                   # 140 s left
    assert plan.may_start("resnet50", 64)            # nothing known at 64: 60 s
    assert not plan.may_start("resnet50", 1440)      # a 150 s job there before


def test_rows_record_their_seconds_and_resume_passes_them_on(tmp_path, monkeypatch):
    jobs_take(monkeypatch, e2e_grid, 5)
    out = tmp_path / "e2e.json"
    assert e2e.main(["--smoke", "--models", "gpt2-s32", "--methods", "native,window",
                     "--steps", "1", "--out", str(out)]) == 0
    assert [r["seconds"] for r in json.loads(out.read_text())["results"]] == [5.0, 5.0]
    seen = {}
    monkeypatch.setattr(e2e, "run_grid", lambda grid, *a, **k: (seen.update(
        durations=grid.durations), ([], {}))[1])
    e2e.main(["--smoke", "--models", "gpt2-s32", "--methods", "native,window", "--steps", "1",
              "--resume", str(out)])
    assert seen["durations"] == [("gpt2-s32", 2, 5.0), ("gpt2-s32", 2, 5.0)]


# ------------------------------- the reference without the cap; the workers' environment (14)
def test_the_reference_runs_without_the_cap(monkeypatch):
    state, log = {"capped": True}, []

    @__import__("contextlib").contextmanager
    def uncapped():
        state["capped"] = False
        yield
        state["capped"] = True

    def job(method, factory, budget, device, *args, **kwargs):
        log.append((method.name, budget, state["capped"]))
        return row("gpt2-s32", method.name, 2)

    monkeypatch.setattr(e2e_grid, "run_job", job)
    grid = e2e.Grid({"gpt2-s32": [2]}, [e2e.BY_NAME["window"]], 16 << 30, 1, 0)
    e2e.run_grid(grid, grid.methods, torch.device("cpu"), uncapped=uncapped)
    assert log == [("native", None, False), ("window", 16 << 30, True)]


def test_a_grid_without_reference_runs_only_its_jobs(monkeypatch):
    """The coexist pair's processes: no plain-training reference (two at once, uncapped, would
    not fit the GPU), no loss check, the job itself runs."""
    log = []

    def job(method, factory, budget, device, *args, **kwargs):
        log.append(method.name)
        return row("gpt2-s32", method.name, 2)

    monkeypatch.setattr(e2e_grid, "run_job", job)
    grid = e2e.Grid({"gpt2-s32": [2]}, [e2e.BY_NAME["window"]], 16 << 30, 1, 0,
                    reference=False)
    rows, refs = e2e.run_grid(grid, grid.methods, torch.device("cpu"))
    assert log == ["window"] and refs == {} and "loss" not in rows[0].note


def test_workers_do_not_inherit_allocator_settings(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("VMALLOC", "1")
    monkeypatch.setenv("VMALLOC_BUDGET", "1GiB")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.5")
    monkeypatch.setenv("E2E_KEEP_ME", "yes")
    native, expandable = e2e.worker_env("native"), e2e.worker_env("expandable")
    assert not any(k.startswith(("VMALLOC", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
                   for k in native)
    assert native["E2E_KEEP_ME"] == "yes"
    assert expandable["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "VMALLOC" not in e2e.worker_env("vmalloc")


# ------------------------------------------------------------ bert-dyn's steady state (item 7)
def test_dynamic_shapes_warm_up_over_every_length_on_the_gpu_only():
    assert e2e.step_counts(16, 3, 10, gpu=True) == (16, 16)
    assert e2e.step_counts(16, 20, 10, gpu=True) == (32, 16)   # whole cycles: timing starts at 0
    assert e2e.step_counts(16, 1, 2, gpu=False) == (1, 2)      # the CPU smoke stays quick
    assert e2e.step_counts(1, 3, 10, gpu=True) == (3, 10)      # a fixed shape: as asked


def test_a_gpu_bert_dyn_job_trains_every_length_before_and_while_timing(monkeypatch):
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 0)
    beats = []
    factory = lambda: e2e.build_workload("bert-dyn", 2, torch.device("cpu"), True, 0)  # noqa: E731
    r = e2e.run_job(e2e.BY_NAME["native"], factory, None, torch.device("cuda"), steps=2,
                    warmup=1, seed=0, beat=lambda: beats.append(1))
    n = e2e.DYNAMIC_STEPS
    assert r.status == "ok", r.note
    assert len(r.losses) == len(beats) == 2 * n   # n warm-up steps, n timed ones


# ---------------------------------------------------------------- --quick (item 6)
def test_quick_is_each_models_smallest_batch_only():
    args = argparse.Namespace(smoke=False, quick=True, models=None, methods=None, budget=None,
                              steps=None)
    assert e2e.make_grid(args, cuda=True).models == {"resnet50": [64], "gpt2-s1024": [8]}
