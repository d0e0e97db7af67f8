"""The CLI answers every bad input file with one line naming the file and the problem, exit 2
(issue 16 item 9), and reads at most ``--max-trace-size`` bytes of any file (gzip bombs,
/dev/zero)."""
import gzip
import json
import os
import pickle
import zlib

import pytest

from vmalloc.cli import main
from vmalloc.replay import DEFAULT_MAX_BYTES, TraceFileError, load

GOOD_EVENT = {"action": "alloc", "id": 0, "size": 512, "stream": 0, "time": 0.0}


def trace_with(**change):
    ev = dict(GOOD_EVENT, **change)
    return {"meta": {}, "events": [ev, dict(ev, action="free")]}


def write_json(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return str(p)


def gzip_bomb(path, nbytes, prefix=b'{"events": ['):
    """``nbytes`` of JSON-looking blanks, gzip'ed (a few hundred KiB on disk)."""
    comp = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: a gzip header
    with open(path, "wb") as f:
        f.write(comp.compress(prefix))
        block = b" " * (1 << 20)
        for _ in range(nbytes // len(block)):
            f.write(comp.compress(block))
        f.write(comp.flush())
    return str(path)


def bad_files(tmp_path):
    """name -> (path, words the one-line message must hold)."""
    cases = {}
    cases["directory"] = (str(tmp_path), "is a directory")
    full = gzip.compress(json.dumps(trace_with()).encode())
    trunc = tmp_path / "trunc.json.gz"
    trunc.write_bytes(full[: len(full) // 2])
    cases["truncated gzip"] = (str(trunc), "truncated gzip")
    junk_gz = tmp_path / "junk.json.gz"
    junk_gz.write_bytes(b"\x1f\x8b" + b"\x00" * 40)
    cases["bad gzip"] = (str(junk_gz), "gzip")
    cases["dev zero"] = ("/dev/zero", "neither a JSON trace")
    cases["missing"] = (str(tmp_path / "nope.json"), "No such file")
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    cases["empty"] = (str(empty), "is empty")
    cases["not json"] = (str(_write(tmp_path / "nj.json", b"{nope")), "not valid JSON")
    cases["deep json"] = (str(_write(tmp_path / "deep.json", b"[" * 100000)), "JSON")
    cases["events not a list"] = (write_json(tmp_path, "a.json", {"events": 3}),
                                  "events: expected a list")
    cases["event not an object"] = (write_json(tmp_path, "b.json", {"events": [3]}),
                                    "events[0]: expected an object")
    cases["meta a list"] = (write_json(tmp_path, "c.json", {"meta": [1], "events": []}),
                            "meta: expected an object")
    cases["size a string"] = (write_json(tmp_path, "d.json", trace_with(size="512")),
                              "events[0].size: expected an int")
    cases["id a float"] = (write_json(tmp_path, "e.json", trace_with(id=1.5)),
                           "events[0].id: expected an int")
    cases["time a string"] = (write_json(tmp_path, "f.json", trace_with(time="now")),
                              "events[0].time")
    cases["missing size"] = (write_json(tmp_path, "g.json", {"events": [{"action": "alloc",
                                                                        "id": 0}]}),
                             "events[0]: missing 'size'")
    cases["size 2**64"] = (write_json(tmp_path, "h.json", trace_with(size=2**64)),
                           "events[0].size: 18446744073709551616 is out of range")
    cases["stream -1"] = (write_json(tmp_path, "i.json", trace_with(stream=-1)),
                          "events[0].stream: -1 is out of range")
    snap = {"device_traces": [[{"action": "alloc", "addr": 4096, "stream": 0}]]}
    cases["snapshot entry without size"] = (write_json(tmp_path, "s.json", snap),
                                            "device_traces[0][0] (alloc): missing 'size'")
    pk = tmp_path / "s.pickle"
    pk.write_bytes(pickle.dumps(snap))
    cases["pickled snapshot without size"] = (str(pk), "missing 'size'")
    snap2 = {"device_traces": [[{"action": "alloc", "addr": 4096, "size": 2**64}]]}
    cases["snapshot size 2**64"] = (write_json(tmp_path, "s2.json", snap2), "out of range")
    cases["snapshot traces not lists"] = (write_json(tmp_path, "s3.json",
                                                     {"device_traces": [3]}), "device_traces")
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps(object()))
    cases["pickle with objects"] = (str(evil), "refusing to load")
    cases["small bomb"] = (gzip_bomb(tmp_path / "bomb.json.gz", 3 << 20), "--max-trace-size")
    return cases


def _write(path, data):
    path.write_bytes(data)
    return path


CASES = ["directory", "truncated gzip", "bad gzip", "dev zero", "missing", "empty", "not json",
         "deep json", "events not a list", "event not an object", "meta a list",
         "size a string", "id a float", "time a string", "missing size", "size 2**64",
         "stream -1", "snapshot entry without size", "pickled snapshot without size",
         "snapshot size 2**64", "snapshot traces not lists", "pickle with objects",
         "small bomb"]


@pytest.mark.parametrize("case", CASES)
def test_replay_answers_a_bad_file_with_one_line(tmp_path, capsys, case):
    path, words = bad_files(tmp_path)[case]
    rc = main(["replay", "--no-bisect", "--max-trace-size", "2MiB", path])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("vmalloc replay: ") and path in lines[0] and words in lines[0]


@pytest.mark.parametrize("case", ["directory", "dev zero", "small bomb", "not json"])
def test_report_answers_a_bad_file_with_one_line(tmp_path, capsys, case):
    path, _ = bad_files(tmp_path)[case]
    rc = main(["report", "--max-trace-size", "2MiB", path])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and path in lines[0]


def test_a_gzip_bomb_stops_at_the_default_limit_without_reading_it_all(tmp_path):
    path = gzip_bomb(tmp_path / "bomb.json.gz", DEFAULT_MAX_BYTES + (1 << 20))
    assert os.path.getsize(path) < 4 << 20
    with pytest.raises(TraceFileError, match=r"decompresses to more than 268435456 bytes"):
        load(path)


def test_the_limit_can_be_raised(tmp_path, capsys):
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(trace_with()) + " " * (3 << 20))  # 3 MiB of trailing blanks
    assert main(["replay", "--no-bisect", "--max-trace-size", "2MiB", str(ok)]) == 2
    capsys.readouterr()
    assert main(["replay", "--no-bisect", "--max-trace-size", "4MiB", str(ok)]) == 0


def test_demo_with_an_unknown_chain_names_it_and_lists_the_bundled_ones(capsys):
    rc = main(["demo", "--chain", "nosuch", "--no-bisect"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "chain 'nosuch': no such bundled chain; available:" in err[0]
    assert "resnet101-i1000-b2" in err[0]


@pytest.mark.parametrize("data,words", [
    ({"memory": {}}, "missing key 'fragmentation'"),
    ({"comparison": [{"trace": "x", "rows": [{"allocator": "a"}]}]}, "missing key"),
    ({"comparison": 5}, "not iterable"),
])
def test_report_of_an_incomplete_report_is_one_line_exit_2(tmp_path, capsys, data, words):
    path = write_json(tmp_path, "r.json", data)
    rc = main(["report", path])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("vmalloc report: ") and path in lines[0] and words in lines[0]


def test_demo_names_the_traces_directory_it_was_given(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["demo", "--replay-only", "--no-bisect", "--traces", missing]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and missing in err[0] and "bench/traces" not in err[0]


def test_ctrl_c_during_a_replay_is_one_line_exit_130_and_no_json(tmp_path, capsys, monkeypatch):
    import vmalloc.replay

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(vmalloc.replay, "compare", interrupted)
    path = write_json(tmp_path, "t.json", trace_with())
    out = tmp_path / "out.json"
    try:
        rc = main(["replay", path, "--json", str(out)])
    except KeyboardInterrupt:  # escaping would also stop the whole test session
        pytest.fail("KeyboardInterrupt escaped vmalloc.cli.main (a traceback for the user)")
    assert rc == 130
    assert capsys.readouterr().err.strip().splitlines() == ["vmalloc replay: interrupted"]
    assert not out.exists() and not (tmp_path / "out.json.part").exists()


def test_python_dash_m_vmalloc_runs_the_cli(tmp_path):
    import subprocess
    import sys
    from _subproc import python_env   # the vmalloc this process imports, from outside the checkout
    r = subprocess.run([sys.executable, "-m", "vmalloc", "--help"], capture_output=True,
                       text=True, env=python_env(), cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0 and "usage: vmalloc" in r.stdout


# ---------------------------------------------------------------- one-line argument errors


@pytest.mark.parametrize("argv,words", [
    (["demo", "--fraction", "abc"], "vmalloc demo: argument --fraction: invalid float value: 'abc'"),
    (["report", "r.json", "--max-trace-size", "10XB"],
     "vmalloc report: argument --max-trace-size: cannot read '10XB' as a byte size"),
    (["replay", "t.json", "--device", "abc"],
     "vmalloc replay: argument --device: invalid int value: 'abc'"),
    (["demo", "--no-such-option"], "vmalloc demo: unrecognized arguments: --no-such-option"),
    (["bogus"], "vmalloc: argument cmd: invalid choice: 'bogus'"),
])
def test_an_argument_error_is_one_line_exit_2(capsys, argv, words):
    """argparse printed its usage block (4-5 lines) before the error; every other error of the
    CLI is one line naming the command."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(words), lines


@pytest.mark.parametrize("argv,value", [
    (["demo", "--replay-only", "--budget", "-4GiB"], "-4GiB"),
    (["replay", "t.json", "--chunk-size", "-2MiB"], "-2MiB"),
    (["report", "r.json", "--max-trace-size", "-5"], "-5"),
])
def test_a_negative_size_is_named_not_taken_for_an_option(capsys, argv, value):
    """``--chunk-size -2MiB`` was "expected one argument": argparse takes only a plain negative
    number (-5) for a value. Now the size's own check names it."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert f"cannot read {value!r} as a byte size" in err and "expected one argument" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_negative_size_after_a_double_dash_is_left_alone():
    from vmalloc.cli import _join_negative_sizes
    assert _join_negative_sizes(["replay", "--chunk-size", "-2MiB", "--", "--budget", "-4GiB"]) \
        == ["replay", "--chunk-size=-2MiB", "--", "--budget", "-4GiB"]
    assert _join_negative_sizes(["demo", "--budget"]) == ["demo", "--budget"]
    assert _join_negative_sizes(["demo", "--budget", "--no-bisect"]) == \
        ["demo", "--budget", "--no-bisect"]


def test_report_of_an_empty_file_says_it_is_empty_once(tmp_path, capsys):
    """It said "vmalloc report: report: '...' is not a JSON report (Expecting value: ...)"."""
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    assert main(["report", str(empty)]) == 2
    assert capsys.readouterr().err.strip() == f"vmalloc report: {empty}: is empty"


def test_report_of_json_that_is_no_report_has_one_prefix(tmp_path, capsys):
    path = write_json(tmp_path, "list.json", [1, 2])
    assert main(["report", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"vmalloc report: {path}: JSON but not a vmalloc report (expected 'memory' "
                   "or 'comparison')")


def test_demo_traces_that_is_a_file_says_it_is_not_a_directory(tmp_path, capsys):
    f = write_json(tmp_path, "t.json", trace_with())
    assert main(["demo", "--replay-only", "--traces", f]) == 2
    assert capsys.readouterr().err.strip() == f"vmalloc demo: --traces {f}: is not a directory"


def test_demo_refuses_a_budget_below_one_chunk_up_front(capsys, monkeypatch):
    """``--budget 1`` passed, and the GPU demo's child then stopped naming VMALLOC_BUDGET."""
    import vmalloc.cli_demo
    monkeypatch.setattr(vmalloc.cli_demo, "_gpu_present", lambda: pytest.fail("probed the GPU"))
    assert main(["demo", "--budget", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vmalloc demo: --budget: 1 B (1 bytes) is "
                                                   "smaller than one chunk"), lines


def test_a_core_that_is_not_built_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """A checkout newer than its build (_core_locator's ImportError): its message, which says
    how to rebuild, was the last of a 23-line traceback."""
    import vmalloc.replay
    from vmalloc._core_locator import missing_message

    def stale(*args, **kwargs):
        raise ImportError(missing_message(os.path.dirname(vmalloc.replay.__file__), []),
                          name="vmalloc._core")
    monkeypatch.setattr(vmalloc.replay, "compare", stale)
    assert main(["replay", write_json(tmp_path, "t.json", trace_with())]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vmalloc replay: vmalloc._core is not built")
    assert "dev-build" in lines[0]


def test_another_import_error_keeps_its_traceback(tmp_path, monkeypatch):
    import vmalloc.replay

    def broken(*args, **kwargs):
        raise ImportError("no module named matplotlib.nope", name="matplotlib.nope")
    monkeypatch.setattr(vmalloc.replay, "compare", broken)
    with pytest.raises(ImportError, match="matplotlib.nope"):
        main(["replay", write_json(tmp_path, "t.json", trace_with())])


class _InterruptedTorchImport:
    """A stand-in for ``import torch`` as it meets Ctrl-C: the signal lands while torch's C code
    imports numpy, which swallows the KeyboardInterrupt raised there (as torch._C does)."""

    def find_spec(self, name, path=None, target=None):
        import importlib.util
        return importlib.util.spec_from_loader(name, self) if name == "torch" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        import signal
        import types
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:   # what the C import of numpy does with it
            pass
        module.cuda = types.SimpleNamespace(is_available=lambda: False)


def test_ctrl_c_while_the_demo_imports_torch_is_honoured(tmp_path, capsys, monkeypatch):
    """5 of 60 Ctrl-C early in ``vmalloc demo`` were lost in ``import torch`` (the GPU probe)
    and the demo ran to the end; the README promises one line and exit 130."""
    import signal
    import sys
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.delitem(sys.modules, "torch", raising=False)   # (put back after the test)
    monkeypatch.setattr(sys, "meta_path", [_InterruptedTorchImport()] + sys.meta_path)
    empty = tmp_path / "no-traces"
    empty.mkdir()
    try:   # (the demo would stop at the empty --traces directory if it went on)
        rc = main(["demo", "--no-bisect", "--traces", str(empty)])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped vmalloc.cli.main")
    assert rc == 130
    assert capsys.readouterr().err.strip().splitlines() == ["vmalloc demo: interrupted"]
    assert signal.getsignal(signal.SIGINT) is before   # the handler is put back


def test_the_gpu_probe_puts_back_the_sigint_handler_it_found(monkeypatch):
    import signal
    from vmalloc.cli_demo import _sigint_held
    mine = lambda signum, frame: None  # noqa: E731
    old = signal.signal(signal.SIGINT, mine)
    try:
        with _sigint_held():
            assert signal.getsignal(signal.SIGINT) is not mine
        assert signal.getsignal(signal.SIGINT) is mine
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # ignored stays ignored
        with _sigint_held():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)
