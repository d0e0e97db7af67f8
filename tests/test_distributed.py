"""Several processes (issue 15): DDP, FSDP2 and FSDP1 (both FSDPs also in bfloat16) under torchrun
with 2 gloo ranks on localhost, with every runtime (Hugging Face's Llama, its KV cache on by
default: scheduler.checkpoint), gradients per rank and step bit-identical to the plain run of the same
setup, plans agreeing across ranks, and one vmalloc report per rank (none from the launcher).

Two launches of ``tests/dist_worker.py`` run every case (a launch costs seconds of start-up,
so cases are batched): the first with ``VMALLOC_REPORT=<tmp>/frag.json`` runs plain training,
``scheduler.swap``, ``scheduler.wrap`` and ``scheduler.checkpoint`` (rotor, pofo, periodic, mimose;
and rotor called on the DDP/FSDP wrapper after it wrapped the model);
the second runs plain training with ``VMALLOC_WINDOW`` (the global byte window) and
``VMALLOC_REPORT=-``. Each launch is bounded by a timeout that kills the whole process group.

To cover a new runtime, add it to ``dist_worker.RUNTIMES`` (and to ``MAIN_RUNTIMES`` here).
"""
from __future__ import annotations

import json
import os
import signal
import site
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

import dist_worker as W
from _subproc import autoload_env, python_env
from vmalloc.report_format import load as load_report

# the VMALLOC_* variables act through the autoload .pth, installed in a user site-packages; where
# that is disabled (a venv), the DDP/FSDP matrix still runs, the window and report cases skip
AUTOLOAD = site.ENABLE_USER_SITE
needs_autoload = pytest.mark.skipif(not AUTOLOAD, reason="user site-packages disabled (the "
                                    "autoload .pth that reads VMALLOC_* lives there)")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
LAUNCH_TIMEOUT_S = 300
MODELS = ("cnn", "transformer", "llama")
MAIN_RUNTIMES = ("plain", "swap", "wrap-rotor", "wrap-pofo", "wrap-mimose",
                 "wrap-rotor-input-aware", "checkpoint-rotor", "checkpoint-pofo",
                 "checkpoint-periodic", "checkpoint-mimose", "checkpoint-rotor-on-wrapper",
                 "checkpoint-mimose-on-wrapper", "checkpoint-rotor-input-aware")
WRAPS = ("wrap-rotor", "wrap-pofo", "wrap-mimose", "wrap-rotor-input-aware")

# (runtime, parallel) pairs that cannot work yet, each with the reason (strict xfail: fixing one
# fails the test until it leaves this map). The non-reentrant runner made every wrap case work.
KNOWN_BROKEN: Dict[Tuple[str, str], str] = {}

# (runtime, parallel) pairs refused on purpose, with what the error must say: InputAwareChain
# runs the blocks' forward and backward outside the step, which FSDP1 units do not allow;
REFUSED: Dict[Tuple[str, str], str] = {
    **{("wrap-rotor-input-aware", p): "InputAwareChain measures the blocks"
       for p in ("fsdp1-block", "fsdp1-block-orig")},
    # scheduler.wrap's loop calls the units: a step that measures would run one twice, which
    # FSDP1's mixed precision does not survive (scheduler.checkpoint intercepts inside them)
    **{(r, "fsdp1-block-bf16"): "FSDP1 unit with mixed precision"
       for r in ("wrap-rotor", "wrap-pofo", "wrap-mimose", "wrap-rotor-input-aware")}}


def launch(out: str, tmp_path, args: List[str], **env: str) -> subprocess.CompletedProcess:
    """torchrun with 2 ranks on a free localhost port, started again once if it failed before
    any case ran (the free port it picked was taken meanwhile by another job on the machine)."""
    r = _launch_once(out, tmp_path, args, **env)
    ran = [case for recs in read_cases(out).values() for case in recs if case != "process"]
    if r.returncode != 0 and not ran:
        r = _launch_once(out, tmp_path, args, **env)
    return r


def _launch_once(out: str, tmp_path, args: List[str], **env: str) -> subprocess.CompletedProcess:
    """One torchrun launch; its process group is killed on timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", "2", WORKER, out, *args]
    os.makedirs(out, exist_ok=True)
    variables = dict(OMP_NUM_THREADS="1", **env)
    environ = autoload_env(tmp_path, **variables) if AUTOLOAD else python_env(**variables)
    proc = subprocess.Popen(cmd, env=environ,
                            cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        done = read_cases(out).get(0, {})
        pytest.fail(f"torchrun did not finish in {LAUNCH_TIMEOUT_S} s (a hang?); cases done on "
                    f"rank 0: {list(done)}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


# what a rank that crashed at exit (after its cases passed) leaves in the launch's output
EXIT_CRASH_MARKERS = ("terminate called", "Fatal Python error", "core dumped", "SIGABRT",
                      "SIGSEGV")


def assert_clean_exit(r: subprocess.CompletedProcess, out: str) -> Dict[int, Dict[str, dict]]:
    """Every rank ran to the end of the worker (its "exit" record, written after
    ``scheduler.runtime.distributed.shutdown``) and then exited 0 with no crash in the output:
    an abort at interpreter exit, after every case passed, fails the launch here, by name.
    Returns the ranks' case records without the "exit" ones."""
    cases = read_cases(out)
    text = r.stdout + r.stderr
    crashed = [m for m in EXIT_CRASH_MARKERS if m in text]
    assert r.returncode == 0 and not crashed, (
        f"torchrun exited {r.returncode}, crash markers {crashed}:\n{r.stderr[-4000:]}")
    for rank in (0, 1):
        assert cases.get(rank, {}).pop("exit", None) is not None, (
            f"rank {rank} did not reach the end of the worker:\n{r.stderr[-4000:]}")
    return cases


def read_cases(out: str) -> Dict[int, Dict[str, dict]]:
    got: Dict[int, Dict[str, dict]] = {}
    for rank in (0, 1):
        path = os.path.join(out, f"rank{rank}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                lines = f.read().splitlines()
            recs = []
            for line in lines:
                try:
                    recs.append(json.loads(line))
                except ValueError:  # the last line, cut short by a kill
                    recs.append({"case": "cut-short", "line": line[:200]})
            got[rank] = {r["case"]: r for r in recs}
    return got


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, dict]:
    tmp = tmp_path_factory.mktemp("dist")
    main = launch(str(tmp / "main"), tmp, ["--agreement", "--runtimes", ",".join(MAIN_RUNTIMES)],
                  VMALLOC_REPORT=str(tmp / "frag.json"))
    cases = assert_clean_exit(main, str(tmp / "main"))
    if not AUTOLOAD:
        return {"tmp": tmp, "cases": cases, "window_stdout": ""}
    window = launch(str(tmp / "window"), tmp, ["--runtimes", "window"],
                    VMALLOC_WINDOW="64KiB", VMALLOC_REPORT="-")
    for rank, recs in assert_clean_exit(window, str(tmp / "window")).items():
        recs["window-process"] = recs.pop("process")
        cases[rank].update(recs)
    return {"tmp": tmp, "cases": cases, "window_stdout": window.stdout}


def _case_params():
    for model in MODELS:
        for runtime in (*MAIN_RUNTIMES[1:], "window"):
            if model in W.HF_MODELS and runtime not in W.HF_RUNTIMES:
                continue
            for parallel in W.PARALLEL:
                if (model, parallel) in W.NOT_RUN:
                    continue
                marks = []
                reason = KNOWN_BROKEN.get((runtime, parallel))
                if reason:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
                if runtime == "window":
                    marks.append(needs_autoload)
                yield pytest.param(model, runtime, parallel, marks=marks,
                                   id=f"{model}-{runtime}-{parallel}")


@pytest.mark.parametrize("model,runtime,parallel", list(_case_params()))
def test_gradients_match_plain_per_rank_and_step(runs, model, runtime, parallel):
    name = f"{model}/{runtime}/{parallel}"
    refused = REFUSED.get((runtime, parallel))
    for rank in (0, 1):
        rec = runs["cases"][rank][name]
        if refused is not None:
            assert rec["status"] == "error" and refused in rec["error"], rec
            continue
        assert rec["status"] == "ok", f"rank {rank}: {rec['error']}\n{rec.get('trace', '')}"
        ref = runs["cases"][rank][f"{model}/plain/{parallel}"]
        assert ref["status"] == "ok", ref.get("error")
        for step, (got, want) in enumerate(zip(rec["steps"], ref["steps"])):
            assert not got["missing"], f"rank {rank} step {step}: no gradient for {got['missing']}"
            assert got["losses"] == want["losses"], f"rank {rank} step {step}: losses differ"
            assert got["sha"] == want["sha"], f"rank {rank} step {step}: gradients differ"
        assert len(rec["steps"]) == len(ref["steps"]) == W.STEPS
        if runtime.startswith(("checkpoint-", "wrap-")) and "mimose" not in runtime:
            # the budget is half way (budget_for): the last step's plan (its shape measured
            # at the first step) recomputes or offloads (Mimose still collects)
            assert rec["recomputed"] + rec["offloaded"] > 0, f"rank {rank}: the plan kept all"
            assert "profile" not in rec["last_planners"], f"rank {rank}: {rec['last_planners']}"
        if runtime == "checkpoint-rotor-input-aware":   # each input size learnt once
            sizes = 1 if model == "cnn" else len(set(W.SEQ_LENS))
            assert rec["input_aware"]["measurements"] == sizes, rec["input_aware"]


def test_plans_agree_across_ranks_where_fsdp_shards_the_blocks(runs):
    planned = [name for name, rec in runs["cases"][0].items() if "plan" in rec]
    assert any("/wrap-rotor/" in n for n in planned)
    for name in planned:
        agreed = runs["cases"][0][name]["agreed_over_ranks"]
        if "-block" in name:   # a recomputation calls a block's FSDP unit, which gathers its
            # parameters in a collective: every rank runs one plan
            assert runs["cases"][0][name]["plan"] == runs["cases"][1][name]["plan"], \
                (name, [runs["cases"][r][name].get("mimose_xbar") for r in (0, 1)])
            # and Mimose learnt the same bytes on both (the ranks' inputs have one shape): a
            # stale weight address once left an activation out on one rank (FSDP1, orig params)
            assert runs["cases"][0][name].get("mimose_xbar") == \
                runs["cases"][1][name].get("mimose_xbar"), name
            if "/wrap-rotor" in name or "/wrap-pofo/" in name:  # planned on the agreed chain
                assert agreed == 2, name
        elif "/ddp" in name:   # each rank plans on its own measurement: no collective
            assert agreed is None, name
        # (FSDP of the whole model: the blocks' recomputations gather nothing; either is right)
    for name, rec in runs["cases"][0].items():
        if "/checkpoint-rotor/" in name or "/checkpoint-pofo/" in name:
            # the model's step: what it holds beside the chain counts (here the random states
            # the runner keeps), also where FSDP's profiling step measures forward-only
            assert rec.get("outside") and rec["outside"]["forward"] > 0, (name, rec.get("outside"))
            # one chain per shape met, also where FSDP's profiling step measures forward-only
            assert rec.get("chains_measured", 0) >= 1, (name, rec.get("chains_measured"))


def test_agree_chain_takes_the_max_and_rejects_different_inputs(runs):
    a0, a1 = (runs["cases"][r]["agreement"] for r in (0, 1))
    fields = ("fw", "bw", "x", "xbar", "delta", "fw_tmp", "bw_tmp")
    assert [a0["agreed"][f] for f in fields] == [a1["agreed"][f] for f in fields]
    assert a0["is_max"] and a1["is_max"]
    assert a0["device_index_ignored"] and a1["device_index_ignored"]
    assert a0["agreed"]["meta"]["agreed_over_ranks"] == 2
    for a in (a0, a1):
        assert "different inputs" in a["mismatch"], a["mismatch"]


@needs_autoload
def test_one_report_per_rank_and_none_from_the_launcher(runs):
    tmp = runs["tmp"]
    assert not (tmp / "frag.json").exists(), "the launcher (or a rank) wrote the unsuffixed path"
    for rank in (0, 1):
        path = tmp / f"frag.rank{rank}.json"
        assert path.exists() and path.stat().st_size > 0, path
        rep = load_report(str(path))
        proc = rep["process"]
        assert (proc["rank"], proc["world_size"]) == (rank, 2)
        assert proc["pid"] == runs["cases"][rank]["process"]["pid"]
        assert "device" in proc


@needs_autoload
def test_stdout_reports_name_their_rank(runs):
    out = runs["window_stdout"]
    assert out.count("vmalloc report:") == 2, out[-2000:]
    for rank in (0, 1):
        pid = runs["cases"][rank]["window-process"]["pid"]
        assert f"process: rank {rank}/2, local rank {rank}, pid {pid}" in out
    assert all(runs["cases"][r]["window-process"]["window"] == "64KiB" for r in (0, 1))
