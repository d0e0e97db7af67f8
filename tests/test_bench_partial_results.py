"""No result lost to one failure (bench review item 9): bench/checkpoint_real.py, bench/hf.py and
bench/alloc_micro.py record a failed configuration or model as an error entry, keep (and
write) everything else, and bench/readme_results.py renders such files. No GPU needed: the
failures are injected."""
import json
import re
import subprocess
import sys

import pytest

from _subproc import ROOT

# appended, never first: the installed vmalloc comes before the checkout's unbuilt sources
if ROOT not in sys.path:
    sys.path.append(ROOT)
BENCH = f"{ROOT}/bench"


def render(folder):
    if BENCH not in sys.path:
        sys.path.append(BENCH)
    from bench import readme_results
    text = readme_results.render(str(folder), str(folder))
    assert "could not read" not in text.lower() and "unexpected structure" not in text
    return text


# ------------------------------------------------------------------------ checkpoint_real.py
@pytest.fixture
def checkpoint_real():
    from bench import checkpoint_real
    return checkpoint_real


def test_runner_turns_any_exception_into_an_error_row(checkpoint_real):
    def step():
        raise RuntimeError("stream 7 is broken")
    res = checkpoint_real.Runner("cpu", steps=1).run(step, [])
    assert res == {"status": "error", "note": "RuntimeError: stream 7 is broken"}


def test_a_failing_row_and_a_failing_model_lose_nothing_else(checkpoint_real, monkeypatch,
                                                             tmp_path):
    real_wrap, real_build = checkpoint_real.scheduler.wrap, checkpoint_real.build

    def wrap(blocks, budget, planner=None, **kw):
        if planner == "pofo":
            raise RuntimeError("pofo: copy stream failed")
        return real_wrap(blocks, budget, planner=planner, **kw)

    def build(name, **kw):
        if name == "gpt2":
            raise ValueError("no such weights")
        return real_build(name, **kw)
    monkeypatch.setattr(checkpoint_real.scheduler, "wrap", wrap)
    monkeypatch.setattr(checkpoint_real, "build", build)
    writes = []
    real_write = checkpoint_real.write_result
    monkeypatch.setattr(checkpoint_real, "write_result", lambda result, path: (
        writes.append([m["model"] for m in result["models"]]), real_write(result, path)))
    n = checkpoint_real.torch.get_num_threads()
    try:
        with pytest.raises(SystemExit, match="gpt2 failed"):   # the exit status says so
            checkpoint_real.main(["--quick", "--cpu", "--models", "resnet18,gpt2",
                                  "--out", str(tmp_path)])
    finally:
        checkpoint_real.torch.set_num_threads(n)
    assert writes == [["resnet18"], ["resnet18", "gpt2"]]   # written after every model
    d = json.loads((tmp_path / "checkpoint_real-cpu.json").read_text())
    rn, gpt2 = d["models"]
    pofo = [r for r in rn["rows"] if r["method"] == "wrap:pofo"]
    assert pofo and all(r["status"] == "error" and "copy stream failed" in r["note"]
                        for r in pofo)
    assert {r["status"] for r in rn["rows"] if r["method"] != "wrap:pofo"} == {"ok"}
    assert d["summary"]["resnet18"]["rotor_vs_best_periodic_mean_gain"] is not None
    assert gpt2["status"] == "error" and "no such weights" in gpt2["error"]
    assert gpt2["rows"] == [] and d["summary"]["gpt2"]["budgets"] == 0
    text = render(tmp_path)
    assert "gpt2: ValueError: no such weights" in text and "wrap:pofo: RuntimeError" in text


# --------------------------------------------------------------------------------- hf.py
@pytest.fixture
def hf():
    if BENCH not in sys.path:
        sys.path.append(BENCH)
    import hf
    return hf


def test_a_failed_model_process_keeps_the_other_models_rows(hf, monkeypatch, tmp_path):
    """Each model in its own process (the full run): one that dies is recorded with its error
    and exit status, the models before and after it are written, the exit status is 1."""
    row = {"method": "plain", "budget": None, "status": "ok", "step_s": 0.1, "peak": 1000}
    ran, written = [], []

    def run(cmd, **kw):
        name, out = cmd[cmd.index("--models") + 1], cmd[cmd.index("--out") + 1]
        ran.append(name)
        if name == "bert":   # dies without a word in its results file
            return subprocess.CompletedProcess(cmd, -9, None, "Killed\n")
        if name == "llama":   # failed, and recorded it itself
            m = hf.failed_model(name, (4, 256), "RuntimeError: CUDA error: misaligned address")
            rc = 1
        else:
            m = {"model": name, "batch": 4, "seq_len": 256, "rows": [row], "goal": {}}
            rc = 0
        with open(f"{out}/hf-cpu.json", "w") as f:
            json.dump({"meta": {}, "models": [m]}, f)
        return subprocess.CompletedProcess(cmd, rc, None, "")
    monkeypatch.setattr(subprocess, "run", run)
    real_write = hf.write_json
    monkeypatch.setattr(hf, "write_json", lambda name, data, out: (
        written.append(len(data["models"])), real_write(name, data, out))[1])
    with pytest.raises(SystemExit, match="bert, llama failed"):
        hf.main(["--device", "cpu", "--models", "gpt2,bert,llama,bert-cls",
                 "--out", str(tmp_path)])
    assert ran == ["gpt2", "bert", "llama", "bert-cls"] and written == [1, 2, 3, 4]
    d = json.loads((tmp_path / "hf-cpu.json").read_text())
    gpt2, bert, llama, cls = d["models"]
    assert gpt2["rows"] == [row] and cls["rows"] == [row]
    assert bert["status"] == "error" and bert["returncode"] == -9 and "Killed" in bert["error"]
    assert llama["returncode"] == 1 and "misaligned address" in llama["error"]
    text = render(tmp_path)
    assert "bert: the model's process failed: Killed" in text and "misaligned" in text


def test_resume_keeps_the_models_done_and_runs_the_rest(hf, monkeypatch, tmp_path):
    """--resume (gpu-check's hf step, cut off at its time limit): models already in the results
    file without an error, measured the same way, are kept; failed and missing ones run."""
    row = {"method": "plain", "budget": None, "status": "ok", "step_s": 0.1, "peak": 1000}
    ran = []

    def run(cmd, **kw):
        name, out = cmd[cmd.index("--models") + 1], cmd[cmd.index("--out") + 1]
        ran.append(name)
        with open(f"{out}/hf-cpu.json", "w") as f:
            json.dump({"meta": {}, "models": [{"model": name, "batch": 4, "seq_len": 256,
                                               "rows": [row], "goal": {}}]}, f)
        return subprocess.CompletedProcess(cmd, 0, None, "")
    monkeypatch.setattr(subprocess, "run", run)
    argv = ["--device", "cpu", "--models", "gpt2,bert,llama", "--out", str(tmp_path)]
    hf.main(argv)
    d = json.loads((tmp_path / "hf-cpu.json").read_text())
    d["models"] = [d["models"][0], hf.failed_model("bert", (4, 256), "killed at the limit")]
    (tmp_path / "hf-cpu.json").write_text(json.dumps(d))     # llama never reached
    ran.clear()
    hf.main(argv + ["--resume"])
    assert ran == ["bert", "llama"]
    assert [m["model"] for m in json.loads((tmp_path / "hf-cpu.json").read_text())["models"]] \
        == ["gpt2", "bert", "llama"]
    d["meta"]["steps"] = 99     # measured otherwise: nothing kept
    (tmp_path / "hf-cpu.json").write_text(json.dumps(d))
    ran.clear()
    hf.main(argv + ["--resume"])
    assert ran == ["gpt2", "bert", "llama"]


def test_stop_at_stops_a_model_in_time_and_leaves_the_rest_for_resume(hf, monkeypatch,
                                                                       tmp_path):
    """--stop-at (gpu-check's hf step): a model's process still running at the deadline is
    stopped and not recorded (no error row: --resume runs it), no model starts without the
    time the longest one took, and the file says incomplete, naming what is left."""
    row = {"method": "plain", "budget": None, "status": "ok", "step_s": 0.1, "peak": 1000}
    ran, timeouts = [], []
    clock = [1000.0]
    monkeypatch.setattr(hf.time, "time", lambda: clock[0])

    def run(cmd, timeout=None, **kw):
        name, out = cmd[cmd.index("--models") + 1], cmd[cmd.index("--out") + 1]
        ran.append(name)
        timeouts.append(timeout)
        if name == "bert" and len(timeouts) == 2:   # runs past the first call's deadline
            clock[0] += timeout
            raise subprocess.TimeoutExpired(cmd, timeout, stderr="half way\n")
        clock[0] += 100.0    # gpt2 takes 100 s
        with open(f"{out}/hf-cpu.json", "w") as f:
            json.dump({"meta": {}, "models": [{"model": name, "batch": 4, "seq_len": 256,
                                               "rows": [row], "goal": {}}]}, f)
        return subprocess.CompletedProcess(cmd, 0, None, "")
    monkeypatch.setattr(subprocess, "run", run)
    argv = ["--device", "cpu", "--models", "gpt2,bert,llama", "--out", str(tmp_path),
            "--resume"]
    hf.main(argv + ["--stop-at", "1250"])
    # gpt2: 250 s left; bert: 150 s left >= 100 s, killed at the deadline; llama: none left
    assert ran == ["gpt2", "bert"] and timeouts == [250.0, 150.0]
    d = json.loads((tmp_path / "hf-cpu.json").read_text())
    assert [m["model"] for m in d["models"]] == ["gpt2"]
    assert d["meta"]["incomplete"] and d["meta"]["left_out"] == ["bert", "llama"]
    ran.clear()
    hf.main(argv + ["--stop-at", "5000"])
    assert ran == ["bert", "llama"]
    d = json.loads((tmp_path / "hf-cpu.json").read_text())
    assert [m["model"] for m in d["models"]] == ["gpt2", "bert", "llama"]
    assert "incomplete" not in d["meta"]


def test_a_model_longer_than_a_call_is_recorded_timed_out_and_kept(hf, monkeypatch, tmp_path):
    """A model's process given MODEL_TIMEOUT_S or more and still running at --stop-at would be
    started over, and stopped again, by every later call (and hold up the steps after hf):
    it is recorded as timed out, kept by --resume, and the README table says so."""
    clock = [1000.0]
    monkeypatch.setattr(hf.time, "time", lambda: clock[0])
    ran = []

    def run(cmd, timeout=None, **kw):
        ran.append(cmd[cmd.index("--models") + 1])
        clock[0] += timeout
        raise subprocess.TimeoutExpired(cmd, timeout, stderr=b"")
    monkeypatch.setattr(subprocess, "run", run)
    argv = ["--device", "cpu", "--models", "gpt2,bert", "--out", str(tmp_path), "--resume"]
    hf.main(argv + ["--stop-at", str(1000 + hf.MODEL_TIMEOUT_S)])
    d = json.loads((tmp_path / "hf-cpu.json").read_text())
    (gpt2,) = d["models"]
    assert gpt2["status"] == "timeout" and "error" not in gpt2 and "still running" in gpt2["note"]
    assert d["meta"]["left_out"] == ["bert"]
    ran.clear()
    hf.main(argv + ["--stop-at", str(clock[0] + 100)])   # kept; bert: too short, left again
    assert ran == ["bert"]
    assert re.search(r"gpt2\s*\|(\s*-\s*\|){5}\s*timeout", render(tmp_path))


def test_a_model_that_raises_in_process_is_recorded(hf, monkeypatch, tmp_path):
    def boom(*a, **kw):
        raise RuntimeError("boom")
    monkeypatch.setattr(hf, "bench_model", boom)
    with pytest.raises(SystemExit, match="gpt2 failed"):
        hf.main(["--quick", "--models", "gpt2", "--out", str(tmp_path)])
    (m,) = json.loads((tmp_path / "hf-cpu.json").read_text())["models"]
    assert m["error"] == "RuntimeError: boom" and m["rows"] == [] and m["batch"] == 4


def test_a_row_that_raises_is_an_error_row(hf, monkeypatch):
    monkeypatch.setattr(hf, "checkpoint_missing", lambda: None)

    def checkpointed(model, budget, planner):
        raise RuntimeError("stream wait failed")
    monkeypatch.setattr(hf, "checkpointed", checkpointed)
    row = hf.checkpoint_row("pofo", 100, "pofo", lambda: None, None, 1, "cpu")
    assert row == {"method": "pofo", "budget": 100, "status": "error",
                   "note": "RuntimeError: stream wait failed"}


def test_cuda_configs_are_gpt2_small_sized_and_cpu_ones_unchanged(hf):
    import torch
    cuda, cpu, quick = hf.configs(False, "cuda"), hf.configs(False, "cpu"), hf.configs(True, "cuda")
    assert {k: s for k, (_, s) in cuda.items()} == {k: (8, 1024) for k in hf.MODELS.split(",")}
    assert {k: s for k, (_, s) in cpu.items()} == {k: (4, 256) for k in hf.MODELS.split(",")}
    assert {s for _, s in quick.values()} == {(4, 32)}
    with torch.device("meta"):   # the configs, without allocating the weights
        g, b, ll = (cuda[k][0]().config for k in ("gpt2", "bert", "llama"))
        c = cpu["gpt2"][0]().config
    assert (g.n_layer, g.n_embd, g.n_head, g.n_positions, g.vocab_size) == (12, 768, 12, 1024, 50257)
    assert (b.num_hidden_layers, b.hidden_size, b.num_attention_heads, b.intermediate_size) == \
        (12, 768, 12, 3072)
    assert (ll.num_hidden_layers, ll.hidden_size, ll.num_attention_heads) == (12, 768, 12)
    assert (c.n_layer, c.n_embd, c.n_head, c.vocab_size) == (6, 128, 4, 512)


# --------------------------------------------------------------------------- alloc_micro.py
@pytest.fixture
def alloc_micro(monkeypatch):
    from bench import alloc_micro

    def fast_path(backend, chunk, nbytes, pairs, runs, side_stream=None):
        return {"nbytes": nbytes, "cpp_pairs_per_s": 6e6, "cpp_ns_per_pair": 166.0,
                "python_pairs_per_s": 1e6, "python_ns_per_pair": 1000.0}

    def remap_path(backend, chunk, k, cycles, runs):
        if backend == "cuda" and k == 8:
            raise AssertionError("cuMemMap failed")
        return {"k": k, "pairs_per_s": 1e5, "us_per_pair": 10.0, "chunks_remapped_per_pair": 1.0,
                "unmaps_per_pair": 1.0, "us_per_chunk_remapped": 5.0}

    def fresh_path(backend, chunk, k, iters, runs):
        return {"k": k, "us_per_cycle": 20.0, "us_per_chunk_create_map_unmap_release": 20.0 / k}

    class Cudart:   # cudaMalloc refuses: cudaErrorMemoryAllocation
        def cudaMalloc(self, p, n):
            return 2

        def cudaFree(self, p):
            return 0
    monkeypatch.setattr(alloc_micro, "fast_path", fast_path)
    monkeypatch.setattr(alloc_micro, "remap_path", remap_path)
    monkeypatch.setattr(alloc_micro, "fresh_path", fresh_path)
    monkeypatch.setattr(alloc_micro, "policy_table", lambda quick: {"chunk_size": 1, "traces": {}})
    monkeypatch.setattr(alloc_micro, "granularity", lambda backend: 2 << 20)
    monkeypatch.setattr(alloc_micro, "_cudart", lambda: Cudart())
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    return alloc_micro


def test_a_failing_cuda_measurement_is_an_error_entry_the_rest_is_written(alloc_micro,
                                                                          tmp_path):
    alloc_micro.main(["--quick", "--out", str(tmp_path)])
    d = json.loads((tmp_path / "alloc_micro.json").read_text())
    assert d["host"]["fast_large_2chunks"]["cpp_pairs_per_s"] == 6e6   # the host section
    c = d["cuda"]
    assert c["device"] == "Fake GPU" and c["vmalloc_fast_2chunks"]["cpp_pairs_per_s"] == 6e6
    assert [r["k"] for r in c["vmalloc_remap"]] == [2, 32]   # k=8 failed; cache_slack reads these
    assert "cuMemMap failed" in c["errors"]["vmalloc_remap k=8"]
    assert "cudaError 2" in c["cudaMalloc_cudaFree_4096"]["error"]
    if not torch_has_cuda():   # (this torch has no CUDA: its rows fail too, each on its own)
        assert "error" in c["torch_caching_empty_del_4096"]
        assert "error" in c["vmalloc_fast_2chunks_two_streams"]
    text = render(tmp_path)
    assert "Failed measurements (the others ran)" in text and "vmalloc_remap k=8" in text


def test_a_cuda_section_that_raises_keeps_the_host_section(alloc_micro, monkeypatch, tmp_path):
    def boom(quick, runs):
        raise RuntimeError("driver gone")
    monkeypatch.setattr(alloc_micro, "cuda_section", boom)
    alloc_micro.main(["--quick", "--out", str(tmp_path)])
    d = json.loads((tmp_path / "alloc_micro.json").read_text())
    assert d["host"]["remap"] and d["cuda"] == {"error": "RuntimeError: driver gone"}
    assert "GPU part failed: RuntimeError: driver gone" in render(tmp_path)


def test_policies_only_replaces_the_policy_table_and_keeps_the_gpu_rows(alloc_micro,
                                                                        monkeypatch, tmp_path):
    """After a change of the reuse policy the table is measured again on any machine (its
    counts do not depend on it) and put into the committed file: the GPU's rows stay."""
    with pytest.raises(SystemExit, match="no results file to update"):
        alloc_micro.main(["--policies-only", "--out", str(tmp_path)])
    path = tmp_path / "alloc_micro.json"
    path.write_text(json.dumps({"meta": {"gpu": "H100"}, "cuda": {"device": "H100", "x": 1},
                                "host": {"remap": [1], "policies": {"old": True}}}))
    monkeypatch.setattr(alloc_micro, "policy_table",
                        lambda quick: {"chunk_size": 1, "traces": {"static": {"rows": {}}}})
    alloc_micro.main(["--policies-only", "--out", str(tmp_path)])
    d = json.loads(path.read_text())
    assert d["cuda"] == {"device": "H100", "x": 1} and d["meta"] == {"gpu": "H100"}
    assert d["host"]["remap"] == [1]
    assert d["host"]["policies"] == {"chunk_size": 1, "traces": {"static": {"rows": {}}}}
    assert d["host"]["policies_meta"]["command"] == "python bench/alloc_micro.py --policies-only"


def torch_has_cuda():
    import torch
    return torch.backends.cuda.is_built()
