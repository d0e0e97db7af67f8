"""A fresh user's review of vmalloc (issue 17): the source tree imported from the repository root
after ``pip install .``, environment variables that do nothing, unreadable ranks, bool knobs,
raw binding errors, the exit report's PNG, failing report sections, and the CLI's options and
bundled files. Each answer is a clear error (or one stderr line) naming the input and its value;
nothing is silently ignored."""
import argparse
import importlib
import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys

import pytest

from _subproc import HOST_REGISTRY, ROOT, autoload_env, python_env
from vmalloc.cli import main

MiB = 1 << 20


def _core_file() -> str:
    spec = importlib.util.find_spec("vmalloc._core")
    if spec is None or not spec.origin:
        pytest.skip("vmalloc._core is not built")
    return spec.origin


# ---------------------------------------------------------------------------- 1: the source tree


SOURCES = ("__init__.py", "_core_locator.py")   # all a bare `import vmalloc._core` runs


def _layout(tmp_path, installed: bool, in_place: bool, other_sources: bool = False):
    """``src``: a checkout (pyproject.toml, vmalloc's import files), ``site``: an installed
    vmalloc with a built _core (when ``installed``; of other sources with ``other_sources``);
    ``in_place``: the checkout has its own build."""
    core = _core_file()
    src, site_dir = tmp_path / "src", tmp_path / "site"
    (src / "vmalloc").mkdir(parents=True)
    (src / "pyproject.toml").write_text("[project]\nname = 'vmalloc'\n")
    for name in SOURCES:
        shutil.copy(os.path.join(ROOT, "vmalloc", name), src / "vmalloc" / name)
    if in_place:
        shutil.copy(core, src / "vmalloc" / os.path.basename(core))
    if installed:
        (site_dir / "vmalloc").mkdir(parents=True)
        for name in SOURCES:
            shutil.copy(os.path.join(ROOT, "vmalloc", name), site_dir / "vmalloc" / name)
        shutil.copy(core, site_dir / "vmalloc" / os.path.basename(core))
        if other_sources:
            with open(site_dir / "vmalloc" / "__init__.py", "a") as f:
                f.write("# an older release\n")
    return src, site_dir


def _run_in(src, site_dir, code: str) -> subprocess.CompletedProcess:
    """``python -S -c code`` started in ``src`` (the current directory first on sys.path, as
    from a repository root), with only ``site_dir`` added: no site-packages, so no vmalloc the
    machine has installed interferes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VMALLOC"))}
    env["PYTHONPATH"] = str(site_dir)
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=str(src), env=env,
                          capture_output=True, text=True, timeout=120)


WHERE = "import vmalloc\nfrom vmalloc import _core\nprint(vmalloc.__file__)\nprint(_core.__file__)\n"


def test_a_source_tree_without_a_build_uses_the_installed_core(tmp_path):
    src, site_dir = _layout(tmp_path, installed=True, in_place=False)
    r = _run_in(src, site_dir, WHERE + "import vmalloc._core as again\nassert again is _core\n")
    assert r.returncode == 0, r.stderr
    package, core = r.stdout.split()
    assert package == str(src / "vmalloc" / "__init__.py")     # the checkout is what was imported
    assert os.path.dirname(core) == str(site_dir / "vmalloc")   # its _core: the installed one


def test_an_installed_core_of_other_sources_is_not_used(tmp_path):
    src, site_dir = _layout(tmp_path, installed=True, in_place=False, other_sources=True)
    r = _run_in(src, site_dir, "import vmalloc\nvmalloc._import_core()")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: vmalloc._core is not built"), r.stderr
    assert f"the installed vmalloc at {site_dir / 'vmalloc'} was built from other sources" \
        in last, last


def test_an_in_place_build_still_wins(tmp_path):
    src, site_dir = _layout(tmp_path, installed=True, in_place=True)
    r = _run_in(src, site_dir, WHERE)
    assert r.returncode == 0, r.stderr
    assert os.path.dirname(r.stdout.split()[1]) == str(src / "vmalloc")


def test_no_core_anywhere_names_the_directory_why_and_both_remedies(tmp_path):
    src, site_dir = _layout(tmp_path, installed=False, in_place=False)
    r = _run_in(src, site_dir, "import vmalloc\nvmalloc._import_core()")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: vmalloc._core is not built"), r.stderr
    assert f"the source tree at {src} is imported instead of an installed vmalloc because the " \
           "current directory comes first on sys.path" in last
    assert "scripts/dev-build" in last and f"pip install {src}" in last


def test_the_planners_native_module_comes_through_the_same_check(monkeypatch):
    import vmalloc
    from scheduler import _native

    def missing():
        raise ImportError("vmalloc._core is not built: (the message)")
    monkeypatch.setattr(vmalloc, "_import_core", missing)
    with pytest.raises(ImportError, match="the message"):
        _native.core()


def test_without_a_core_hasattr_stays_false(tmp_path):
    src, site_dir = _layout(tmp_path, installed=False, in_place=False)
    r = _run_in(src, site_dir, "import vmalloc\nprint(hasattr(vmalloc, '_core'))")
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


# ---------------------------------------------------------------------------- 2: unused variables


@pytest.mark.skipif(not site.ENABLE_USER_SITE, reason="user site-packages disabled")
@pytest.mark.parametrize("variables,named,not_named", [
    ({"VMALLOC_REPORT": "-", "VMALLOC_BUDGET": "16GiB"}, ["VMALLOC_BUDGET=16GiB"],
     ["VMALLOC_CHUNK_SIZE"]),
    ({"VMALLOC": "0", "VMALLOC_REPORT": "-", "VMALLOC_CHUNK_SIZE": "4MiB",
      "VMALLOC_BUDGET": "1GiB"}, ["VMALLOC_CHUNK_SIZE=4MiB", "VMALLOC_BUDGET=1GiB", "VMALLOC=0"],
     []),
    # the swap runtime uses the budget: only the chunk size is idle
    ({"VMALLOC_WINDOW": "1GiB", "VMALLOC_BUDGET": "1GiB", "VMALLOC_CHUNK_SIZE": "4MiB"},
     ["VMALLOC_CHUNK_SIZE=4MiB"], ["VMALLOC_BUDGET"]),
])
def test_variables_that_need_vmalloc_1_are_said_to_be_ignored(tmp_path, variables, named,
                                                                not_named):
    env = autoload_env(tmp_path, **variables)
    r = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True,
                       text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == "ran", r.stderr
    lines = [l for l in r.stderr.splitlines() if "ignored" in l]
    assert len(lines) == 1, r.stderr
    assert all(n in lines[0] for n in named) and "VMALLOC=1" in lines[0], lines
    assert not any(n in lines[0] for n in not_named), lines


@pytest.mark.skipif(not site.ENABLE_USER_SITE, reason="user site-packages disabled")
def test_nothing_is_said_with_vmalloc_1(tmp_path):
    env = autoload_env(tmp_path, VMALLOC="1", VMALLOC_BUDGET="16GiB", VMALLOC_CHUNK_SIZE="4MiB")
    r = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True,
                       text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0 and "ignored" not in r.stderr, r.stderr


# ---------------------------------------------------------------------------- 3: RANK


@pytest.fixture
def P(monkeypatch):
    import vmalloc.report_process as P
    monkeypatch.setattr(P, "_warned", set())   # each test sees its own warnings
    return P


@pytest.mark.parametrize("env,name,value", [
    ({"RANK": "abc"}, "RANK", "abc"), ({"RANK": "-3"}, "RANK", "-3"),
    ({"LOCAL_RANK": "1.5"}, "LOCAL_RANK", "1.5"),
])
def test_an_unreadable_rank_is_said_and_the_report_named_by_pid(P, capsys, env, name, value):
    assert P.process_rank(env) is None
    assert P.report_path("f.json", env, pid=7) == "f.pid7.json"
    assert P.report_path("f.{rank}.json", env, pid=7) == "f.pid7.json"
    err = capsys.readouterr().err
    assert f"{name}={value!r} is not an integer >= 0" in err
    assert err.count(name + "=") == 1   # once, however often it is read


def test_a_bad_world_size_is_said_and_left_out(P, capsys):
    assert P.process_identity(None, {"RANK": "1", "WORLD_SIZE": "0"})["world_size"] is None
    assert "WORLD_SIZE='0' is not an integer >= 1" in capsys.readouterr().err


def test_an_unreadable_rank_loses_no_exit_report(P, tmp_path, monkeypatch, capsys):
    from vmalloc.pluggable import live_report as L
    from vmalloc.report_format import load
    monkeypatch.setenv("RANK", "abc")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    L.write_exit_report(str(tmp_path / "frag.json"))
    rep = load(str(tmp_path / f"frag.pid{os.getpid()}.json"))
    assert rep["process"]["rank"] is None
    assert "RANK='abc'" in capsys.readouterr().err


def test_good_ranks_are_unchanged(P, capsys):
    assert P.report_path("f.json", {"RANK": "3"}, pid=7) == "f.rank3.json"
    assert P.report_path("f.json", {"RANK": " +2 "}, pid=7) == "f.rank2.json"
    assert P.report_path("f.json", {"RANK": "", "LOCAL_RANK": "1"}, pid=7) == "f.rank1.json"
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------- 4, 5: Allocator


@pytest.fixture
def Allocator():
    pytest.importorskip("vmalloc._core")
    from vmalloc import Allocator
    return Allocator


@pytest.mark.parametrize("knob", ["prefer_remap", "split_cached", "merge_cached"])
@pytest.mark.parametrize("value", ["no", "False", None, 2, -1, 0.0, [], b"0"])
def test_bool_knobs_take_only_bools(Allocator, knob, value):
    with pytest.raises(TypeError, match=re.escape(f"{knob}: expected True or False, got {value!r}")):
        Allocator(chunk_size=64 << 10, **{knob: value})


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (1, True), (0, False)])
def test_bool_knobs_accept_bools_and_0_1(Allocator, value, expected):
    with Allocator(chunk_size=64 << 10, prefer_remap=value, split_cached=value,
                   merge_cached=value) as a:
        assert a.free(a.malloc(4096)) is None
        assert a.merge_cached is expected


@pytest.mark.parametrize("value", [10**30, 2**64, -1, 1.5, "10"])
def test_trace_capacity_out_of_range_is_named(Allocator, value):
    with pytest.raises(ValueError, match=r"trace_capacity: expected an event count >= 0, got "):
        Allocator(chunk_size=64 << 10, trace_capacity=value)


@pytest.mark.parametrize("value", [-1, 10**30, "x", 2.0, True])
def test_set_trace_capacity_is_checked(Allocator, value):
    with Allocator(chunk_size=64 << 10) as a:
        with pytest.raises(ValueError, match=r"events: expected an event count >= 0, got "):
            a.set_trace_capacity(value)
        a.set_trace_capacity(2**64 - 1)   # the largest a size_t holds
        assert a.trace_capacity == 2**64 - 1


@pytest.mark.parametrize("value", ["x", -1, None, 1.0, True])
def test_add_peer_refuses_what_is_no_device(Allocator, value):
    with Allocator(chunk_size=64 << 10) as a:
        with pytest.raises(ValueError, match=re.escape(f"device: expected a device index >= 0, "
                                                       f"got {value!r}")):
            a.add_peer(value)
        with pytest.raises(ValueError, match=r"device: 4294967296 is too large"):
            a.add_peer(2**32)
        assert a.add_peer(1) is False   # the host backend has no peers: False, as documented


def test_a_device_too_large_for_the_binding_is_named(Allocator):
    with pytest.raises(ValueError, match=r"device: 2147483648 is too large for a device index"):
        Allocator(chunk_size=64 << 10, device=2**31)


# ---------------------------------------------------------------------------- 6: the exit PNG


def test_the_exit_report_draws_the_recorded_history(tmp_path):
    pytest.importorskip("vmalloc._core")
    pytest.importorskip("matplotlib")
    out = tmp_path / "frag.json"
    r = subprocess.run([sys.executable, "-c", HOST_REGISTRY + f"""
a = core._torch_allocator(0, True)
ta.start_recording()
ps = [a.malloc(1 << 20, 0) for _ in range(3)]
for p in ps:
    a.free(p)
from vmalloc.pluggable.live_report import write_exit_report
write_exit_report({str(out)!r})
"""], capture_output=True, text=True, timeout=120, env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["timeline"]["requested"] == [MiB, 2 * MiB, 3 * MiB, 2 * MiB, MiB, 0]
    assert (tmp_path / "frag.json.png").stat().st_size > 0
    assert "no memory timeline" not in r.stderr, r.stderr


def test_a_timeline_starts_where_dropped_events_left_it():
    from vmalloc.pluggable.live_report import _requested_timeline
    events = [{"action": "free", "size": 5}, {"action": "alloc", "size": 2}]
    assert _requested_timeline(events, requested_now=7) == {"event": [0, 1], "requested": [5, 7]}
    many = [{"action": "alloc", "size": 1}] * 10 + [{"action": "free", "size": 1}] * 10
    tl = _requested_timeline(many, 0, max_points=4)
    assert len(tl["event"]) <= 4 and max(tl["requested"]) == 10   # the peak survives


def test_a_report_without_a_timeline_says_why_there_is_no_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from vmalloc import report_format as rpt
    rep = rpt.build({"requested_peak": MiB, "physical_peak": 2 * MiB}, source="test")
    rpt.save(rep, str(tmp_path / "frag.json"))
    err = capsys.readouterr().err
    assert f"no {tmp_path / 'frag.json'}.png: the report has no memory timeline" in err
    assert "VMALLOC=1" in err and not (tmp_path / "frag.json.png").exists()


# ---------------------------------------------------------------------------- 7: failing sections


def test_a_failing_section_is_said_on_stderr(capsys):
    import vmalloc
    from vmalloc.pluggable import live_report as L

    def broken():
        raise KeyError("gone")
    vmalloc.add_report_section("broken17", broken)
    try:
        rep = L.collect()
    finally:
        L.remove_section("broken17")
    assert rep["broken17"] == {"error": "KeyError: 'gone'"}
    err = capsys.readouterr().err
    assert "vmalloc: report section 'broken17' failed (KeyError: 'gone'); written as an error" \
        in err


# ---------------------------------------------------------------------------- 8: the CLI


@pytest.mark.parametrize("fraction", ["0", "-1", "nan", "1e99", "inf"])
def test_demo_fraction_is_checked_before_any_work(capsys, fraction):
    assert main(["demo", "--no-bisect", "--fraction", fraction]) == 2
    out, err = capsys.readouterr()
    assert "[1/3]" not in out and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vmalloc demo: --fraction: expected a number "
                                                   "in (0, 1]"), lines


@pytest.mark.parametrize("value,words", [
    ("0", "expected a positive byte size such as 256MiB"),
    ("2G", "'2G' is ambiguous"),
    ("lots", "cannot read 'lots' as a byte size"),
])
def test_max_trace_size_says_what_is_valid(capsys, value, words):
    with pytest.raises(SystemExit) as info:
        main(["report", "--max-trace-size", value, "x.json"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --max-trace-size: {words}" in err and "invalid max_size value" not in err


def _tiny_trace(tmp_path):
    from vmalloc.replay.trace import Event, Trace
    p = tmp_path / "tiny.json"
    Trace([Event("alloc", 0, 3 * MiB), Event("free", 0, 3 * MiB)], {"name": "tiny"}).save(p)
    return str(p)


def test_replay_refuses_a_chunk_that_cannot_be_mapped(tmp_path, capsys):
    pytest.importorskip("vmalloc._core")
    from vmalloc import Allocator, OutOfMemoryError
    huge = "100TiB"   # below the allocator's address-space limit (128 TiB), past what maps here
    try:
        with Allocator("host-lazy", huge) as a:
            a.malloc(100 << 40)
        pytest.skip("this machine maps a 100 TiB chunk")
    except OutOfMemoryError:
        pass
    assert main(["replay", "--no-bisect", _tiny_trace(tmp_path), "--chunk-size", huge]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"vmalloc replay: --chunk-size {huge}: one chunk of 100.00 TiB cannot " \
        "be mapped on this machine (cannot reserve" in err and "smaller chunk size" in err


@pytest.mark.parametrize("value,words", [("0", "must be positive"),
                                         ("1000", "multiple of the host-lazy backend's"),
                                         ("4194304TiB", "larger than any address space")])
def test_replay_names_a_bad_chunk_size_before_replaying(tmp_path, capsys, value, words):
    pytest.importorskip("vmalloc._core")
    assert main(["replay", "--no-bisect", _tiny_trace(tmp_path), "--chunk-size", value]) == 2
    err = capsys.readouterr().err
    assert f"--chunk-size {value}: " in err and words in err


def test_replay_labels_chunk_sizes_in_binary_units(tmp_path, capsys):
    from vmalloc.replay.run import default_contenders
    names = [c.name for c in default_contenders([2 * MiB, 20 * MiB, 3 * MiB // 2, 100 << 40,
                                                 2 * MiB + 4096])]
    assert names[:-1] == ["vmalloc 2 MiB", "vmalloc 20 MiB", "vmalloc 1.5 MiB",
                          "vmalloc 100 TiB", "vmalloc 2.00390625 MiB"]


def test_replay_explains_a_chunk_larger_than_the_trace_needs(tmp_path, capsys):
    pytest.importorskip("vmalloc._core")
    assert main(["replay", "--no-bisect", _tiny_trace(tmp_path), "--chunk-size", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "note: vmalloc 64 MiB: one chunk (64.00 MiB) is more than the trace ever requests " \
           "at once (3.00 MiB)" in out


def test_report_of_a_directory_says_so(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"vmalloc report: {tmp_path}: is a directory, not a report file"


@pytest.mark.parametrize("traces,words", [
    ('"x"', "'device_traces' has the wrong type: expected a list (one list of entries per "
            "device), got str"),
    ("null", "'device_traces' has the wrong type"),
    ("[3]", "device_traces[0] has the wrong type: expected a list of entries, got int"),
])
def test_snapshot_device_traces_of_the_wrong_type_are_named(tmp_path, capsys, traces, words):
    p = tmp_path / "snap.json"
    p.write_text('{"device_traces": %s}' % traces)
    assert main(["replay", "--no-bisect", str(p)]) == 2
    err = capsys.readouterr().err
    assert words in err and "no 'device_traces'" not in err


def test_version(capsys):
    import vmalloc
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        want = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    assert vmalloc.__version__ == want   # the one the CLI prints: kept equal to pyproject's
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"vmalloc {want} ({os.path.dirname(os.path.abspath(vmalloc.__file__))})"


# ---------------------------------------------------------------------------- 9: demo's files


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """vmalloc and scheduler as if installed in ``tmp_path/site`` (no bench/ beside them), run
    from ``tmp_path/work``."""
    import scheduler.demo

    import vmalloc.cli_demo
    site_dir = tmp_path / "site"
    monkeypatch.setattr(vmalloc.cli_demo, "__file__", str(site_dir / "vmalloc" / "cli_demo.py"))
    monkeypatch.setattr(scheduler.demo, "__file__", str(site_dir / "scheduler" / "demo.py"))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path


def test_demo_outside_the_checkout_says_what_is_missing_before_any_work(elsewhere, capsys):
    assert main(["demo", "--no-bisect"]) == 2
    out, err = capsys.readouterr()
    assert "[1/3]" not in out and "random-40" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "no bench/traces/*.json(.gz)" in lines[0] and "no bench/chains/*.json" in lines[0]
    assert str(elsewhere / "work") in lines[0] and str(elsewhere / "site") in lines[0]
    assert "repository root" in lines[0]


def test_demo_replay_only_needs_only_the_traces(elsewhere, capsys):
    assert main(["demo", "--replay-only", "--no-bisect"]) == 2
    err = capsys.readouterr().err
    assert "no bench/traces" in err and "bench/chains" not in err


def test_demo_with_traces_given_still_needs_the_chains(elsewhere, tmp_path, capsys):
    trace = _tiny_trace(tmp_path)
    assert main(["demo", "--no-bisect", "--traces", os.path.dirname(trace)]) == 2
    out, err = capsys.readouterr()
    assert "[1/3]" not in out and "no bench/chains/*.json" in err and "bench/traces" not in err


@pytest.mark.skipif(not os.path.isfile(os.path.join(ROOT, "vmalloc", "cli_demo.py"))
                    or os.path.dirname(os.path.dirname(os.path.abspath(
                        importlib.util.find_spec("vmalloc").origin))) != ROOT,
                    reason="vmalloc runs from an installed copy, with no bench/ beside it")
def test_demo_finds_the_checkout_from_the_package_when_run_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the source tree's package still finds bench/ beside it
    from vmalloc.cli_demo import _demo_inputs, bundled_traces
    assert bundled_traces() and all(t.startswith(ROOT) for t in bundled_traces())
    chain, traces = _demo_inputs(argparse.Namespace(traces=None, replay_only=False,
                                                    chain="gpt2-s256-b1"))
    assert chain.name == "gpt2-s256-b1" and traces


def test_a_png_that_cannot_be_written_keeps_the_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from vmalloc.report_format import save
    path = tmp_path / "frag.json"
    os.mkdir(str(path) + ".png")   # savefig cannot write a file where a directory is
    save({"title": "t", "timeline": {"event": [0, 1], "requested": [0, 4096]}}, str(path))
    assert path.exists()
    assert f"wrote {path} but not {path}.png" in capsys.readouterr().err


def test_a_timeline_that_cannot_be_built_keeps_the_report(tmp_path):
    pytest.importorskip("vmalloc._core")
    out = tmp_path / "frag.json"
    r = subprocess.run([sys.executable, "-c", HOST_REGISTRY + f"""
a = core._torch_allocator(0, True)
ta.start_recording()
a.free(a.malloc(1 << 20, 0))
from vmalloc.pluggable import live_report as L
def broken(*args, **kwargs):
    raise KeyError("size")
L._requested_timeline = broken
L.write_exit_report({str(out)!r})
"""], capture_output=True, text=True, timeout=120, env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "the report has no timeline: KeyError" in r.stderr, r.stderr
    rep = json.loads(out.read_text())
    assert rep["memory"] and not rep.get("timeline")
