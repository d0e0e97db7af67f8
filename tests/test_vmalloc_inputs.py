"""Inputs a user gets wrong, answered early and by name (user-journey review): ambiguous size
units, CLI paths and options checked before the work, malloc/free arguments, report section
names and PNG names, the no-CUDA warning's attribution, enable(backend=...)."""
import json
import site
import subprocess
import sys

import numpy as np
import pytest

import vmalloc
from _subproc import autoload_env, python_env
from vmalloc import Allocator, OutOfMemoryError
from vmalloc.cli import main
from vmalloc.env import read_env
from vmalloc.sizes import parse_size

C = 64 << 10

# ------------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize("bad,binary,decimal", [
    ("2G", "2GiB", "2GB"), ("2g", "2GiB", "2GB"), ("16G", "16GiB", "16GB"), ("2M", "2MiB", "2MB"),
    ("2k", "2KiB", "2KB"), ("1T", "1TiB", "1TB"), ("0.5m", "0.5MiB", "0.5MB"),
    ("2Gb", "2GiB", "2GB"), ("2gb", "2GiB", "2GB"), ("2Mb", "2MiB", "2MB"), ("4kb", "4KiB", "4KB"),
])
def test_ambiguous_units_are_refused_naming_input_and_both_spellings(bad, binary, decimal):
    with pytest.raises(ValueError) as info:
        parse_size(bad, "VMALLOC_WINDOW")
    msg = str(info.value)
    assert msg.startswith("VMALLOC_WINDOW: ") and repr(bad) in msg
    assert f"'{binary}'" in msg and f"'{decimal}'" in msg


@pytest.mark.parametrize("text,expected", [
    ("2GB", 2 * 10**9), ("2kB", 2000), ("2KB", 2000), ("40MB", 40 * 10**6), ("2MiB", 2 << 20),
    ("2mib", 2 << 20), ("2GIB", 2 << 30), ("16GiB", 16 << 30), ("3B", 3), ("3b", 3), ("7", 7),
])
def test_unambiguous_units_still_read(text, expected):
    assert parse_size(text) == expected


def test_env_names_the_variable_for_an_ambiguous_size():
    with pytest.raises(ValueError, match=r"VMALLOC_WINDOW: '2G' is ambiguous.*'2GiB'"):
        read_env({"VMALLOC_WINDOW": "2G"})


@pytest.mark.skipif(not site.ENABLE_USER_SITE, reason="user site-packages disabled")
def test_an_ambiguous_size_in_the_environment_stops_the_program(tmp_path):
    env = autoload_env(tmp_path, VMALLOC="1", VMALLOC_BUDGET="16G")
    r = subprocess.run([sys.executable, "-c", "print('should not run')"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 2 and "should not run" not in r.stdout
    assert "VMALLOC_BUDGET: '16G' is ambiguous" in r.stderr and "'16GiB'" in r.stderr


# ------------------------------------------------------------------------------------ CLI


def _tiny_trace(tmp_path):
    ev = {"action": "alloc", "id": 0, "size": 512, "stream": 0, "time": 0.0}
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"meta": {}, "events": [ev, dict(ev, action="free", time=1.0)]}))
    return str(p)


@pytest.fixture
def no_replay(monkeypatch):
    """Fails the test if a replay or the demo's planning starts."""
    import vmalloc.cli_demo
    import vmalloc.replay

    def work(*a, **k):
        raise AssertionError("the work started before the bad option was refused")
    monkeypatch.setattr(vmalloc.replay, "compare", work)
    monkeypatch.setattr(vmalloc.cli_demo, "_plan_and_replay", work)


@pytest.mark.parametrize("flag", ["--json", "--png"])
def test_replay_checks_output_paths_before_replaying(tmp_path, capsys, no_replay, flag):
    out = str(tmp_path / "nonexist" / "x.out")
    rc = main(["replay", "--no-bisect", _tiny_trace(tmp_path), flag, out])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"vmalloc replay: {flag}: ") and repr(out) in err[0]
    assert ".part" not in err[0] and "does not exist" in err[0]


def test_replay_json_into_a_directory_is_refused_up_front(tmp_path, capsys, no_replay):
    rc = main(["replay", "--no-bisect", _tiny_trace(tmp_path), "--json", str(tmp_path)])
    assert rc == 2 and "is a directory" in capsys.readouterr().err


def test_demo_checks_traces_before_planning(tmp_path, capsys, no_replay):
    missing = str(tmp_path / "nope")
    rc = main(["demo", "--no-bisect", "--traces", missing])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and missing in err[0]


def test_demo_parses_budget_up_front(capsys, no_replay):
    rc = main(["demo", "--no-bisect", "--budget", "abc"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("vmalloc demo: --budget: ")
    assert main(["demo", "--no-bisect", "--budget", "4G"]) == 2
    assert "'4GiB'" in capsys.readouterr().err


def test_report_of_a_binary_file_is_refused_at_once_and_names_report(tmp_path, capsys):
    rc = main(["report", "/dev/zero"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "/dev/zero" in err[0] and "replay" not in err[0]


def test_report_size_limit_names_the_report_option(tmp_path, capsys):
    big = tmp_path / "big.json"
    big.write_text("{" + " " * (3 << 20) + "}")
    rc = main(["report", "--max-trace-size", "2MiB", str(big)])
    err = capsys.readouterr().err
    assert rc == 2 and "vmalloc report --max-trace-size" in err and "replay" not in err


def test_report_into_a_closed_pipe_exits_quietly(tmp_path):
    trace = _tiny_trace(tmp_path)
    rep = str(tmp_path / "r.json")
    assert main(["replay", "--no-bisect", trace, "--json", rep]) == 0
    p = subprocess.Popen([sys.executable, "-m", "vmalloc", "report", rep], env=python_env(),
                         cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()   # the reader is gone before the report is printed (`| head -0`)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert err == "", err


# ------------------------------------------------------------------------------------ Allocator


def test_malloc_refuses_2_to_the_64_naming_nbytes():
    with Allocator("host", chunk_size=C) as a:
        with pytest.raises(ValueError, match=r"^nbytes: 18446744073709551616 is too large"):
            a.malloc(2**64)
        with pytest.raises(ValueError, match="nbytes: "):
            a.malloc(2**70)


def test_malloc_oom_reports_the_true_request_above_2_to_the_63():
    with Allocator("host", chunk_size=C) as a:
        with pytest.raises(OutOfMemoryError, match=r"\(9223372036854775808 bytes\)") as info:
            a.malloc(2**63)
        assert info.value.requested == 2**63


@pytest.mark.parametrize("call,words", [
    (lambda a: a.malloc(4096, stream=-1), (ValueError, "stream: expected an int >= 0")),
    (lambda a: a.malloc(4096, stream=2**64),
     (ValueError, "stream: 18446744073709551616 is too large")),
    (lambda a: a.malloc(4096, stream=None), (TypeError, "stream: expected an int")),
    (lambda a: a.malloc(4096, stream=1.5), (TypeError, "stream: expected an int")),
    (lambda a: a.free(-1), (ValueError, "ptr: expected an int >= 0")),
    (lambda a: a.free(None), (TypeError, "ptr: expected an int")),
    (lambda a: a.free(True), (TypeError, "ptr: expected an int")),
    (lambda a: a.record_stream(-1, 0), (ValueError, "ptr: expected an int >= 0")),
    (lambda a: a.record_stream(a.malloc(4096), -2), (ValueError, "stream: expected an int >= 0")),
    (lambda a: a.allocation_size(-1), (ValueError, "ptr: expected an int >= 0")),
])
def test_stream_and_pointer_are_checked_by_name(call, words):
    exc, text = words
    with Allocator("host", chunk_size=C) as a:
        with pytest.raises(exc, match="^" + text.replace("(", r"\(")):
            call(a)


def test_any_int_below_2_to_the_64_still_works_as_stream_and_pointer():
    with Allocator("host", chunk_size=C) as a:
        p = a.malloc(np.int64(4096), stream=np.uint64(2**64 - 1))
        a.record_stream(np.uint64(p), 2**63)
        assert a.allocation_size(p) >= 4096
        a.free(np.uint64(p))
        with pytest.raises(ValueError, match="not a live allocation"):
            a.free(2**64 - 1)


# ------------------------------------------------------------------------------------ report


@pytest.mark.parametrize("name,exc", [(5, TypeError), (None, TypeError), (b"x", TypeError),
                                      ("", ValueError), ("  ", ValueError)])
def test_report_section_name_must_be_a_non_empty_str(name, exc):
    with pytest.raises(exc, match="name: expected a non-empty str"):
        vmalloc.add_report_section(name, lambda: {"a": 1})


def test_text_and_json_reports_get_distinct_pngs(tmp_path, monkeypatch):
    from vmalloc import report_format as rpt
    drawn = []
    monkeypatch.setattr(rpt, "plot_timeline", lambda rep, path: drawn.append(path))
    rep = {"timeline": [[0.0, 1, 1, 1]]}
    monkeypatch.setattr(rpt, "to_text", lambda r: "report")
    for name in ("frag.txt", "frag.json"):
        rpt.save(rep, str(tmp_path / name))
    assert drawn == [str(tmp_path / "frag.txt.png"), str(tmp_path / "frag.json.png")]


# ------------------------------------------------------------------------------------ warnings


@pytest.mark.skipif(not site.ENABLE_USER_SITE, reason="user site-packages disabled")
def test_no_cuda_warning_points_at_the_users_import(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("the warning is for machines without a CUDA device")
    script = tmp_path / "train.py"
    script.write_text("import os\nimport torch\nprint('trained')\n")
    r = subprocess.run([sys.executable, str(script)], env=autoload_env(tmp_path, VMALLOC="1"),
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0 and "trained" in r.stdout, r.stderr
    assert f"{script}:2: RuntimeWarning: vmalloc: VMALLOC=1" in r.stderr, r.stderr
    assert "_autoload.py" not in r.stderr


@pytest.mark.parametrize("n,words", [(0, "no device"), (1, "device 0 only"), (3, "devices 0..2")])
def test_snapshot_device_error_counts_devices_in_english(n, words):
    from vmalloc.replay.snapshot import from_snapshot
    with pytest.raises(ValueError) as info:
        from_snapshot({"device_traces": [[] for _ in range(n)]}, device=5)
    assert str(info.value) == f"device: the snapshot has traces for {words}, got 5"


# ------------------------------------------------------------------------------------ enable


@pytest.mark.parametrize("kw,words", [
    ({"backend": "host"}, "backend: vmalloc.enable() takes only 'cuda', got 'host'"),
    ({"backend": "foo"}, "backend: vmalloc.enable() takes only 'cuda', got 'foo'"),
    ({"chunk_size": 0}, "chunk_size: 0 (0 bytes) is not a positive multiple of 2 MiB"),
    ({"device": True}, "device: expected a CUDA device index"),
])
def test_enable_refuses_bad_arguments_by_name_before_touching_torch(kw, words):
    with pytest.raises(ValueError) as info:
        vmalloc.enable(**kw)
    assert str(info.value).startswith(words)
