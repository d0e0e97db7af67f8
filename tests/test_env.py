import os
import subprocess
import sys

import pytest

from _subproc import python_env

from vmalloc.env import VARIABLES, EnvConfig, parse_flag, read_env
from vmalloc.sizes import parse_size


def test_unset_is_inactive():
    cfg = read_env({})
    assert cfg == EnvConfig()
    assert not cfg.active


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("Yes", True), (" on ", True),
                                      ("0", False), ("", False), ("off", False), ("FALSE", False)])
def test_flag_values(value, on):
    assert read_env({"VMALLOC": value}).enabled is on


def test_sizes_are_parsed_with_the_shared_parser():
    cfg = read_env({"VMALLOC": "1", "VMALLOC_CHUNK_SIZE": "20MiB", "VMALLOC_BUDGET": "16GiB",
                    "VMALLOC_WINDOW": "2GB", "VMALLOC_REPORT": "out.json"})
    assert cfg == EnvConfig(True, 20 << 20, 16 << 30, 2_000_000_000, os.path.abspath("out.json"))
    assert cfg.active


def test_budget_zero_means_no_cap_and_window_alone_activates():
    cfg = read_env({"VMALLOC_BUDGET": "0", "VMALLOC_WINDOW": "1GiB"})
    assert cfg.budget is None and cfg.window == 1 << 30 and cfg.active and not cfg.enabled


@pytest.mark.parametrize("name,value", [
    ("VMALLOC", "maybe"), ("VMALLOC", "2"), ("VMALLOC_CHUNK_SIZE", "2 parsecs"),
    ("VMALLOC_CHUNK_SIZE", "0"), ("VMALLOC_BUDGET", "-1GiB"), ("VMALLOC_BUDGET", "1.5B"),
    ("VMALLOC_WINDOW", "lots"), ("VMALLOC_WINDOW", "0"),
])  # (a chunk size that is no multiple of 2 MiB: with VMALLOC=1, test_a_chunk_size_cuda_cannot...)
def test_malformed_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        read_env({name: value})


def test_parse_flag_names_the_variable():
    with pytest.raises(ValueError, match="SOME_FLAG"):
        parse_flag("x", "SOME_FLAG")


def test_every_variable_is_documented():
    assert set(VARIABLES) == {"VMALLOC", "VMALLOC_CHUNK_SIZE", "VMALLOC_BUDGET", "VMALLOC_WINDOW",
                              "VMALLOC_REPORT"}


def test_a_5000_digit_budget_names_the_variable():
    with pytest.raises(ValueError, match="VMALLOC_BUDGET: .* too large"):
        read_env({"VMALLOC_BUDGET": "9" * 5000})


@pytest.mark.parametrize("where", ["missing dir", "directory", "read-only dir", "read-only file"])
def test_an_unwritable_report_target_is_refused_at_start_up(tmp_path, where):
    # issue 16 item 8: found only at exit before (traceback in atexit, exit 0, report lost)
    ro = tmp_path / "ro"
    ro.mkdir()
    target = {"missing dir": tmp_path / "nope" / "r.txt", "directory": tmp_path,
              "read-only dir": ro / "r.json", "read-only file": tmp_path / "r.txt"}[where]
    if where == "read-only file":
        target.write_text("old")
        target.chmod(0o444)
    ro.chmod(0o555)
    try:
        if where.startswith("read-only") and os.access(ro, os.W_OK):
            pytest.skip("running as root: permissions do not bind")
        with pytest.raises(ValueError, match=r"VMALLOC_REPORT: .*(does not exist|directory|"
                                             r"not writable)"):
            read_env({"VMALLOC_REPORT": str(target)})
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("target", ["-", "stderr", "report.json"])
def test_streams_and_writable_paths_are_accepted(tmp_path, monkeypatch, target):
    monkeypatch.chdir(tmp_path)
    want = target if target in ("-", "stderr") else str(tmp_path / target)
    assert read_env({"VMALLOC_REPORT": target}).report == want


@pytest.mark.parametrize("target", ["report.json", "sub/../report.json", "~/report.json"])
def test_a_report_path_is_kept_as_the_absolute_path_checked(tmp_path, monkeypatch, target):
    """It was checked as abspath(expanduser(...)) but kept raw: written at exit relative to
    the directory of the moment (after an os.chdir, elsewhere), and ``~`` not expanded."""
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert read_env({"VMALLOC_REPORT": target}).report == str(tmp_path / "report.json")


@pytest.mark.parametrize("env", [{"VMALLOC_BUDGET": "1MiB"},
                                 {"VMALLOC_BUDGET": "3MiB", "VMALLOC_CHUNK_SIZE": "4MiB"}])
def test_a_budget_below_one_chunk_is_refused_at_start_up_naming_both(env):
    """It passed start-up, then every CUDA allocation failed: the allocator refuses it."""
    with pytest.raises(ValueError, match=r"VMALLOC_BUDGET: .* is smaller than one chunk "
                                         r"\(VMALLOC_CHUNK_SIZE: [24] MiB\)"):
        read_env({"VMALLOC": "1", **env})
    # a budget of one chunk or more, none (0), or one for the swap runtime alone, passes
    assert read_env({"VMALLOC": "1", "VMALLOC_BUDGET": "2MiB"}).budget == 2 << 20
    assert read_env({"VMALLOC": "1", "VMALLOC_BUDGET": "0"}).budget is None
    assert read_env({"VMALLOC_WINDOW": "1GiB", **env}).budget == parse_size(env["VMALLOC_BUDGET"])


def test_a_budget_below_one_chunk_is_refused_where_it_is_given():
    """vmalloc.enable/pool/cupy.enable: before torch (or CuPy) is asked anything."""
    import vmalloc
    import vmalloc.cupy
    for enable in (vmalloc.enable, vmalloc.pool, vmalloc.cupy.enable):
        with pytest.raises(ValueError, match=r"budget: 1 MiB .* smaller than one chunk "
                                             r"\(chunk_size: 2 MiB\)"):
            cm = enable(budget="1MiB")
            if enable is vmalloc.pool:
                cm.__enter__()
        with pytest.raises(ValueError, match=r"budget: 6 MiB .*\(chunk_size: 8 MiB\)"):
            cm = enable(chunk_size="8MiB", budget=6 << 20)
            if enable is vmalloc.pool:
                cm.__enter__()


def test_a_budget_below_one_chunk_stops_the_interpreter_with_exit_2(tmp_path):
    env = python_env(VMALLOC="1", VMALLOC_BUDGET="1MiB")
    code = "from vmalloc import _autoload; _autoload.install(); print('went on')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=str(tmp_path))
    assert r.returncode == 2 and "went on" not in r.stdout
    assert "VMALLOC_BUDGET" in r.stderr and "VMALLOC_CHUNK_SIZE" in r.stderr


def test_an_unwritable_report_stops_the_interpreter_with_exit_2(tmp_path):
    # the vmalloc this process imported (installed in CI), run from outside the checkout
    env = python_env(VMALLOC_REPORT=str(tmp_path / "missing" / "r.txt"))
    code = "from vmalloc import _autoload; _autoload.install(); print('went on')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=str(tmp_path))
    assert r.returncode == 2 and "went on" not in r.stdout
    assert "VMALLOC_REPORT" in r.stderr and "does not exist" in r.stderr


@pytest.mark.parametrize("value, near", [("40MB", "38 MiB or 40 MiB"), ("1MiB", "2 MiB"),
                                         ("3MiB", "2 MiB or 4 MiB")])
def test_a_chunk_size_cuda_cannot_map_is_refused_where_it_is_given(value, near):
    """Before, ``VMALLOC_CHUNK_SIZE=40MB`` (the paper's size, in decimal megabytes) was
    accepted at start-up and every CUDA allocation then failed, from whatever op came first,
    in words naming chunk_size only."""
    import vmalloc
    with pytest.raises(ValueError, match=f"VMALLOC_CHUNK_SIZE: '{value}'.*2 MiB.*{near}"):
        read_env({"VMALLOC": "1", "VMALLOC_CHUNK_SIZE": value})
    for enable in (vmalloc.enable, vmalloc.pool):  # checked before CUDA is asked for
        with pytest.raises(ValueError, match=f"chunk_size: '{value}'.*{near}"):
            cm = enable(chunk_size=value)
            if enable is vmalloc.pool:
                cm.__enter__()


@pytest.mark.parametrize("value", ["40MB", "1MiB", "3MiB"])
def test_an_unused_chunk_size_is_not_held_to_the_cuda_granularity(value):
    """Without VMALLOC=1 the chunk size does nothing (the autoload says it is ignored): a
    leftover VMALLOC_CHUNK_SIZE=40MB stopped every Python process with exit 2 (VMALLOC_REPORT
    alone measures PyTorch's own allocator), while the budget's check against one chunk was
    already skipped there. A value that is no size at all is still an error."""
    for env in ({}, {"VMALLOC": "0"}, {"VMALLOC_WINDOW": "1GiB"}, {"VMALLOC_REPORT": "-"}):
        assert read_env({**env, "VMALLOC_CHUNK_SIZE": value}).chunk_size == parse_size(value)
    with pytest.raises(ValueError, match="VMALLOC_CHUNK_SIZE"):
        read_env({"VMALLOC_CHUNK_SIZE": "forty"})


def test_an_unused_chunk_size_is_said_and_the_program_runs(tmp_path):
    env = {k: v for k, v in python_env(VMALLOC_REPORT="-", VMALLOC_CHUNK_SIZE="40MB").items()
           if k != "VMALLOC"}
    code = "from vmalloc import _autoload; _autoload.install(); print('went on')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=str(tmp_path))
    assert r.returncode == 0 and "went on" in r.stdout, r.stderr
    assert "ignored, since VMALLOC is unset: VMALLOC_CHUNK_SIZE=40MB (takes effect only with " \
           "VMALLOC=1)" in r.stderr


@pytest.mark.parametrize("value", ["stdout", "STDOUT", " Stdout "])
def test_report_to_stdout_by_name_is_stdout_not_a_file(value, tmp_path, monkeypatch):
    """VMALLOC_REPORT=stdout wrote a file named "stdout" in the current directory."""
    monkeypatch.chdir(tmp_path)
    assert read_env({"VMALLOC_REPORT": value}).report == "-"
    assert read_env({"VMALLOC_REPORT": "./stdout"}).report == str(tmp_path / "stdout")


def test_report_to_stdout_writes_no_file(tmp_path):
    """The exit report of a process run with VMALLOC_REPORT=stdout goes to its stdout."""
    code = "from vmalloc import _autoload; _autoload.install(); import torch; print('went on')"
    env = {k: v for k, v in python_env(VMALLOC_REPORT="stdout").items()
           if k not in ("VMALLOC", "VMALLOC_WINDOW")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(tmp_path), env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "vmalloc report:" in r.stdout and not (tmp_path / "stdout").exists()
