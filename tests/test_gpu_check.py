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
    for step in ("pytest-gpu", "alloc_micro", "swap", "checkpoint_real", "e2e-quick"):
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
    for cmd in ("scripts/dev-build", "-m pytest -m gpu", "bench/alloc_micro.py --quick",
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
