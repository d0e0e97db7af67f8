"""The README's main job without a GPU: plan a bundled chain with every planner, simulate each
plan, replay the fastest plan's allocation trace, then the bundled traces."""
import pytest
from scheduler import demo, simulate
from vmalloc.cli import main


def test_plan_all_simulates_every_planner_within_the_limit():
    chain = demo.find_chain("resnet50-i224-b8")
    assert chain.name == "resnet50-i224-b8"
    memory, rows = demo.plan_all(chain, fraction=0.5)
    assert [r.planner for r in rows][0].startswith("store all")
    for r in rows:
        if r.plan is None:
            assert r.note.startswith("infeasible")
            continue
        limit = None if r.planner.startswith("store all") else memory
        if limit is not None:
            assert r.result.peak_memory <= memory
        again = simulate(chain, r.plan, bandwidth=demo.BANDWIDTH, memory=limit)
        assert r.plan.predicted_time == again.makespan, r.planner
    best = demo.fastest_fitting(memory, rows)
    assert best is not None and best.planner != rows[0].planner
    text = demo.table(chain, memory, rows)
    assert "rotor" in text and "pofo" in text


def test_an_unknown_chain_is_named_with_the_list_of_bundled_ones():
    # issue 16 item 9: it silently planned a random chain
    with pytest.raises(ValueError, match=r"chain 'no-such-chain': no such bundled chain; "
                                         r"available: .*resnet101-i1000-b2"):
        demo.find_chain("no-such-chain")


def test_without_bundled_chains_the_default_falls_back_to_a_random_chain(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "bundled_chains", lambda: [])
    monkeypatch.setattr(demo, "__file__", str(tmp_path / "scheduler" / "demo.py"))
    monkeypatch.chdir(tmp_path)
    assert demo.find_chain().name.startswith("random-40")
    with pytest.raises(ValueError, match="available: none"):
        demo.find_chain("nosuch")


def test_cli_demo_plans_and_replays(tmp_path, capsys):
    from vmalloc.replay.trace import Event, Trace
    Trace([Event("alloc", 0, 3 << 20), Event("free", 0, 3 << 20)], {"name": "tiny"}).save(
        tmp_path / "tiny.json")   # one small trace for step 3
    assert main(["demo", "--no-bisect", "--chain", "gpt2-s256-b1", "--fraction", "0.85",
                 "--traces", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[1/3] planning gpt2-s256-b1" in out and "[2/3] replaying" in out
    assert "[3/3] replaying the 1 bundled" in out and "trace tiny" in out


def test_the_cli_default_chain_is_the_demos():
    """``vmalloc demo --chain``'s default (vmalloc.cli.DEFAULT_CHAIN, spelled there so that every
    command does not load the scheduler) is the chain scheduler.demo falls back from."""
    from vmalloc import cli
    assert cli.DEFAULT_CHAIN == demo.DEFAULT_CHAIN
    args = cli._parser().parse_args(["demo"])
    assert args.chain == demo.DEFAULT_CHAIN


def test_vmalloc_demo_looks_for_bundled_files_where_scheduler_demo_does(tmp_path, monkeypatch):
    """One search for the bundled files (scheduler.demo.bundle_roots): the working directory,
    then the checkout."""
    from vmalloc import cli_demo
    monkeypatch.chdir(tmp_path)
    roots = demo.bundle_roots()
    assert roots[0] == tmp_path.resolve() and (roots[-1] / "scheduler" / "demo.py").is_file()
    assert cli_demo._bundle_roots() == roots
