"""scripts/gpu-check's refusals and advice, before a GPU session spends its minutes: ``--only``
runs a step of any mode without that mode's flag (the command ``--next`` advises for a step
that failed for this source), and a ``--models`` name bench/e2e.py cannot train is refused
before anything is built or recorded."""
import re
import shlex
import subprocess
import sys

import pytest

from _subproc import ROOT, python_env
from test_gpu_check import SCRIPT, _fake_gpu, load_script

# the steps outside the quick mode: --only refused them without --traces / --full
OTHER_MODES = ("traces", "cache_slack", "hf", "e2e-resnet50", "e2e-gpt2-s1024", "e2e-gpt2-s2048",
               "e2e-bert-dyn", "e2e-coexist")


@pytest.fixture(autouse=True)
def _own_state(monkeypatch, tmp_path):
    """Never the real machine state folder (a later call would restore its files)."""
    monkeypatch.setenv("VMALLOC_GPU_CHECK_STATE", str(tmp_path / "machine-state"))


@pytest.mark.parametrize("step", OTHER_MODES)
def test_only_runs_a_step_of_any_mode_without_its_flag(tmp_path, capsys, step):
    gc = load_script()
    gc.main(["--dry-run", "--only", step, str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert re.search(rf"DRY   {re.escape(step)}: ", out), out
    assert "DRY   pytest-gpu" not in out and "SKIP  pytest-gpu: not in --only" in out


def test_only_keeps_the_modes_order_and_still_refuses_a_typo(tmp_path, capsys):
    gc = load_script()
    gc.main(["--dry-run", "--full", "--models", "bert-dyn,resnet50", "--only",
             "e2e-resnet50,e2e-bert-dyn", str(tmp_path / "o")])
    ran = re.findall(r"DRY   (e2e-[\w-]+):", capsys.readouterr().out)
    assert ran == ["e2e-bert-dyn", "e2e-resnet50"]   # --models' order, as before
    with pytest.raises(SystemExit, match=r"unknown step\(s\) \['hff'\].*cache_slack.*e2e-coexist"):
        gc.main(["--dry-run", "--only", "hff", str(tmp_path / "t")])


@pytest.mark.parametrize("step", ["traces", "hf"])
def test_the_command_next_advises_for_a_failed_step_runs_it(monkeypatch, tmp_path, step):
    outcomes = {step: 3}
    gc, root, ran = _fake_gpu(monkeypatch, tmp_path, outcomes)
    with pytest.raises(SystemExit):
        gc.main(["--next", "--no-build", "--only", step, str(tmp_path / "a")])
    outcomes.clear()
    with pytest.raises(SystemExit):   # failed for this very source: not run again, advice given
        gc.main(["--next", "--no-build", "--only", step, str(tmp_path / "b")])
    log = (tmp_path / "b" / "gpu-check.log").read_text()
    advice = re.search(r"run it again with scripts/gpu-check (.+?) \(no --next\)", log)
    assert advice, log
    ran.clear()
    gc.main(["--no-build", *shlex.split(advice.group(1)), str(tmp_path / "c")])
    assert ran == [step]


def test_a_models_typo_is_refused_before_the_build_and_leaves_no_record(monkeypatch, tmp_path,
                                                                         capsys):
    gc, root, _ = _fake_gpu(monkeypatch, tmp_path, {})
    # the zoo check imports bench/ from the real checkout (the fake one has none)
    monkeypatch.setenv("PYTHONPATH", ROOT)
    ran = []
    monkeypatch.setattr(gc.Check, "run", lambda self, name, *a, **k: ran.append(name) or 0.0)
    with pytest.raises(SystemExit) as e:
        gc.main(["--full", "--models", "gpt2-s2048,resnet5", str(tmp_path / "a")])
    assert e.value.code == 2 and ran == []
    err = capsys.readouterr().err
    assert "'resnet5'" in err and "resnet50" in err and "bert-dyn" in err, err
    assert "gpt2-s2048'" not in err   # the good name is not blamed
    assert not (root / "bench" / "results" / "gpu-progress.json").exists()
    assert not (tmp_path / "a").exists()   # refused before OUTDIR was made


def test_models_are_checked_in_a_dry_run_and_good_ones_pass():
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--full", "--models",
                        "resnet5,bert-x", "/nonexistent/never-made"], capture_output=True,
                       text=True, timeout=300, env=python_env())
    assert r.returncode == 2, r.stdout + r.stderr
    assert "'resnet5'" in r.stderr and "'bert-x'" in r.stderr and "resnet101" in r.stderr
    assert "dev-build" not in r.stdout
    gc = load_script()
    assert gc.models_error(list(gc.E2E_MODELS)) is None   # the full grid's: asked of no one
    assert gc.models_error(["gpt2-s4096", "bert-s128", "resnet101"]) is None


def test_the_advice_and_the_progress_record_name_steps_that_select_steps_knows(tmp_path):
    """Every step --next may record (and so advise to run again) is one --only accepts
    without a mode flag."""
    gc = load_script()
    args = gc.argparse.Namespace(next=True, full=False, traces=False,
                                 models=",".join(gc.E2E_MODELS))
    plain = gc.argparse.Namespace(next=False, full=False, traces=False,
                                  models=",".join(gc.E2E_MODELS))
    names = [s.name for s in gc.steps_for(args, tmp_path)]
    c = gc.Check(tmp_path / "o", dry_run=True, seconds=60)
    chosen = gc.select_steps(gc.steps_for(plain, tmp_path), ",".join(names), c,
                             gc.every_step(plain, tmp_path))
    assert [s.name for s in chosen] == names
