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
