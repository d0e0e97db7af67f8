"""Issue 15 without torchrun: the per-process naming rule of the VMALLOC_REPORT exit report,
and agree_chain outside a process group."""
import importlib
import multiprocessing
import os
import sys

import pytest

from vmalloc import report_process as P
from vmalloc.pluggable import live_report as L
from vmalloc.report_format import load, to_text


@pytest.mark.parametrize("target,env,want", [
    ("frag.json", {}, "frag.json"),                                     # a lone process
    ("frag.json", {"RANK": "3", "WORLD_SIZE": "4"}, "frag.rank3.json"),
    ("out/frag.txt", {"LOCAL_RANK": "1"}, "out/frag.rank1.txt"),        # LOCAL_RANK alone
    ("frag", {"RANK": "0", "LOCAL_RANK": "5"}, "frag.rank0"),           # RANK wins, no extension
    ("r{rank}-{pid}.json", {"RANK": "2"}, "r2-77.json"),                # placeholders
    ("r{rank}.json", {}, "rpid77.json"),
    ("-", {"RANK": "1"}, "-"),
    ("stderr", {"RANK": "1"}, "stderr"),
])
def test_report_path(target, env, want):
    assert P.report_path(target, env, pid=77) == want


def test_a_training_process_that_imports_the_elastic_agent_is_no_launcher(monkeypatch):
    """HF's Trainer (through accelerate) imports torch's elastic agent in every training
    process: that must not be taken for torchrun's launcher (its report would be lost)."""
    importlib.import_module("torch.distributed.elastic.agent.server.local_elastic_agent")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert not P.is_launcher({}) and P.report_path("frag.json", {}, pid=1) == "frag.json"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/torchrun", "train.py"])
    assert P.is_launcher({}) and P.report_path("frag.json", {}) is None
    monkeypatch.setattr(sys, "argv", ["/usr/bin/accelerate", "launch", "train.py"])
    assert P.is_launcher({})


def _child_path(q):
    q.put(P.report_path("frag.json", {}, pid=5))


def test_a_multiprocessing_child_without_rank_gets_its_pid():
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_path, args=(q,))
    p.start()
    try:
        assert q.get(timeout=120) == "frag.pid5.json"
    finally:
        p.join(timeout=120)


def _ranked_child_path(q):
    q.put([P.report_path("frag.json", {"RANK": "0"}, pid=5),
           P.report_path("r{rank}.json", {"RANK": "0"}, pid=5)])


def test_a_multiprocessing_child_of_a_rank_does_not_take_the_ranks_report():
    # a spawned DataLoader worker inherits RANK and runs the autoload too (spawn children exit
    # through atexit): it must not overwrite its rank's report with its own empty one
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ranked_child_path, args=(q,))
    p.start()
    try:
        paths = q.get(timeout=120)
    finally:
        p.join(timeout=120)
    assert paths[0] != P.report_path("frag.json", {"RANK": "0"}, pid=5) == "frag.rank0.json"
    assert paths[1] != P.report_path("r{rank}.json", {"RANK": "0"}, pid=5) == "r0.json"
    assert paths == ["frag.rank0.pid5.json", "r0.pid5.json"]


def test_the_launcher_writes_none_and_a_rank_is_never_the_launcher(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/usr/bin/torchrun", "--nproc-per-node", "2", "t.py"])
    assert P.is_launcher({}) and P.report_path("frag.json", {}) is None
    assert not P.is_launcher({"RANK": "0"})
    monkeypatch.setattr("sys.argv", ["train.py"])
    assert not P.is_launcher({})


def test_a_lone_script_that_imported_the_elastic_agent_still_writes_its_report(monkeypatch):
    # `import torch.distributed.checkpoint` and `from transformers import Trainer` import
    # torch's elastic agent module: that alone must not silence a lone process's report
    import types
    monkeypatch.setattr("sys.argv", ["train.py"])
    monkeypatch.setitem(sys.modules, "torch.distributed.elastic.agent.server.local_elastic_agent",
                        types.ModuleType("local_elastic_agent"))
    assert not P.is_launcher({})
    assert P.report_path("frag.json", {}) == "frag.json"


def test_every_report_names_its_process():
    rep = L.collect()
    p = rep["process"]
    assert p["pid"] == os.getpid() and "rank" in p and "device" in p and p["host"]
    text = to_text(rep)
    assert f"pid {os.getpid()}" in text.splitlines()[1]


@pytest.mark.parametrize("target", ["-", "stdout", "STDOUT"])
def test_exit_report_to_stdout_writes_no_file(tmp_path, monkeypatch, capsys, target):
    monkeypatch.chdir(tmp_path)
    L.write_exit_report(target)
    assert "vmalloc" in capsys.readouterr().out and not list(tmp_path.iterdir())


@pytest.mark.parametrize("target", ["stderr", "StdErr"])
def test_exit_report_to_stderr_writes_no_file(tmp_path, monkeypatch, capsys, target):
    monkeypatch.chdir(tmp_path)
    L.write_exit_report(target)
    out, err = capsys.readouterr()
    assert "vmalloc report" in err and not out and not list(tmp_path.iterdir())


def test_exit_report_goes_to_the_rank_path(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    L.write_exit_report(str(tmp_path / "frag.json"))
    rep = load(str(tmp_path / "frag.rank1.json"))
    assert (rep["process"]["rank"], rep["process"]["world_size"]) == (1, 2)
    assert not (tmp_path / "frag.json").exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_write_its_parents_report(tmp_path):
    """A child forked from the process that registered the exit hook inherits it; exiting
    normally it must not overwrite (or truncate) the parent's report."""
    target = str(tmp_path / "frag.json")
    pid = os.fork()
    if pid == 0:   # the child: the hook as atexit would call it, with the parent's pid
        try:
            L.write_exit_report(target, owner_pid=os.getppid())
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not os.path.exists(target) and not list(tmp_path.iterdir())
    L.write_exit_report(target, owner_pid=os.getpid())   # the owner writes it
    assert load(target)["process"]["pid"] == os.getpid()


def test_agree_chain_without_a_process_group_is_the_chain_itself():
    from scheduler import Chain
    from scheduler.runtime.distributed import active, agree_chain
    c = Chain.random(4, seed=2)
    assert not active() and agree_chain(c, key="x") is c
    with pytest.raises(TypeError, match="Chain"):
        agree_chain("not a chain")
