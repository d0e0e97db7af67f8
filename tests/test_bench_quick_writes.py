"""A bench's ``--quick`` run (the CI smoke run) writes nothing unless ``--out``: bench/results holds
full runs, and README's Results section is generated from them (bench/readme_results.py), so a
smoke run there would leave a dirty tree and, once committed, smoke numbers in the README. It
prints its table and a line saying nothing was written and how to keep it (``--out``). The rule
is ``bench.common.output_dir``; bench/e2e.py keeps its own (its committed file is the --smoke
run). The quick runs of a few seconds run whole, from a scratch folder; the slower ones run in
this process with their measurements faked, or have their decision checked. No GPU needed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _bench_fakes import fake_swap_cpu_part
from _subproc import ROOT, python_env

BENCH = os.path.join(ROOT, "bench")
RESULTS = os.path.join(BENCH, "results")
# appended, never first: the installed vmalloc comes before the checkout's unbuilt sources
for _p in (ROOT, BENCH):
    if _p not in sys.path:
        sys.path.append(_p)


def snapshot():
    """Every file under bench/results with its size and modification time."""
    out = {}
    for d, _, files in os.walk(RESULTS):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), RESULTS)] = (st.st_size, st.st_mtime_ns)
    return out


def said_nothing_written(text, flag="--out DIR"):
    return "nothing written" in text and f"pass {flag} to keep" in text


# --------------------------------------------------------------------------- the rule itself
def test_output_dir_is_out_else_none_for_quick_else_the_default():
    from bench.common import RESULTS as default, output_dir, parse_args
    assert output_dir(True, None) is None
    assert output_dir(True, "/tmp/x") == "/tmp/x"
    assert output_dir(False, None) == default
    assert output_dir(False, None, "f.json") == "f.json"
    assert output_dir(False, "/tmp/x", "f.json") == "/tmp/x"
    assert parse_args("d", ["--quick"]).out is None
    assert parse_args("d", ["--quick", "--out", "/tmp/x"]).out == "/tmp/x"
    assert parse_args("d", []).out == default


# ------------------------------------------------------- quick runs of seconds: run whole
@pytest.mark.parametrize("script, flag", [
    ("alloc_probe.py", "--out DIR"), ("cache_slack.py", "--out DIR"),
    ("checkpointing.py", "--out DIR"), ("fragmentation.py", "--out FILE"),
    ("new_shape_plan.py", "--out DIR"), ("planners_time.py", "--out DIR"),
    ("alloc_micro.py", "--out DIR"), ("hook_overhead.py", "--out DIR"),
])
def test_a_quick_run_without_out_writes_nothing(tmp_path, script, flag):
    before = snapshot()
    r = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick"],
                       env=python_env(), cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert said_nothing_written(r.stdout.strip().splitlines()[-1], flag), r.stdout[-1000:]
    assert "wrote" not in r.stdout
    assert snapshot() == before
    assert os.listdir(tmp_path) == []   # nor anywhere else


# ------------------------------------------- slower quick runs: here, measurements faked
@pytest.fixture
def threads():
    import torch
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_swap_quick_without_out_writes_nothing(monkeypatch, capsys, threads):
    from bench import swap
    fake_swap_cpu_part(monkeypatch, swap)
    before = snapshot()
    swap.main(["--quick", "--cpu-only"])
    assert said_nothing_written(capsys.readouterr().out)
    assert snapshot() == before
    assert swap._out_dir(swap.parse_args(["--quick", "--gpu-only"])) is None
    assert swap._out_dir(swap.parse_args(["--quick", "--out", "d"])) == Path("d")
    assert swap._out_dir(swap.parse_args([])) == swap.RESULTS


def test_checkpoint_real_quick_without_out_writes_nothing(monkeypatch, capsys, threads):
    from bench import checkpoint_real

    def build(name, **kw):   # the model fails before its rows: no measuring, still a result
        raise ValueError("not built in this test")
    monkeypatch.setattr(checkpoint_real, "build", build)
    before = snapshot()
    with pytest.raises(SystemExit) as e:
        checkpoint_real.main(["--quick", "--cpu", "--models", "gpt2"])
    assert "gpt2 failed" in str(e.value.code) and "recorded in" not in str(e.value.code)
    assert said_nothing_written(capsys.readouterr().out)
    assert snapshot() == before


def test_hf_quick_without_out_writes_nothing(monkeypatch, capsys, threads):
    import hf

    def boom(*a, **kw):
        raise RuntimeError("not measured in this test")
    monkeypatch.setattr(hf, "bench_model", boom)
    before = snapshot()
    with pytest.raises(SystemExit, match="gpt2 failed") as e:
        hf.main(["--quick", "--models", "gpt2"])
    assert "results file" not in str(e.value.code)
    assert said_nothing_written(capsys.readouterr().out)
    assert snapshot() == before


def test_offloading_quick_without_out_writes_nothing(monkeypatch, capsys):
    import offloading
    monkeypatch.setattr(offloading, "run_chain", lambda chain, points, slots, vdnn_max_L: {
        "name": "c", "L": chain.L, "rows": [{"chain": "c", "memory_pct": 0}]})
    monkeypatch.setattr(offloading, "summary_of", lambda rows: {"rows": len(rows)})
    before = snapshot()
    offloading.main(["--quick"])
    assert said_nothing_written(capsys.readouterr().out)
    assert snapshot() == before


def test_pofo_quick_without_out_writes_nothing(monkeypatch, capsys):
    import pofo
    point = {k: 1.0 for k in ("pofo", "rotor", "offload-only", "greedy", "autocapper",
                              "opportunist", "pofo_s", "pofo_sim_over_dp")}
    monkeypatch.setattr(pofo, "limits", lambda chain: (1.0, 2.0))
    monkeypatch.setattr(pofo, "run_point", lambda chain, M, bw: dict(point))
    monkeypatch.setattr(pofo, "random_sweep", lambda quick: {"rows": []})
    before = snapshot()
    pofo.main(["--quick"])
    assert said_nothing_written(capsys.readouterr().out)
    pofo.main(["--quick", "--random"])
    assert said_nothing_written(capsys.readouterr().out)
    assert snapshot() == before


def test_mimose_decides_before_any_work_that_quick_writes_nothing(monkeypatch):
    """mimose.py --quick takes 15 s here: its decision, taken right after its flags."""
    from bench import mimose
    seen = []

    class Decided(Exception):
        pass

    def output_dir(quick, out, default):
        seen.append((quick, out, default))
        raise Decided
    monkeypatch.setattr(mimose, "output_dir", output_dir)
    for argv in (["--quick"], ["--quick", "--out", "m.json"], []):
        with pytest.raises(Decided):
            mimose.main(argv)
    default = os.path.join(RESULTS, "mimose.json")
    assert seen == [(True, None, default), (True, "m.json", default), (False, None, default)]


# ------------------------------------------- the tags every results file carries
# bench.common.run_meta's: where a results file was made (machine, GPU or "cpu"), with what
# (torch) and when (date); a run with --out carries them as a full run does
TAGS = ("machine", "gpu", "torch", "date")


def assert_tagged(meta, gpu="cpu"):
    assert isinstance(meta, dict), meta
    missing = [k for k in TAGS if not meta.get(k)]
    assert not missing, f"meta lacks {missing}: {sorted(meta)}"
    assert meta["gpu"] == gpu


@pytest.mark.parametrize("script, out, name", [
    ("alloc_probe.py", "out", "alloc_probe.json"),
    ("checkpointing.py", "out", "checkpointing.json"),
    ("fragmentation.py", "out/fragmentation.json", "fragmentation.json"),
    ("new_shape_plan.py", "out", "new_shape_plan.json"),
    ("planners_time.py", "out", "planners_time.json"),
    ("hook_overhead.py", "out", "hook_overhead.json"),
])
def test_a_quick_run_with_out_tags_its_file(tmp_path, script, out, name):
    r = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick",
                        "--out", str(tmp_path / out)], env=python_env(), cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(tmp_path / "out" / name) as f:
        assert_tagged(json.load(f).get("meta"))


def test_alloc_micro_tags_the_gpu_it_ran_on(monkeypatch, tmp_path):
    """The top-level meta names the machine's GPU (the cuda section's), torch and the date;
    measurements faked: what is written, not what is measured."""
    from bench import alloc_micro
    import torch
    row = {"nbytes": 1, "cpp_pairs_per_s": 6e6, "cpp_ns_per_pair": 166.0,
           "python_pairs_per_s": 1e6, "python_ns_per_pair": 1000.0}
    monkeypatch.setattr(alloc_micro, "fast_path", lambda *a, **kw: dict(row))
    monkeypatch.setattr(alloc_micro, "remap_path", lambda b, c, k, n, r: {
        "k": k, "pairs_per_s": 1e5, "us_per_pair": 10.0, "chunks_remapped_per_pair": 1.0,
        "us_per_chunk_remapped": 5.0})
    monkeypatch.setattr(alloc_micro, "fresh_path", lambda b, c, k, n, r: {
        "k": k, "us_per_cycle": 20.0, "us_per_chunk_create_map_unmap_release": 20.0})
    monkeypatch.setattr(alloc_micro, "policy_table", lambda quick: {"chunk_size": 1, "traces": {}})
    monkeypatch.setattr(alloc_micro, "cuda_section", lambda quick, runs: {"device": "Fake GPU"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    alloc_micro.main(["--quick", "--out", str(tmp_path)])
    meta = json.loads((tmp_path / "alloc_micro.json").read_text())["meta"]
    assert_tagged(meta, gpu="Fake GPU")
    assert meta["command"] == "python bench/alloc_micro.py --quick"   # its own keys kept
    assert meta["cpus"] and meta["note"]


def test_swap_tags_its_top_level_meta(monkeypatch, tmp_path, threads):
    from bench import swap
    fake_swap_cpu_part(monkeypatch, swap)
    swap.main(["--quick", "--cpu-only", "--out", str(tmp_path)])
    meta = json.loads((tmp_path / "swap.json").read_text())["meta"]
    cuda = swap.torch.cuda.is_available()   # (the machine's GPU where there is one)
    assert_tagged(meta, gpu=swap.torch.cuda.get_device_name() if cuda else "cpu")
    assert meta["time"] and "cuda" in meta and "--cpu-only" in meta["command"]


def test_offloading_and_pofo_tag_their_files(monkeypatch, tmp_path):
    import offloading
    import pofo
    monkeypatch.setattr(offloading, "run_chain", lambda chain, points, slots, vdnn_max_L: {
        "name": "c", "L": chain.L, "rows": [{"chain": "c", "memory_pct": 0}]})
    monkeypatch.setattr(offloading, "summary_of", lambda rows: {"rows": len(rows)})
    monkeypatch.setattr(offloading, "pyplot", lambda: None)
    offloading.main(["--quick", "--out", str(tmp_path)])
    point = {k: 1.0 for k in ("pofo", "rotor", "offload-only", "greedy", "autocapper",
                              "opportunist", "pofo_s", "pofo_sim_over_dp")}
    monkeypatch.setattr(pofo, "limits", lambda chain: (1.0, 2.0))
    monkeypatch.setattr(pofo, "run_point", lambda chain, M, bw: dict(point))
    monkeypatch.setattr(pofo, "random_sweep", lambda quick: {"seeds": 1, "rows": []})
    monkeypatch.setattr(pofo, "pyplot", lambda: None)
    pofo.main(["--quick", "--out", str(tmp_path)])
    pofo.main(["--quick", "--random", "--out", str(tmp_path)])
    for name in ("offloading", "pofo", "pofo_random"):
        d = json.loads((tmp_path / f"{name}.json").read_text())
        assert_tagged(d["meta"])
    assert d["seeds"] == 1 and d["meta"]["command"] == "python bench/pofo.py --random --quick"
