"""scripts/gpu-check on a machine without a GPU: it runs, skips its GPU steps cleanly, leaves
few files in OUTDIR (the device tool returns at most 8, 2 folders deep), and a failing step stops
it with the command named."""
import errno
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from _subproc import ROOT, python_env

SCRIPT = Path(ROOT) / "scripts" / "gpu-check"
sys.path.insert(0, str(Path(ROOT) / "scripts"))   # gpu_record, as the script imports it


@pytest.fixture(autouse=True)
def _own_state(monkeypatch, tmp_path):
    """Each test's own folder for what a call keeps for the next call on its machine: never
    the real one, whose files a later call would restore into the checkout."""
    monkeypatch.setenv("VMALLOC_GPU_CHECK_STATE", str(tmp_path / "machine-state"))


def load_script():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod   # dataclasses look their module up there
    loader.exec_module(mod)
    return mod


def test_without_a_gpu_the_gpu_steps_are_skipped(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu-check would run the GPU steps")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(SCRIPT), "--no-build", str(out)], capture_output=True,
                       text=True, timeout=300, env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = (out / "gpu-check.log").read_text()
    for step in ("pytest-gpu", "demo", "alloc_micro", "swap", "checkpoint_real", "e2e-quick"):
        assert f"SKIP  {step}: no CUDA device" in summary, summary
    assert "env (" in summary and "DONE" in summary   # WARN in CI: the checkout is not built there
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu-check.log", "logs.tar.gz"], files
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/env.log" in names and all(n.count("/") <= 1 for n in names), names


def test_dry_run_lists_every_step_and_full_mode_only_e2e(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", str(tmp_path / "q")],
                       capture_output=True, text=True, timeout=120, env=python_env())
    assert r.returncode == 0, r.stderr
    for cmd in ("scripts/dev-build", "-m pytest -m gpu", "-m vmalloc.cli demo",
                "bench/alloc_micro.py --quick",
                "bench/swap.py --quick", "bench/checkpoint_real.py --quick", "bench/e2e.py --quick"):
        assert cmd in r.stdout, (cmd, r.stdout)
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--full", str(tmp_path / "f")],
                       capture_output=True, text=True, timeout=120, env=python_env())
    assert r.returncode == 0, r.stderr
    assert "--quick" not in r.stdout and "-m pytest" not in r.stdout
    for m in ("resnet50", "gpt2-s1024", "gpt2-s2048", "bert-dyn"):   # one step (and JSON) each
        assert f"bench/e2e.py --models {m} --resume" in r.stdout, (m, r.stdout)
    assert "--coexist" in r.stdout
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--full", "--models",
                        "bert-dyn", str(tmp_path / "m")],
                       capture_output=True, text=True, timeout=120, env=python_env())
    assert "--models bert-dyn" in r.stdout and "--models resnet50 --resume" not in r.stdout
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--traces", str(tmp_path / "t")],
                       capture_output=True, text=True, timeout=120, env=python_env())
    assert r.returncode == 0, r.stderr
    assert "bench/traces/record_gpu.py" in r.stdout and "bench/e2e.py" not in r.stdout
    # cache_slack replays the traces just recorded, after them and before hf
    assert r.stdout.index("record_gpu.py") < r.stdout.index("bench/cache_slack.py") \
        < r.stdout.index("bench/hf.py")
    # --next: every mode's steps, in issue 12's order; each e2e run resumes its own file
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--next", str(tmp_path / "n")],
                       capture_output=True, text=True, timeout=120, env=python_env())
    assert r.returncode == 0, r.stderr
    order = [("pytest-gpu", "-m pytest -m gpu"), ("demo", "vmalloc.cli demo"),
             ("alloc_micro", "bench/alloc_micro.py"), ("checkpoint_real", "bench/checkpoint_real.py"),
             ("swap", "bench/swap.py --quick --gpu-only --stop-at"),
             ("traces", "record_gpu.py"), ("cache_slack", "bench/cache_slack.py"),
             ("e2e-quick", "bench/e2e.py --quick"),
             ("e2e-resnet50", "--models resnet50 --resume"),
             ("e2e-bert-dyn", "--models bert-dyn --resume"), ("e2e-coexist", "--coexist 512"),
             ("hf", "bench/hf.py")]   # (issue 13's: after issue 12's grid)
    # steps the committed progress record holds as done (or failed for this very source) are
    # named as skipped instead: a GPU session's results are committed with it
    skipped = {name for ln in r.stdout.splitlines() if " SKIP " in ln
               for name in ln.split(" SKIP ", 1)[1].strip().split(":", 1)[0].split(",")}
    at = [r.stdout.index(cmd) for name, cmd in order if name not in skipped]
    assert at == sorted(at) and len(at) >= len(order) // 2, r.stdout
    resumes = {"e2e-quick": "--quick --resume bench/results/e2e-GPU-quick.json --stop-at",
               "e2e-resnet50": "--resume bench/results/e2e-GPU-resnet50.json --stop-at"}
    left = [name for name in resumes if name not in skipped]
    assert left, r.stdout   # (the full grid's steps are not done yet)
    for name in left:   # each resumes its own file (GPU: the device's name there)
        assert resumes[name] in r.stdout, (name, r.stdout)
    # the coexist pair alone: not ResNet-50's window+vmalloc sweep again before it
    coexist = next(ln for ln in r.stdout.splitlines() if "DRY   e2e-coexist:" in ln)
    assert "--coexist-only" in coexist and "--methods" not in coexist, coexist


def test_every_bench_step_names_the_folder_its_results_go_to():
    """A bench's --quick run writes nothing without --out (bench.common.output_dir: the
    committed bench/results are full runs), so every step that runs a bench and records
    results passes --out, the folder its results file is in: it still writes where the
    archive and the progress record look. Exempt: bench/e2e.py (its file is --resume's) and
    bench/traces/record_gpu.py (no --quick rule; it writes bench/traces)."""
    gc = load_script()
    steps = (gc.quick_steps(Path("logs"), None) + gc.traces_steps(None)
             + gc.full_steps(gc.E2E_MODELS, None))
    checked = []
    for step in steps:
        script = next((a for a in step.cmd if a.startswith("bench/") and a.endswith(".py")), None)
        if script is None or script == "bench/traces/record_gpu.py":
            continue
        if script == "bench/e2e.py":
            assert step.cmd[step.cmd.index("--resume") + 1] == step.results, step.cmd
            continue
        assert "--out" in step.cmd, (step.name, step.cmd)
        out = step.cmd[step.cmd.index("--out") + 1]
        assert step.results and os.path.dirname(step.results) == out, (step.name, step.cmd)
        checked.append(step.name)
    assert checked == ["alloc_micro", "checkpoint_real", "swap", "cache_slack", "hf"]


def test_a_failing_step_stops_the_run_and_names_its_command(tmp_path):
    gc = load_script()
    c = gc.Check(tmp_path, dry_run=False, seconds=300)
    c.run("first", [sys.executable, "-c", "print('fine')"], 60)
    with pytest.raises(SystemExit) as e:
        c.run("second", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 60)
    assert e.value.code == 3
    summary = (tmp_path / "gpu-check.log").read_text()
    assert "OK    first" in summary
    assert "FAIL  second" in summary and "sys.exit(3)" in summary and "| boom" in summary
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert {"logs/first.log", "logs/second.log"} <= set(tar.getnames())
    # the live logs are not in OUTDIR: a call ending on a failure (no finish()) leaves only the
    # few files the device tool brings back (at most 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-check.log", "logs.tar.gz"]


def test_out_of_time_stops_before_the_next_step(tmp_path):
    gc = load_script()
    c = gc.Check(tmp_path, dry_run=False, seconds=5)
    with pytest.raises(gc.StepFailed) as e:
        c.run("late", [sys.executable, "-c", "pass"], 60)
    assert e.value.code == 124 and not e.value.started   # never started: nothing to record
    assert "out of time" in (tmp_path / "gpu-check.log").read_text()


def test_results_archive_holds_what_the_steps_wrote_with_checkout_paths(monkeypatch, tmp_path):
    """results.tar.gz carries back the files written under bench/results/ and bench/traces/
    during the call (with their paths in the checkout, so `tar -xzf` lands them), never the
    committed ones the device tool copied in before it (hf-cpu.json and the like)."""
    gc = load_script()
    root = tmp_path / "checkout"
    for d in ("bench/results", "bench/traces", "bench/results/__pycache__"):
        (root / d).mkdir(parents=True)
    old = root / "bench/results/hf-cpu.json"
    old.write_text("{}")
    os.utime(old, (1, 1))   # copied in before the call
    monkeypatch.setattr(gc, "ROOT", root)
    c = gc.Check(tmp_path / "out", dry_run=False, seconds=300)
    (root / "bench/results/swap.json").write_text("{}")
    (root / "bench/traces/gpt2-s1024-b8-native-gpu.json.gz").write_bytes(b"x")
    (root / "bench/results/__pycache__/x.pyc").write_bytes(b"x")
    c.pack()
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        names = sorted(tar.getnames())
    assert names == ["bench/results/swap.json",
                     "bench/traces/gpt2-s1024-b8-native-gpu.json.gz"], names


def _fake_gpu(monkeypatch, tmp_path, outcomes):
    """gpu-check's main on a fake GPU: steps 'run' by outcome (0 ok, else its exit status;
    a callable runs first), in a checkout of its own under tmp_path."""
    gc = load_script()
    root = tmp_path / "checkout"
    (root / "vmalloc").mkdir(parents=True)
    (root / "vmalloc" / "x.py").write_text("x = 1\n")
    monkeypatch.setattr(gc, "ROOT", root)
    monkeypatch.setattr(gc, "probe", lambda env, timeout=300: {
        "gpu": "Fake GPU", "torch": "2.11.0", "cuda": "13.0", "driver": "580"})
    ran = []

    def run(self, name, cmd, timeout, must_pass=True):
        if name in ("wheels", "build", "env", "nvidia-smi"):
            return 0.0
        ran.append(name)
        rc = outcomes.get(name, 0)
        if callable(rc):
            rc = rc(cmd)
        elif name == "pytest-gpu" and rc == 0:   # what pytest writes when a test passed
            xml = next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1]
            Path(xml).write_text('<testsuites><testsuite><testcase classname="tests.test_x" '
                                 'name="test_a" time="0.5"/></testsuite></testsuites>')
        if rc:
            raise gc.StepFailed(rc, 1.5)
        return 2.0

    monkeypatch.setattr(gc.Check, "run", run)
    return gc, root, ran


def _writes_swap_json(cmd):   # bench/swap.py --gpu-only: its gpu key, complete
    path = Path(sys.modules["gpu_check"].ROOT) / "bench/results/swap.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": {"rows": [], "incomplete": False}}))
    return 0


def test_next_records_progress_and_resumes_where_the_last_session_stopped(monkeypatch, tmp_path):
    from gpu_record import PROGRESS
    outcomes = {"alloc_micro": 3}
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, outcomes)
    steps = "pytest-gpu,demo,alloc_micro,checkpoint_real"
    with pytest.raises(SystemExit) as e:
        gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "a")])
    assert e.value.code == 3
    # --next goes on past a failure (one failing step must not cost every later one)
    assert ran == ["pytest-gpu", "demo", "alloc_micro", "checkpoint_real"]
    progress = json.loads((root / PROGRESS).read_text())
    assert {k: v["status"] for k, v in progress["steps"].items()} == {
        "pytest-gpu": "ok", "demo": "ok", "alloc_micro": "failed", "checkpoint_real": "ok"}
    assert progress["steps"]["checkpoint_real"]["gpu"] == "Fake GPU"
    with tarfile.open(tmp_path / "a" / "results.tar.gz") as tar:
        assert "bench/results/gpu-progress.json" in tar.getnames()

    # a second call on the same source: the step that failed would fail again. Nothing else
    # is left, so nothing runs, nothing is built, and it says so (exit 1)
    outcomes.clear()
    ran.clear()
    with pytest.raises(SystemExit) as e:
        gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "b")])
    assert e.value.code == 1 and ran == []
    log = (tmp_path / "b" / "gpu-check.log").read_text()
    assert "SKIP  alloc_micro: it failed for this very source before" in log
    assert "NOTHING RUNNABLE" in log
    # the next session, alloc_micro fixed: the source changed, so the test steps are stale
    # too (the benches done stay done)
    (root / "vmalloc" / "x.py").write_text("x = 2\n")
    ran.clear()
    gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "c")])
    assert ran == ["pytest-gpu", "demo", "alloc_micro"]


def test_a_second_call_on_the_warm_machine_goes_on_from_the_first(monkeypatch, tmp_path):
    """The device tool sends the checkout again for each call, without what the last call
    wrote: gpu-check puts that back, so --next knows what is done without landing in between,
    and the second archive carries both calls' results."""
    from gpu_record import PROGRESS

    def bench(cmd):   # alloc_micro writes its results file
        (gc.ROOT / "bench/results").mkdir(parents=True, exist_ok=True)
        (gc.ROOT / "bench/results/alloc_micro.json").write_text('{"cuda": {}}')
        return 0

    outcomes = {"alloc_micro": bench}
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, outcomes)
    steps = "pytest-gpu,demo,alloc_micro,swap"
    with pytest.raises(SystemExit):   # call 1 runs out of time at swap
        outcomes["swap"] = 124
        gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "a")])
    # the checkout sent again, as committed: no progress, no results
    (root / PROGRESS).unlink()
    (root / "bench/results/alloc_micro.json").unlink()
    outcomes.clear()
    outcomes["swap"] = _writes_swap_json
    ran.clear()
    gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "b")])
    assert ran == ["swap"]
    assert "RESTORE 3 files" in (tmp_path / "b" / "gpu-check.log").read_text()
    with tarfile.open(tmp_path / "b" / "results.tar.gz") as tar:
        names = set(tar.getnames())
        progress = json.load(tar.extractfile("bench/results/gpu-progress.json"))
    assert {"bench/results/alloc_micro.json", "bench/results/gpu-progress.json",
            "bench/results/swap.json"} <= names
    assert {k: v["status"] for k, v in progress["steps"].items()} == {
        "pytest-gpu": "ok", "demo": "ok", "alloc_micro": "ok", "swap": "ok"}


def test_a_resumable_step_that_stopped_in_time_stays_to_do(monkeypatch, tmp_path):
    from gpu_record import PROGRESS

    def e2e(cmd):   # bench/e2e.py --resume FILE --stop-at T: stopped with jobs left
        out = cmd[cmd.index("--resume") + 1]
        path = Path(gc.ROOT) / out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": {"incomplete": True, "not_run": 7}, "results": []}))
        return 0

    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {"e2e-quick": e2e})
    gc.main(["--next", "--no-build", "--only", "e2e-quick", str(tmp_path / "a")])
    progress = json.loads((root / PROGRESS).read_text())
    assert progress["steps"]["e2e-quick"]["status"] == "partial"
    assert (root / "bench/results/e2e-Fake_GPU-quick.json").exists()
    assert "PART  e2e-quick: stopped in time, 7 left" in (tmp_path / "a" / "gpu-check.log").read_text()
    ran.clear()
    gc.main(["--next", "--no-build", "--only", "e2e-quick", str(tmp_path / "b")])
    assert ran == ["e2e-quick"]   # partial: the next call resumes it


def test_gpu_tests_that_all_skip_are_a_failure_not_a_pass(monkeypatch, tmp_path):
    """On a GPU machine, `pytest -m gpu` exiting 0 with every test skipped (torch seeing no
    device inside pytest, say) has tested nothing: recorded failed (--next goes on with the
    rest, and exits with the failure)."""
    from gpu_record import GPU_TESTS, PROGRESS

    def all_skipped(cmd):
        xml = Path(next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1])
        xml.write_text('<testsuites><testsuite><testcase classname="tests.test_x" name="test_a" '
                       'time="0.1"><skipped message="needs a CUDA device"/></testcase>'
                       '</testsuite></testsuites>')
        return 0

    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {"pytest-gpu": all_skipped})
    with pytest.raises(SystemExit) as e:
        gc.main(["--next", "--no-build", "--only", "pytest-gpu,demo", str(tmp_path / "a")])
    assert e.value.code == 1 and ran == ["pytest-gpu", "demo"]
    assert json.loads((root / PROGRESS).read_text())["steps"]["pytest-gpu"]["status"] == "failed"
    assert json.loads((root / GPU_TESTS).read_text())["summary"] == {
        "skipped": 1, "total": 1, "seconds": 0.1}
    assert "no GPU test passed" in (tmp_path / "a" / "gpu-check.log").read_text()


def test_a_bench_fix_leaves_the_tests_done_and_retries_the_failed_bench(monkeypatch, tmp_path):
    """The tests and the demo follow what they exercise (csrc, vmalloc, scheduler, tests, the
    build files): a fix under bench/ or scripts/ must not cost their 200+ s again, but it
    does retry a bench that failed."""
    from gpu_record import PROGRESS
    outcomes = {"alloc_micro": 3}
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, outcomes)
    steps = "pytest-gpu,demo,alloc_micro"
    with pytest.raises(SystemExit):
        gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "a")])
    rec = json.loads((root / PROGRESS).read_text())["steps"]["demo"]
    assert rec["source"] and rec["test_source"]   # both kept
    (root / "bench" / "alloc_micro.py").write_text("fixed = True\n")
    outcomes.clear()
    ran.clear()
    gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "b")])
    assert ran == ["alloc_micro"]
    (root / "tests").mkdir()
    (root / "tests" / "test_new.py").write_text("def test_x(): pass\n")
    ran.clear()
    gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "c")])
    assert ran == ["pytest-gpu", "demo"]


def test_rows_unavailable_count_as_done_and_the_log_names_them(monkeypatch, tmp_path):
    """A method whose optional package is missing here (torchtune without .whl/) writes rows
    `unavailable`: the e2e step is done (not rerun every session), and gpu-check.log says
    which rows and how to run them."""
    from gpu_record import PROGRESS
    rows = [{"model": "resnet50", "method": "torchtune", "batch_size": 64,
             "status": "unavailable", "note": "ModuleNotFoundError: No module named 'torchtune'"},
            {"model": "resnet50", "method": "plain", "batch_size": 64, "status": "ok", "note": ""}]

    def e2e(cmd):
        path = Path(gc.ROOT) / cmd[cmd.index("--resume") + 1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": {}, "results": rows}))
        return 0

    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {"e2e-quick": e2e})
    gc.main(["--next", "--no-build", "--only", "e2e-quick", str(tmp_path / "a")])
    rec = json.loads((root / PROGRESS).read_text())["steps"]["e2e-quick"]
    assert rec["status"] == "ok" and rec["unavailable"] == 1
    log = (tmp_path / "a" / "gpu-check.log").read_text()
    assert "UNAV  e2e-quick: 1 rows unavailable, counted done (torchtune: " in log
    assert "No module named 'torchtune'" in log and ".whl" in log
    ran.clear()
    gc.main(["--next", "--no-build", "--only", "e2e-quick", str(tmp_path / "b")])
    assert ran == []


def test_a_provisional_cache_slack_is_partial_and_waits_for_gpu_inputs(monkeypatch, tmp_path):
    """cache_slack deciding provisionally (host remap costs, or GPU traces of some jobs only)
    is recorded partial (not done), the call goes on to hf, and --next runs it again only once
    what it lacked changed: new GPU traces or alloc_micro's cuda rows (before that it would
    decide the same, in device time)."""
    from gpu_record import PROGRESS

    def cache_slack(cmd):
        path = Path(gc.ROOT) / "bench/results/cache_slack.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": {}, "decision": {
            "provisional": True, "provisional_why": ["no GPU trace yet of bert-dyn-b32"]}}))
        return 0

    def traces(cmd, name="resnet50-b256-native-gpu.json.gz"):
        (Path(gc.ROOT) / "bench/traces" / name).write_bytes(b"x")
        return 0

    outcomes = {"cache_slack": cache_slack, "traces": traces}
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, outcomes)
    (root / "bench/traces").mkdir(parents=True)
    steps = "traces,cache_slack,hf"
    gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "a")])
    assert ran == ["traces", "cache_slack", "hf"]
    rec = json.loads((root / PROGRESS).read_text())["steps"]["cache_slack"]
    assert rec["status"] == "partial" and rec["provisional"] == ["no GPU trace yet of bert-dyn-b32"]
    assert rec["inputs"] == {"gpu_traces": ["resnet50-b256-native-gpu.json.gz"],
                             "cuda_remap_rows": False}
    assert "PROV  cache_slack: its decision is provisional" in (
        tmp_path / "a" / "gpu-check.log").read_text()
    # nothing new to decide from: not run, nothing built for it
    ran.clear()
    gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "b")])
    assert ran == []
    assert "SKIP  cache_slack: decided provisionally before" in (
        tmp_path / "b" / "gpu-check.log").read_text()
    # a traces step in the same call records another GPU trace: it runs in that call
    progress = json.loads((root / PROGRESS).read_text())
    del progress["steps"]["traces"]   # (as for a changed source)
    for where in (root, gc.STATE):    # (the copy a call on the same machine puts back)
        (where / PROGRESS).write_text(json.dumps(progress))
    outcomes["traces"] = lambda cmd: traces(cmd, "bert-dyn-b32-native-gpu.json.gz")
    ran.clear()
    gc.main(["--next", "--no-build", "--only", steps, str(tmp_path / "c")])
    assert ran == ["traces", "cache_slack"]


def test_cache_slack_waits_for_a_gpu_trace(monkeypatch, tmp_path):
    """Without a GPU trace cache_slack would decide on the bundled CPU traces, provisionally,
    in device time: under --next it waits, left out before the build when no traces step is in
    the call (--dry-run shows it as the real call would run it: after the traces step)."""
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {"traces": 1})
    with pytest.raises(SystemExit):   # traces fails, recording nothing
        gc.main(["--next", "--no-build", "--only", "traces,cache_slack,hf", str(tmp_path / "a")])
    assert ran == ["traces", "hf"]
    assert "SKIP  cache_slack: no GPU trace recorded yet" in (
        tmp_path / "a" / "gpu-check.log").read_text()
    ran.clear()   # traces failed for this source: not run again, so cache_slack waits too
    with pytest.raises(SystemExit):
        gc.main(["--next", "--no-build", "--only", "traces,cache_slack", str(tmp_path / "b")])
    log = (tmp_path / "b" / "gpu-check.log").read_text()
    assert ran == [] and "traces is not run in this call" in log and "NOTHING RUNNABLE" in log
    gc.main(["--next", "--dry-run", "--only", "hf,cache_slack", str(tmp_path / "c")])
    assert "traces is not run in this call" in (tmp_path / "c" / "gpu-check.log").read_text()
    gc2, _, ran2 = _fake_gpu(monkeypatch, tmp_path / "fresh", {})
    gc2.main(["--next", "--dry-run", "--only", "traces,cache_slack", str(tmp_path / "d")])
    assert ran2 == ["traces", "cache_slack"]


def test_the_traces_step_is_not_started_without_time_for_one_recording(monkeypatch, tmp_path):
    """record_gpu.py resumes, but one recording takes up to 240 s: with less left it would be
    killed for nothing, so it waits for a later call (the steps after it get the time)."""
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {})
    real_check = gc.Check
    monkeypatch.setattr(gc, "Check", lambda out, dry_run, seconds: real_check(out, dry_run, 200))
    gc.main(["--next", "--no-build", "--only", "traces,hf", str(tmp_path / "a")])
    assert ran == ["hf"]
    assert "SKIP  traces: needs about 240 s" in (tmp_path / "a" / "gpu-check.log").read_text()


def test_keep_going_runs_past_a_failure_and_still_exits_with_it(monkeypatch, tmp_path):
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {"demo": 2})
    with pytest.raises(SystemExit) as e:
        gc.main(["--keep-going", "--no-build", "--only", "pytest-gpu,demo,alloc_micro",
                 str(tmp_path / "a")])
    assert e.value.code == 2 and ran == ["pytest-gpu", "demo", "alloc_micro"]


def test_pytest_junit_becomes_gpu_tests_json(tmp_path):
    """gpu-tests.json from a junit XML that pytest itself wrote: outcome, seconds and the
    failure's first lines per test."""
    import gpu_record
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'the numbers differ'\n"
        "@pytest.mark.skip(reason='no device')\ndef test_skip():\n    pass\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", "test_x.py"], cwd=tmp_path, capture_output=True,
                   timeout=120, env=python_env())
    doc = gpu_record.junit_summary(xml, {"gpu": "Fake GPU"})
    by = {t["test"].split("::")[1]: t for t in doc["tests"]}
    assert {k: t["outcome"] for k, t in by.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_skip": "skipped"}
    assert "the numbers differ" in by["test_bad"]["message"]
    assert by["test_ok"]["test"] == "test_x.py::test_ok"
    assert doc["summary"]["total"] == 3 and doc["summary"]["failed"] == 1
    assert doc["meta"] == {"gpu": "Fake GPU"}


def test_source_hash_follows_the_source_not_build_output(tmp_path):
    import gpu_record
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "a.cpp").write_text("int a;")
    h = gpu_record.source_hash(tmp_path)
    for junk in ("csrc/build/x.cpp", "csrc/__pycache__/a.py", "csrc/a.so"):
        (tmp_path / junk).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / junk).write_text("junk")
    assert gpu_record.source_hash(tmp_path) == h
    (tmp_path / "csrc" / "a.cpp").write_text("int b;")
    assert gpu_record.source_hash(tmp_path) != h
    # the tests' own hash: csrc, vmalloc, scheduler, tests and the build files, not bench/
    # or scripts/ (the whole hash follows those too)
    both = gpu_record.source_hashes(tmp_path)
    for path in ("bench/e2e.py", "scripts/gpu-check"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("changed")
    now = gpu_record.source_hashes(tmp_path)
    assert now["test_source"] == both["test_source"] and now["source"] != both["source"]
    (tmp_path / "pyproject.toml").write_text("[project]")
    assert gpu_record.source_hashes(tmp_path)["test_source"] != both["test_source"]
    bad = tmp_path / "bench" / "results" / "gpu-progress.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="gpu-progress.json is not JSON"):
        gpu_record.load_progress(tmp_path)


def test_only_runs_the_named_steps_and_a_typo_stops_before_the_build(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "swap,e2e-quick",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                       env=python_env())
    assert r.returncode == 0, r.stderr
    assert "bench/swap.py --quick" in r.stdout and "bench/e2e.py --quick" in r.stdout
    assert "SKIP  pytest-gpu: not in --only" in r.stdout and "-m pytest" not in r.stdout
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "swapp",
                        str(tmp_path / "t")], capture_output=True, text=True, timeout=120,
                       env=python_env())
    assert r.returncode != 0 and "'swapp'" in r.stderr and "pytest-gpu" in r.stderr
    assert "dev-build" not in r.stdout   # refused before anything ran


def test_out_of_time_names_the_steps_left_and_the_last_step_gets_all_time(monkeypatch, tmp_path):
    gc = load_script()
    monkeypatch.setattr(gc, "ROOT", tmp_path / "checkout")
    monkeypatch.setattr(gc, "probe", lambda env, timeout=300: {"gpu": "Fake GPU"})
    limits = {}

    def run(self, name, cmd, timeout, must_pass=True):
        limits[name] = timeout
        if name == "swap":
            self.say("FAIL  swap: out of time")
            raise gc.StepFailed(124, 0.0)
        return 0.0

    monkeypatch.setattr(gc.Check, "run", run)
    with pytest.raises(SystemExit) as e:
        gc.main(["--no-build", "--only", "alloc_micro,swap,e2e-quick", str(tmp_path / "a")])
    assert e.value.code == 124
    log = (tmp_path / "a" / "gpu-check.log").read_text()
    assert "continue with: scripts/gpu-check --no-build --only swap,e2e-quick OUTDIR" in log
    assert limits["alloc_micro"] == 300 and "e2e-quick" not in limits
    gc.main(["--no-build", "--only", "alloc_micro", str(tmp_path / "b")])
    assert limits["alloc_micro"] >= 10 ** 6   # the last step: whatever time is left


def test_a_broken_torch_is_a_failure_not_a_machine_without_a_gpu(tmp_path):
    gc = load_script()
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise OSError('libcudart.so.13: cannot open shared object')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"))
    with pytest.raises(RuntimeError, match="libcudart"):
        gc.probe(env)["gpu"]
    # no torch at all (as the import reports it): no GPU steps, not an error
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", "
                                      "name='torch')\n")
    assert gc.probe(env)["gpu"] is None


def test_a_step_that_stopped_for_time_ends_the_call_and_error_rows_stay_to_do(monkeypatch,
                                                                               tmp_path):
    """partial (an e2e run stopped at --stop-at): the steps after it would only be killed, so
    the call ends there; errors (rows that failed, a crashed worker say): recorded not ok, so
    the next --next runs them again, and the call goes on."""
    from gpu_record import PROGRESS

    def writes(meta, rows):
        def step(cmd):
            path = Path(gc.ROOT) / cmd[cmd.index("--resume") + 1]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"meta": meta, "results": rows}))
            return 0
        return step

    crashed = {"model": "resnet50", "method": "window+vmalloc", "batch_size": 64,
               "status": "error", "note": "worker for the vmalloc allocator exited -11"}
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {
        "e2e-quick": writes({}, [crashed]), "e2e-resnet50": writes({"incomplete": True}, [])})
    gc.main(["--next", "--no-build", "--only", "e2e-quick,e2e-resnet50,e2e-gpt2-s1024",
             str(tmp_path / "a")])
    assert ran == ["e2e-quick", "e2e-resnet50"]                 # gpt2 not started
    steps = json.loads((root / PROGRESS).read_text())["steps"]
    assert {k: v["status"] for k, v in steps.items()} == {"e2e-quick": "errors",
                                                          "e2e-resnet50": "partial"}
    log = (tmp_path / "a" / "gpu-check.log").read_text()
    assert "ERRS  e2e-quick: 1 rows in error" in log and "exited -11" in log
    assert "NOT DONE e2e-resnet50,e2e-gpt2-s1024" in log
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "gpu-check.log", "gpu-progress.json", "logs.tar.gz", "results.tar.gz"]


def test_pytest_killed_before_its_junit_leaves_a_record_that_says_so(monkeypatch, tmp_path):
    """No junit XML (pytest killed at its limit): gpu-tests.json says so, never the last
    run's record left in place."""
    from gpu_record import GPU_TESTS, PROGRESS
    def killed(cmd):   # what pytest -v printed before the kill; no XML
        xml = next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1]
        Path(xml).with_suffix(".log").write_text(
            "tests/test_allocator.py::test_bad_sizes_and_pointers[cuda] PASSED  [  1%]\n"
            "tests/test_swap_gpu.py::test_cuda_bit_identical[smallest window-mlp] FAILED [ 40%]\n"
            "tests/test_torch_gpu.py::test_torch_compile_default_mode_trains_on_vmalloc \n")
        return 124

    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {"pytest-gpu": killed})
    (root / GPU_TESTS).parent.mkdir(parents=True, exist_ok=True)
    (root / GPU_TESTS).write_text('{"summary": {"passed": 53}}')   # an earlier session's
    with pytest.raises(SystemExit) as e:
        gc.main(["--next", "--no-build", "--only", "pytest-gpu,demo", str(tmp_path / "a")])
    assert e.value.code == 124
    doc = json.loads((root / GPU_TESTS).read_text())
    assert "no junit XML" in doc["note"] and doc["complete"] is False
    assert [(t["test"], t["outcome"]) for t in doc["tests"]] == [
        ("tests/test_allocator.py::test_bad_sizes_and_pointers[cuda]", "passed"),
        ("tests/test_swap_gpu.py::test_cuda_bit_identical[smallest window-mlp]", "failed")]
    assert json.loads((root / PROGRESS).read_text())["steps"]["pytest-gpu"]["status"] == "timeout"


def test_a_step_killed_at_its_limit_takes_its_children_with_it(monkeypatch, tmp_path):
    """A step's children (e2e's GPU workers, pytest's subprocesses) die with it at its time
    limit instead of holding the GPU through the next step. The limit is made to expire once
    the grandchild exists (it reports its pid through a FIFO), and its exit is awaited with a
    pidfd: no sleeps."""
    import select
    gc = load_script()
    fifo = tmp_path / "pid"
    os.mkfifo(fifo)
    real_popen = subprocess.Popen
    seen = {}

    class Expiring(real_popen):
        def wait(self, timeout=None):
            if timeout is not None and "pid" not in seen:   # the step's wait: expire it
                with open(fifo) as f:
                    seen["pid"] = int(f.read())
                raise subprocess.TimeoutExpired(self.args, timeout)
            return super().wait(timeout)

    monkeypatch.setattr(gc.subprocess, "Popen", Expiring)
    step = ("import subprocess, sys; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(fifo)!r}, 'w').write(str(p.pid)); p.wait()")
    c = gc.Check(tmp_path / "out", dry_run=False, seconds=300)
    with pytest.raises(gc.StepFailed) as e:
        c.run("stuck", [sys.executable, "-c", step], 60)
    assert e.value.code == 124
    try:
        fd = os.pidfd_open(seen["pid"])
    except ProcessLookupError:
        return   # already gone and reaped
    try:
        ready, _, _ = select.select([fd], [], [], 60)   # readable once the process has exited
        assert ready, f"the step's child {seen['pid']} outlived the step's kill"
    finally:
        os.close(fd)


def test_a_step_that_needs_more_time_than_is_left_waits_for_a_later_call(monkeypatch, tmp_path):
    """A step that cannot stop in time and needs more than is left is not started (it would be
    killed with nothing kept): the steps after it get the time, and the log names it."""
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {"swap": _writes_swap_json})
    real_check = gc.Check

    def short_check(out, dry_run, seconds):   # 100 s left: less than checkpoint_real needs
        return real_check(out, dry_run, 100)
    monkeypatch.setattr(gc, "Check", short_check)
    gc.main(["--next", "--no-build", "--only", "demo,checkpoint_real,swap", str(tmp_path / "a")])
    assert ran == ["demo", "swap"]
    log = (tmp_path / "a" / "gpu-check.log").read_text()
    assert "SKIP  checkpoint_real: needs about 120 s" in log
    assert "NOT DONE checkpoint_real" in log


def test_no_build_on_a_fresh_machine_builds_after_all(monkeypatch, tmp_path):
    """The device tool gives a machine back when it idles: a second call may land on a bare
    one, where --no-build would leave nothing to import (on a GPU machine only: elsewhere
    --no-build is taken at its word, and CI's checkout is never built by a test)."""
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {})
    monkeypatch.setattr(gc, "gpu_machine", lambda: True)
    steps = []
    real_run = gc.Check.run

    def run(self, name, cmd, timeout, must_pass=True):
        steps.append(name)
        return real_run(self, name, cmd, timeout, must_pass)
    monkeypatch.setattr(gc.Check, "run", run)
    gc.main(["--no-build", "--only", "demo", str(tmp_path / "a")])
    assert "build" in steps   # no vmalloc/_core*.so in the fake checkout
    import sysconfig
    (root / "vmalloc" / f"_core{sysconfig.get_config_var('EXT_SUFFIX')}").write_bytes(b"")
    steps.clear()
    gc.main(["--no-build", "--only", "demo", str(tmp_path / "b")])
    assert "build" not in steps
    (root / "vmalloc" / f"_core{sysconfig.get_config_var('EXT_SUFFIX')}").unlink()
    monkeypatch.setattr(gc, "gpu_machine", lambda: False)
    steps.clear()
    gc.main(["--no-build", "--only", "demo", str(tmp_path / "c")])
    assert "build" not in steps


def test_failed_rows_of_a_bench_that_exits_0_fail_its_step(monkeypatch, tmp_path):
    """alloc_micro, checkpoint_real and hf record a row's exception and go on (the other rows
    are kept) with exit status 0: the step is recorded failed all the same (retried once the
    source changes, as when the exception ended the script), never ok for good."""
    from gpu_record import PROGRESS

    def hf(cmd):
        path = Path(gc.ROOT) / "bench" / "results" / "hf-Fake_GPU.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": {}, "models": [
            {"model": "gpt2", "rows": [{"method": "rotor", "budget": 1, "status": "ok"}]},
            {"model": "bert", "rows": [{"method": "pofo", "budget": 2, "status": "error",
                                        "note": "RuntimeError: stream"}]}]}))
        return 0

    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, {"hf": hf})
    with pytest.raises(SystemExit):
        gc.main(["--next", "--no-build", "--only", "hf", str(tmp_path / "a")])
    assert json.loads((root / PROGRESS).read_text())["steps"]["hf"]["status"] == "failed"
    log = (tmp_path / "a" / "gpu-check.log").read_text()
    assert "FAIL  hf: 1 rows failed" in log and "bert/pofo: RuntimeError: stream" in log
    gc2 = load_script()
    assert gc2.row_errors({"cuda": {"errors": {"remap k=32": "boom"}}}) == [
        {"status": "error", "method": "cuda remap k=32", "note": "boom"}]
    assert gc2.row_errors({"gpu": {"rows": [{"status": "error"}, {"status": "ok"}]}}) == [
        {"status": "error"}]
    assert gc2.row_errors({"models": [{"model": "m", "error": "x"}]})[0]["note"] == "x"


WRITE_CUT_SHORT = """
import resource, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import gpu_record
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # past the limit: an OSError (EFBIG), no kill
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    gpu_record.write_json(Path(sys.argv[2]), {"steps": {"demo": {"note": "x" * 100000}}})
except OSError as exc:
    print("cut short: errno", exc.errno)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE as on Linux")
def test_a_record_write_cut_short_leaves_the_last_record(tmp_path):
    """A write of gpu-progress.json that stops part-way (gpu-check killed at a time limit; here
    the file-size limit stops it after 4 KiB) leaves the record as it was and no temporary
    file: written in place it left a truncated file, and every later gpu-check stopped on it
    ("is not JSON")."""
    import gpu_record
    path = tmp_path / gpu_record.PROGRESS
    path.parent.mkdir(parents=True)
    last = {"steps": {"build": {"status": "ok", "seconds": 60.0}}}
    path.write_text(json.dumps(last))
    r = subprocess.run([sys.executable, "-c", WRITE_CUT_SHORT, str(Path(ROOT) / "scripts"),
                        str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"cut short: errno {errno.EFBIG}" in r.stdout, r.stdout + r.stderr
    assert gpu_record.load_progress(tmp_path) == last
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_a_record_is_written_whole(tmp_path):
    import gpu_record
    doc = {"steps": {"demo": {"status": "ok", "seconds": 12.5}}}
    gpu_record.write_json(tmp_path / gpu_record.PROGRESS, doc)
    assert gpu_record.load_progress(tmp_path) == doc
