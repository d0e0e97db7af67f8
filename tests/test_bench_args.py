"""The bench scripts' flags: a bad value (a typo'd folder, a count of 0, a size that is not one,
a device this machine lacks, an unknown name) ends the run with exit status 2 and a one-line
message naming the flag and the value, before anything is measured or written; every script
takes ``--out`` so a smoke run can leave the committed results alone; ``--help`` describes
every flag and the module docstring says how to run the script. No GPU needed."""
import ast
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from _bench_fakes import fake_swap_cpu_part
from _subproc import ROOT, python_env

BENCH = os.path.join(ROOT, "bench")
# readme_results.py's parts (its formats, its section renderers): modules, not scripts
README_PARTS = ("readme_format.py", "readme_allocator.py", "readme_planners.py",
                "readme_runtime.py", "readme_gpu_sessions.py")
# every script with a command line (offload_fluid.py, common.py and checkout.py are modules only)
SCRIPTS = sorted(
    [p for p in glob.glob(os.path.join(BENCH, "*.py"))
     if os.path.basename(p) not in ("common.py", "offload_fluid.py", "checkout.py")
     and os.path.basename(p) not in README_PARTS
     and not os.path.basename(p).startswith("e2e_")]   # e2e.py's parts: modules, not scripts
    + [os.path.join(BENCH, "chains", "make_chains.py"),
       os.path.join(BENCH, "traces", "make_traces.py"),
       os.path.join(BENCH, "traces", "record_gpu.py")])


def run(script, *args, cwd, timeout=120):
    """``python bench/<script> args`` from ``cwd`` (outside the checkout)."""
    return subprocess.run([sys.executable, os.path.join(BENCH, script), *map(str, args)],
                          env=python_env(), cwd=str(cwd), capture_output=True, text=True,
                          timeout=timeout)


def assert_usage_error(r, *words):
    """Exit 2, one error line naming ``words`` (the flag, the value), no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in errors[0], (w, errors[0])


def files_under(path):
    return sorted(os.path.relpath(os.path.join(d, f), path)
                  for d, _, fs in os.walk(path) for f in fs)


# ----------------------------------------------------------------------- fragmentation.py
def tiny_trace():
    """A contract-2 trace of a few allocations (replays in well under a second)."""
    sizes = [3 << 20, 5 << 20, 2 << 20, 7 << 20]
    events, t = [], 0.0
    for i, s in enumerate(sizes):
        events.append({"action": "alloc", "id": i, "size": s, "stream": 0, "time": t})
        t += 1e-3
    for i in (1, 0, 3, 2):
        events.append({"action": "free", "id": i, "size": sizes[i], "stream": 0, "time": t})
        t += 1e-3
    return {"meta": {"source": "tests/test_bench_args.py"}, "events": events}


@pytest.mark.parametrize("where", ["missing", "empty", "only_other_files"])
def test_fragmentation_without_traces_exits_2_and_writes_nothing(tmp_path, where):
    traces = tmp_path / "traces"
    if where != "missing":
        traces.mkdir()
    if where == "only_other_files":
        (traces / "notes.txt").write_text("not a trace")
    out = tmp_path / "out" / "fragmentation.json"
    r = run("fragmentation.py", "--traces", traces, "--out", out, cwd=tmp_path)
    assert_usage_error(r, "--traces", str(traces))
    assert not (tmp_path / "out").exists()


def test_fragmentation_reads_plain_json_traces(tmp_path):
    """A folder of ``*.json`` traces (not gzip'ed) is what vmalloc.replay.load reads too."""
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "tiny.json").write_text(json.dumps(tiny_trace()))
    out = tmp_path / "out" / "fragmentation.json"
    r = run("fragmentation.py", "--traces", traces, "--out", out, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert [t["trace"] for t in d["traces"]] == ["tiny"]
    assert d["traces"][0]["rows"]


def test_fragmentation_bad_trace_file_exits_2_before_writing(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "a.json").write_text(json.dumps(tiny_trace()))
    (traces / "b.json").write_text("{}")
    out = tmp_path / "out" / "fragmentation.json"
    r = run("fragmentation.py", "--traces", traces, "--out", out, cwd=tmp_path)
    assert_usage_error(r, "--traces", "b.json")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------- swap.py
@pytest.mark.parametrize("flags, words", [
    (["--budget", "abc"], ["--budget", "'abc'"]),
    (["--budget", "-1"], ["--budget", "'-1'"]),
    (["--budget", "0"], ["--budget", "'0'"]),
    (["--window", "2 lots"], ["--window", "'2 lots'"]),
    (["--stop-at", "5"], ["--stop-at", "--gpu-only"]),
    (["--worker-timeout", "0"], ["--worker-timeout", "'0'"]),
    (["--gpu-only"], ["--cpu-only"]),   # with --cpu-only below
])
def test_swap_bad_flags_exit_2_even_with_cpu_only(tmp_path, flags, words):
    r = run("swap.py", "--quick", "--cpu-only", "--out", tmp_path / "out", *flags, cwd=tmp_path)
    assert_usage_error(r, *words)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def bench_swap():
    if ROOT not in sys.path:   # appended (as test_bench_swap_gpu_only): the installed vmalloc first
        sys.path.append(ROOT)
    from bench import swap
    return swap


def test_swap_sizes_parsed_and_out_is_a_folder(bench_swap):
    a = bench_swap.parse_args(["--window", "2GB", "--budget", "8GiB", "--out", "/tmp/x"])
    assert (a.window, a.budget, a.out) == (2 * 10**9, 8 << 30, "/tmp/x")
    a = bench_swap.parse_args([])
    assert (a.budget, a.window, a.out) == (16 << 30, 2 << 30, None)   # defaults unchanged


def test_swap_cpu_part_writes_into_out_not_the_committed_file(bench_swap, tmp_path, monkeypatch):
    """The CPU part's results go to --out; bench/results/swap.json is not touched."""
    committed = os.path.join(BENCH, "results", "swap.json")
    before = os.path.getmtime(committed) if os.path.exists(committed) else None
    row = fake_swap_cpu_part(monkeypatch, bench_swap)
    n = bench_swap.torch.get_num_threads()
    try:
        bench_swap.main(["--quick", "--cpu-only", "--out", str(tmp_path / "out")])
    finally:
        bench_swap.torch.set_num_threads(n)
    d = json.loads((tmp_path / "out" / "swap.json").read_text())
    assert d["cpu_overhead"] == [row] and d["gpu"] == {"skipped": "--cpu-only"}
    assert "--out" in d["meta"]["command"]
    after = os.path.getmtime(committed) if os.path.exists(committed) else None
    assert before == after


# ----------------------------------------------------------------------- hf.py, mimose.py
@pytest.mark.parametrize("flags, words", [
    (["--steps", "0"], ["--steps", "'0'"]),
    (["--steps", "-3"], ["--steps", "'-3'"]),
    (["--threads", "0"], ["--threads", "'0'"]),
    (["--device", "nope"], ["--device", "'nope'"]),
    (["--device", "meta"], ["--device", "'meta'"]),
    (["--models", "gpt2,nope"], ["--models", "'nope'"]),
])
def test_hf_bad_flags_exit_2(tmp_path, flags, words):
    r = run("hf.py", "--quick", "--out", tmp_path / "out", *flags, cwd=tmp_path)
    assert_usage_error(r, *words)
    assert not (tmp_path / "out").exists()


def test_cuda_device_without_a_gpu_exits_2(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for script, out in (("hf.py", tmp_path / "hf"), ("mimose.py", tmp_path / "m.json")):
        r = run(script, "--quick", "--device", "cuda", "--out", out, cwd=tmp_path)
        assert_usage_error(r, "--device", "'cuda'", "CUDA")
        assert not out.exists()


@pytest.mark.parametrize("flags, words", [
    (["--device", "nope"], ["--device", "'nope'"]),
    (["--threads", "0"], ["--threads", "'0'"]),
])
def test_mimose_bad_flags_exit_2(tmp_path, flags, words):
    out = tmp_path / "mimose.json"
    r = run("mimose.py", "--quick", "--out", out, *flags, cwd=tmp_path)
    assert_usage_error(r, *words)
    assert not out.exists()


# ------------------------------------------------------------------------- the other scripts
@pytest.mark.parametrize("script, flags, words", [
    ("checkpoint_real.py", ["--steps", "0"], ["--steps", "'0'"]),
    ("checkpoint_real.py", ["--bandwidth", "0"], ["--bandwidth", "'0'"]),
    ("checkpoint_real.py", ["--threads", "0"], ["--threads", "'0'"]),
    ("checkpoint_real.py", ["--models", "nope"], ["--models", "'nope'"]),
    ("checkpointing.py", ["--slots", "0"], ["--slots", "'0'"]),
    ("cache_slack.py", ["--traces-dir", "/nonexistent/traces"], ["--traces-dir", "/nonexistent/traces"]),
    ("cache_slack.py", ["--alloc-micro", "/nonexistent/a.json"], ["--alloc-micro", "/nonexistent/a.json"]),
    ("cache_slack.py", ["--max-seconds", "0"], ["--max-seconds", "'0'"]),
    ("e2e.py", ["--smoke", "--budget", "abc"], ["--budget", "'abc'"]),
    ("e2e.py", ["--smoke", "--coexist", "-1"], ["--coexist", "'-1'"]),
    ("e2e.py", ["--smoke", "--methods", "nope"], ["--methods", "'nope'"]),
    ("e2e.py", ["--smoke", "--models", "resnet77"], ["--models", "'resnet77'"]),
    ("chains/make_chains.py", ["--only", "nope"], ["--only", "'nope'", "resnet101"]),
])
def test_bad_flags_exit_2_before_writing(tmp_path, script, flags, words):
    out = tmp_path / "out"
    r = run(script, "--out", out, *flags, cwd=tmp_path)
    assert_usage_error(r, *words)
    assert not out.exists()


def test_readme_results_refuses_a_results_folder_without_results(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    for results in (tmp_path / "missing", tmp_path):   # no such folder; no *.json in it
        r = run("readme_results.py", "--results", results, "--readme", readme, cwd=tmp_path)
        assert_usage_error(r, "--results", str(results))
    assert readme.read_text() == "# x\n"


def test_make_traces_help_does_not_rewrite_the_bundled_traces(tmp_path):
    traces = os.path.join(BENCH, "traces")
    before = {p: os.path.getmtime(p) for p in glob.glob(os.path.join(traces, "*.json.gz"))}
    assert run("traces/make_traces.py", "--help", cwd=tmp_path).returncode == 0
    assert_usage_error(run("traces/make_traces.py", "--quick", cwd=tmp_path), "--quick")
    assert {p: os.path.getmtime(p) for p in before} == before


# --------------------------------------------------------------------------- --help, docs
def help_entries(text):
    """``{flag: help text}`` of an argparse ``--help`` page's options."""
    lines = text.split("options:", 1)[1].splitlines()
    entries, flag = {}, None
    for line in lines:
        if line.startswith("  -"):
            parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            flag = re.findall(r"--?[\w-]+", parts[0])[-1]
            entries[flag] = parts[1] if len(parts) > 1 else ""
        elif flag and line.startswith(" " * 4):
            entries[flag] = (entries[flag] + " " + line.strip()).strip()
    return entries


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: os.path.relpath(p, BENCH))
def test_help_describes_every_flag_and_docstring_says_how_to_run(tmp_path, path):
    rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    assert f"python {rel}" in doc, f"{rel}: the module docstring has no usage line"
    r = subprocess.run([sys.executable, path, "--help"], env=python_env(), cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    entries = help_entries(r.stdout)
    assert entries, r.stdout
    missing = [f for f, h in entries.items() if not h]
    assert not missing, f"{rel}: flags without a help line: {missing}"
    assert files_under(str(tmp_path)) == []   # --help wrote nothing


@pytest.mark.parametrize("name", ["alloc_micro.py", "alloc_probe.py", "cache_slack.py",
                                  "checkpoint_real.py", "checkpointing.py", "e2e.py",
                                  "fragmentation.py", "hf.py", "hook_overhead.py", "mimose.py",
                                  "new_shape_plan.py", "offloading.py", "planners_time.py",
                                  "pofo.py", "swap.py"])
def test_every_results_writer_takes_out(tmp_path, name):
    r = run(name, "--help", cwd=tmp_path)
    assert "--out" in help_entries(r.stdout), f"{name}: no --out"
