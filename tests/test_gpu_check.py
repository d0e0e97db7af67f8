"""scripts/gpu-check on a machine without a GPU: it runs, skips its GPU steps cleanly, leaves
few files in OUTDIR (the device tool returns at most 8, 2 folders deep), and a failing step stops
it with the command named."""
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from _subproc import ROOT, python_env

SCRIPT = Path(ROOT) / "scripts" / "gpu-check"


def load_script():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    mod = importlib.util.module_from_spec(spec)
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
        assert f"bench/e2e.py --models {m} --out" in r.stdout, (m, r.stdout)
    assert "--coexist" in r.stdout
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--full", "--models",
                        "bert-dyn", str(tmp_path / "m")],
                       capture_output=True, text=True, timeout=120, env=python_env())
    assert "--models bert-dyn" in r.stdout and "--models resnet50 --out" not in r.stdout
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--traces", str(tmp_path / "t")],
                       capture_output=True, text=True, timeout=120, env=python_env())
    assert r.returncode == 0, r.stderr
    assert "bench/traces/record_gpu.py" in r.stdout and "bench/e2e.py" not in r.stdout
    # cache_slack replays the traces just recorded, after them and before hf
    assert r.stdout.index("record_gpu.py") < r.stdout.index("bench/cache_slack.py --traces-dir") \
        < r.stdout.index("bench/hf.py")


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


def test_out_of_time_stops_before_the_next_step(tmp_path):
    gc = load_script()
    c = gc.Check(tmp_path, dry_run=False, seconds=5)
    with pytest.raises(SystemExit) as e:
        c.run("late", [sys.executable, "-c", "pass"], 60)
    assert e.value.code == 124
    assert "out of time" in (tmp_path / "gpu-check.log").read_text()


def test_results_patterns_collect_what_the_benches_write_on_a_gpu(monkeypatch, tmp_path):
    """bench/hf.py and bench/checkpoint_real.py name their results after the GPU; gpu-check
    must bring those back (and not the committed CPU ones, hf-cpu.json and the like)."""
    import fnmatch
    import types

    import torch
    gc = load_script()
    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    sys.path.insert(0, str(Path(ROOT) / "bench"))
    try:
        from common import run_meta   # bench/hf.py's results name
    finally:
        sys.path.pop(0)
    hf_file = f"hf-{run_meta('x', 'cuda')['device_tag']}.json"
    ck_file = f"checkpoint_real-{name.replace(' ', '_')}.json"   # bench/checkpoint_real.py's
    tag = gc.device_tag(name)
    for mode, step, wanted, stale in (("traces", "hf", hf_file, "hf-cpu.json"),
                                      ("quick", "checkpoint_real", ck_file,
                                       "checkpoint_real-cpu.json")):
        args = types.SimpleNamespace(full=False, traces=mode == "traces", models="")
        pattern = next(s[3] for s in gc.steps_for(args, tmp_path) if s[0] == step)
        pattern = pattern.format(tag=tag)
        assert fnmatch.fnmatch(wanted, pattern), (wanted, pattern)
        assert not fnmatch.fnmatch(stale, pattern), (stale, pattern)


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
    monkeypatch.setattr(gc, "cuda_device", lambda env: "Fake GPU")
    limits = {}

    def run(self, name, cmd, timeout, must_pass=True):
        limits[name] = timeout
        if name == "swap":
            self.say("FAIL  swap: out of time")
            raise SystemExit(124)

    monkeypatch.setattr(gc.Check, "run", run)
    monkeypatch.setattr(gc.Check, "collect", lambda self, pattern: None)
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
        gc.cuda_device(env)
    # no torch at all (as the import reports it): no GPU steps, not an error
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", "
                                      "name='torch')\n")
    assert gc.cuda_device(env) is None
