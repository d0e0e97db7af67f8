"""VMALLOC_REPORT in the processes a process starts: a training script a driver runs with
``subprocess.run``, a child of a bare ``os.fork()`` before torch is imported, a rank's helper.
Each writes its own report (named by its pid), never the one of the process that started it,
which it overwrote before; torchrun's ranks keep their per-rank names. A process that writes no
report (a launcher, a driver that never imports torch) claims no path: the process it starts
writes the path as given. And the report path is the absolute one checked at start-up, whatever
``os.chdir`` happens meanwhile.
"""
import json
import os
import site
import subprocess
import sys
import textwrap

import pytest

from _subproc import autoload_env
from vmalloc import report_process as P

OWNER = P.OWNER_VARIABLE


def run(tmp_path, code, **env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env=autoload_env(tmp_path, **env), capture_output=True, text=True,
                          timeout=240, cwd=str(tmp_path))


def reports(directory):
    return {p.name: json.loads(p.read_text()) for p in directory.iterdir()
            if p.name.endswith(".json")}


# ------------------------------------------------------------------------------------ the rule


def test_the_first_process_owns_the_path_and_its_descendants_name_theirs_by_pid():
    env = {}
    P.claim_report(env, pid=10)
    assert env[OWNER] == "10:" and P.report_path("frag.json", env, pid=10) == "frag.json"
    child = dict(env)                       # what a subprocess (or a forked child) inherits
    P.claim_report(child, pid=11)
    assert child[OWNER] == "10:"            # the path stays its parent's
    assert P.report_path("frag.json", child, pid=11) == "frag.pid11.json"
    assert P.report_path("r{rank}.json", child, pid=11) == "rpid11.json"


def test_ranks_below_a_launcher_keep_their_rank_names_and_their_helpers_add_the_pid():
    launcher = {OWNER: "10:"}               # (a launcher claims nothing: the next test)
    rank = dict(launcher, RANK="1", WORLD_SIZE="2")
    P.claim_report(rank, pid=20)            # another rank than the owner's: its own path
    assert rank[OWNER] == "20:1"
    assert P.report_path("frag.json", rank, pid=20) == "frag.rank1.json"
    helper = dict(rank)                     # e.g. a DataLoader worker or a subprocess of rank 1
    P.claim_report(helper, pid=21)
    assert P.report_path("frag.json", helper, pid=21) == "frag.rank1.pid21.json"


@pytest.mark.parametrize("argv", [["/usr/bin/accelerate", "launch", "train.py"],
                                  ["torchrun", "--nproc-per-node", "2", "train.py"]])
def test_a_launcher_claims_nothing(monkeypatch, argv):
    """It writes no report: under `accelerate launch` (its simple launcher sets no RANK) the
    training process had the launcher's rank (none) and wrote acc.pid<PID>.json, no acc.json."""
    monkeypatch.setattr(sys, "argv", argv)
    env = {}
    P.claim_report(env, pid=10)
    assert OWNER not in env
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert P.report_path("acc.json", env, pid=11) == "acc.json"


@pytest.mark.parametrize("marker", ["", "x", "12", "12:a", ":0", "-1:"])
def test_a_malformed_owner_marker_is_ignored_and_replaced(marker):
    env = {OWNER: marker}
    assert P.report_path("frag.json", env, pid=5) == "frag.json"
    P.claim_report(env, pid=5)
    assert env[OWNER] == "5:"


# ------------------------------------------------------------------------------------ processes

needs_pth = pytest.mark.skipif(not site.ENABLE_USER_SITE, reason="user site-packages disabled")

CHILD = ("import os, torch, vmalloc; "
         "vmalloc.add_report_section('training', lambda: {'steps': 1000})")


@needs_pth
def test_a_subprocess_writes_its_own_report_not_its_drivers(tmp_path):
    """A driver that imported torch runs the training with subprocess.run: both wrote
    frag.json, and the driver, exiting last, replaced the training's report with its own."""
    out = tmp_path / "rep"
    out.mkdir()
    r = run(tmp_path, f"""
        import subprocess, sys
        import torch
        child = subprocess.run([sys.executable, "-c", {CHILD!r} + "; print(os.getpid())"],
                               check=True, capture_output=True, text=True)
        print(child.stdout.strip())
    """, VMALLOC_REPORT=str(out / "frag.json"))
    assert r.returncode == 0, r.stderr
    child = int(r.stdout.split()[-1])
    got = reports(out)
    assert set(got) == {"frag.json", f"frag.pid{child}.json"}, got.keys()
    assert "training" in got[f"frag.pid{child}.json"]
    assert "training" not in got["frag.json"] and got["frag.json"]["process"]["pid"] != child


@needs_pth
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_before_torch_is_imported_writes_its_own_report(tmp_path):
    out = tmp_path / "rep"
    out.mkdir()
    r = run(tmp_path, """
        import os
        pid = os.fork()          # both import torch after: each registers its exit report
        import torch
        if pid:
            os.waitpid(pid, 0)
            print(pid)
    """, VMALLOC_REPORT=str(out / "frag.json"))
    assert r.returncode == 0, r.stderr
    child = int(r.stdout.split()[-1])
    got = reports(out)
    assert set(got) == {"frag.json", f"frag.pid{child}.json"}, got.keys()
    assert got[f"frag.pid{child}.json"]["process"]["pid"] == child


@needs_pth
def test_a_driver_that_never_imports_torch_leaves_the_path_to_its_subprocess(tmp_path):
    """It writes no report (the report is arranged at `import torch`), so it claims no path:
    its training script wrote frag.pid<PID>.json and no frag.json existed at all."""
    out = tmp_path / "rep"
    out.mkdir()
    r = run(tmp_path, f"""
        import subprocess, sys
        subprocess.run([sys.executable, "-c", {CHILD!r}], check=True)
        assert "torch" not in sys.modules
    """, VMALLOC_REPORT=str(out / "frag.json"))
    assert r.returncode == 0, r.stderr
    got = reports(out)
    assert set(got) == {"frag.json"}, got.keys()
    assert "training" in got["frag.json"]


@needs_pth
def test_the_process_a_launcher_starts_writes_the_path_as_given(tmp_path):
    """`accelerate launch` (a launcher: it imports torch, writes no report, and its simple
    launcher sets no RANK) claimed the path at start-up, so the one training process wrote
    acc.pid<PID>.json instead of acc.json."""
    out = tmp_path / "rep"
    out.mkdir()
    launcher = tmp_path / "bin" / "accelerate"    # what is_launcher() knows it by: its argv
    launcher.parent.mkdir()
    launcher.write_text(textwrap.dedent(f"""
        import subprocess, sys
        import torch
        subprocess.run([sys.executable, "-c", {CHILD!r}], check=True)
    """))
    r = subprocess.run([sys.executable, str(launcher), "launch", "train.py"],
                       env=autoload_env(tmp_path, VMALLOC_REPORT=str(out / "acc.json")),
                       capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    got = reports(out)
    assert set(got) == {"acc.json"}, got.keys()
    assert "training" in got["acc.json"]


@needs_pth
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_by_a_process_that_never_imports_torch_names_its_report_by_pid(tmp_path):
    """The path is claimed at `import torch`; a child forked before it names the process it was
    forked from (which may import torch later: both would write the path), so it is pid-named
    even when that process never imports torch."""
    out = tmp_path / "rep"
    out.mkdir()
    r = run(tmp_path, """
        import os, sys
        pid = os.fork()
        if not pid:
            import torch
            sys.exit(0)
        os.waitpid(pid, 0)
        print(pid)
    """, VMALLOC_REPORT=str(out / "frag.json"))
    assert r.returncode == 0, r.stderr
    child = int(r.stdout.split()[-1])
    assert set(reports(out)) == {f"frag.pid{child}.json"}


@needs_pth
def test_a_rank_started_by_a_rankless_process_keeps_its_rank_name(tmp_path):
    """torchrun's launcher runs the autoload too (rank-less, no report): its ranks must not
    become pid-named because they descend from it; a subprocess of a rank must."""
    out = tmp_path / "rep"
    out.mkdir()
    rank = ("import subprocess, sys, torch; "
            f"subprocess.run([sys.executable, '-c', {CHILD!r}], check=True)")
    r = run(tmp_path, f"""
        import os, subprocess, sys
        subprocess.run([sys.executable, "-c", {rank!r}], check=True,
                       env=dict(os.environ, RANK="0", WORLD_SIZE="1"))
    """, VMALLOC_REPORT=str(out / "frag.json"))
    assert r.returncode == 0, r.stderr
    got = reports(out)
    helper = [n for n in got if n.startswith("frag.rank0.pid")]
    assert set(got) == {"frag.rank0.json", *helper} and len(helper) == 1, got.keys()
    assert "training" in got[helper[0]] and "training" not in got["frag.rank0.json"]


@needs_pth
def test_a_relative_report_path_is_written_where_it_was_checked_after_chdir(tmp_path):
    """VMALLOC_REPORT=frag.json was checked against the launch directory but written at exit
    relative to the directory of the moment (Hydra's per-run output directories)."""
    (tmp_path / "run1").mkdir()
    r = run(tmp_path, """
        import os, torch
        os.chdir("run1")
    """, VMALLOC_REPORT="frag.json")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "frag.json").exists() and not (tmp_path / "run1" / "frag.json").exists()


def test_replay_json_with_a_tilde_is_written_in_home(tmp_path, monkeypatch, capsys):
    """`vmalloc replay t.json --json '~/x.json'` checked the expanded path, replayed the whole
    trace, then failed to write the unexpanded one."""
    from vmalloc.cli import main
    from vmalloc.replay import Event, Trace
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    Trace([Event("alloc", 0, 4096), Event("free", 0, 4096)]).save(work / "t.json")
    assert main(["replay", "--no-bisect", "t.json", "--json", "~/x.json"]) == 0
    assert f"wrote {home / 'x.json'}" in capsys.readouterr().out
    assert "comparison" in json.loads((home / "x.json").read_text())
    assert not (work / "~").exists()
