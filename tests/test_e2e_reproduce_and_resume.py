"""What a results file says about how it was made: the command it records (the README's
"Reproduce:") leaves out the device call's ``--stop-at`` deadline (bench/e2e.py,
bench/cache_slack.py and bench/swap.py, through ``bench.common.reproduce_command``), and
``bench/e2e.py --resume`` refuses a file measured under another budget, step count, GPU or
method list rather than mix its rows with this run's, while the calls scripts/gpu-check
repeats (the same flags, a new --stop-at) still resume."""
import json
import sys

import pytest

import test_bench_swap_gpu_only as swap_fakes
from _e2e_fakes import jobs_run
from bench import cache_slack as cs
from bench import e2e, e2e_grid
from bench.common import reproduce_command, without_stop_at
from test_cache_slack import _tiny_gpu_trace

FAR = "4102444800"   # 2100: a deadline that stops nothing
fake_gpu = swap_fakes.fake_gpu   # bench/swap.py --gpu-only with its workers faked


# ------------------------------------------------------------------ the recorded command
@pytest.mark.parametrize("argv, kept", [
    (["--quick", "--stop-at", "123", "--out", "d"], ["--quick", "--out", "d"]),
    (["--stop-at=123.5", "--quick"], ["--quick"]),
    (["--quick", "--stop-at"], ["--quick"]),     # (argparse refuses it; nothing to keep)
    (["--steps", "3"], ["--steps", "3"]),
])
def test_without_stop_at_drops_the_flag_and_its_value(argv, kept):
    assert without_stop_at(argv) == kept
    assert reproduce_command("bench/x.py", argv) == " ".join(["python", "bench/x.py", *kept])


@pytest.mark.parametrize("deadline", [["--stop-at", FAR], ["--stop-at=" + FAR]])
def test_e2e_records_its_command_without_the_deadline(tmp_path, deadline):
    out = tmp_path / "e2e.json"
    argv = ["--smoke", "--models", "gpt2-s32", "--methods", "native", "--steps", "1",
            *deadline, "--out", str(out)]
    assert e2e.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["command"] == ("python bench/e2e.py --smoke --models gpt2-s32 --methods "
                                      f"native --steps 1 --out {out}")
    assert len(doc["results"]) == 1 and "incomplete" not in doc["meta"]


@pytest.mark.parametrize("deadline", [["--stop-at", FAR], ["--stop-at=" + FAR]])
def test_cache_slack_records_its_command_without_the_deadline(tmp_path, deadline):
    _tiny_gpu_trace(tmp_path / "tiny-b1-native-gpu.json.gz")
    (tmp_path / "am.json").write_text(json.dumps(
        {"cuda": {"device": "Fake GPU", "vmalloc_remap": [{"k": 2, "us_per_chunk_remapped": 20.0}]}}))
    argv = ["--traces-dir", str(tmp_path), "--alloc-micro", str(tmp_path / "am.json"),
            *deadline, "--out", str(tmp_path)]
    assert cs.main(argv) == 0
    command = json.loads((tmp_path / "cache_slack.json").read_text())["meta"]["command"]
    assert command == (f"python bench/cache_slack.py --traces-dir {tmp_path} --alloc-micro "
                       f"{tmp_path / 'am.json'} --out {tmp_path}")


def test_swap_records_its_command_without_the_deadline_in_either_spelling(fake_gpu, monkeypatch):
    path, _ = fake_gpu
    monkeypatch.setattr(sys, "argv", ["bench/swap.py", "--quick", "--gpu-only", "--stop-at=35",
                                      "--out", str(path.parent)])
    swap_fakes.bench_swap.gpu_only(swap_fakes._args(stop_at=35.0))
    command = json.loads(path.read_text())["gpu"]["meta"]["command"]
    assert command == f"python bench/swap.py --quick --gpu-only --out {path.parent}"


# ------------------------------------------------------------------ --resume's settings
GRID = ["--smoke", "--models", "gpt2-s32", "--methods", "native,window", "--steps", "1",
        "--budget", "300KiB"]


def _with(flag, value):
    argv = list(GRID)
    argv[argv.index(flag) + 1] = value
    return argv


@pytest.fixture
def resumed_file(tmp_path):
    """A file as scripts/gpu-check's calls leave it: the same flags each time, a new --stop-at
    (the first call's deadline already past: nothing run, only the file's meta)."""
    out = tmp_path / "e2e.json"
    assert e2e.main(GRID + ["--resume", str(out), "--stop-at", "0"]) == 0
    first = json.loads(out.read_text())
    assert first["results"] == [] and first["meta"]["incomplete"] is True
    assert first["meta"]["grid"] == {"budget": 300 << 10, "steps": 1,
                                     "methods": ["native", "window"], "timed_seconds": 15.0,
                                     "min_timed": 3}
    assert e2e.main(GRID + ["--resume", str(out), "--stop-at", FAR]) == 0
    return out


def test_the_same_flags_resume_and_run_nothing_twice(resumed_file, monkeypatch):
    doc = json.loads(resumed_file.read_text())
    assert [r["method"] for r in doc["results"]] == ["native", "window"]
    ran = jobs_run(monkeypatch, e2e_grid)
    assert e2e.main(GRID + ["--resume", str(resumed_file), "--stop-at", FAR]) == 0
    assert ran == [] and json.loads(resumed_file.read_text())["meta"]["resumed_from"] == 2
    # a method added (as to GPU_DEFAULT in a later commit) is run, the rows kept
    assert e2e.main(_with("--methods", "native,window,rotor") + ["--resume", str(resumed_file)]) == 0
    assert ran == ["native", "rotor"]   # plain training's reference, then the new method


@pytest.mark.parametrize("flag, value, says", [
    ("--budget", "2MiB", "with --budget 300.00 KiB (this run: 2.00 MiB)"),
    ("--steps", "4", "with --steps 1 (this run: 4)"),
    ("--methods", "native", "with methods window, which this run does not run"),
])
def test_resume_refuses_rows_measured_otherwise(resumed_file, monkeypatch, flag, value, says):
    before = resumed_file.read_text()
    ran = jobs_run(monkeypatch, e2e_grid)
    with pytest.raises(SystemExit) as e:
        e2e.main(_with(flag, value) + ["--resume", str(resumed_file)])
    assert says in str(e.value.code) and str(resumed_file) in str(e.value.code)
    assert ran == [] and resumed_file.read_text() == before   # nothing run, nothing written


def test_resume_refuses_rows_of_another_gpu(resumed_file):
    doc = json.loads(resumed_file.read_text())
    doc["meta"]["gpu"] = "NVIDIA H100 80GB HBM3"
    resumed_file.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match=r"on 'NVIDIA H100 80GB HBM3' \(this run: 'cpu'\)"):
        e2e.main(GRID + ["--resume", str(resumed_file)])


def test_a_file_from_before_meta_grid_still_resumes(resumed_file, monkeypatch):
    doc = json.loads(resumed_file.read_text())
    del doc["meta"]["grid"]   # what earlier sessions wrote: nothing to hold against it
    resumed_file.write_text(json.dumps(doc))
    ran = jobs_run(monkeypatch, e2e_grid)
    assert e2e.main(_with("--steps", "2") + ["--resume", str(resumed_file)]) == 0
    assert ran == []
