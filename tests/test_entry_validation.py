"""Public entry points check their arguments at the call: a bad input raises ValueError or
TypeError naming the argument (and the value), nothing is silently ignored, and nothing fails
later, deep inside a training step, without saying which option was wrong."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import scheduler
from scheduler import Chain, Plan
from scheduler.plan_cache import PlanCache
from scheduler.planners import best, offload, pofo
from scheduler.planners.mimose import Mimose
from scheduler.runtime.input_aware import InputAwareChain
from scheduler.runtime.options import parse_rate as runtime_parse_rate
from scheduler.units import parse_rate

from wrap_models import mlp_blocks, one_thread  # noqa: F401  (autouse fixture)

D = 16
FAST = {"repeat": 1, "warmup": 0}


class Net(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.ReLU())
                                     for _ in range(n)])

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x.sum()


# ------------------------------------------------------------------------ checkpoint: blocks
@pytest.mark.parametrize("blocks, error, match", [
    (5, TypeError, "blocks must be .* got 5"),
    ([], ValueError, "blocks must name at least one block list, got \\[\\]"),
    (["layers", "layers"], ValueError, "'layers' and 'layers', which overlap"),
    (["layers", "layers.0"], ValueError, "'layers' and 'layers.0', which overlap"),
])
def test_checkpoint_blocks_checked_at_the_call(blocks, error, match):
    with pytest.raises(error, match=match):
        scheduler.checkpoint(Net(), "1GiB", blocks=blocks)


def test_checkpoint_blocks_overlapping_lists_refused():
    class Nested(nn.Module):  # a list inside another list's block
        def __init__(self):
            super().__init__()
            self.outer = nn.ModuleList([nn.Module(), nn.Module()])
            for m in self.outer:
                m.inner = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])

    with pytest.raises(ValueError, match="overlap"):
        scheduler.checkpoint(Nested(), "1GiB", blocks=["outer", "outer.0.inner"])


# ------------------------------------------------------------------ checkpoint/wrap: options
@pytest.mark.parametrize("entry", ["checkpoint", "wrap"])
@pytest.mark.parametrize("option, value, error, match", [
    ("loss", "foo", ValueError, "loss must be one of .*got 'foo'"),
    ("measure_options", {"bogus": 1}, ValueError, "measure_options key 'bogus'"),
    ("measure_options", {"loss": "sum"}, ValueError, "measure_options key 'loss'"),
    ("measure_options", [("repeat", 1)], TypeError, "measure_options must be a dict"),
    ("track_memory", "no", TypeError, "track_memory must be True or False, got 'no'"),
    ("cache_size", 0, ValueError, "scheduler\\.\\w+: cache_size must be a positive int, got 0"),
    ("input_size", 5, TypeError, "input_size must be a callable"),
])
def test_options_checked_at_the_call(entry, option, value, error, match):
    planner = "mimose" if option == "input_size" else "rotor"
    with pytest.raises(error, match=match):
        if entry == "checkpoint":
            scheduler.checkpoint(Net(), "1GiB", planner, **{option: value})
        else:
            scheduler.wrap(mlp_blocks(3, D), "1GiB", planner, **{option: value})


def test_measure_options_known_keys_still_work():
    model = scheduler.wrap(mlp_blocks(3, D), "1GiB", measure_options=FAST,
                           sample_input=torch.randn(4, D))
    assert model.cache.misses == 1


def test_wrap_track_memory_setter_takes_bools_only():
    model = scheduler.wrap(mlp_blocks(3, D), "1GiB")
    model.track_memory = True
    with pytest.raises(TypeError, match="track_memory must be True or False"):
        model.track_memory = "no"
    assert model.track_memory is True


def test_wrap_blocks_not_a_list():
    with pytest.raises(TypeError, match="scheduler.wrap: blocks must be .* got 5"):
        scheduler.wrap(5, "1GiB")


def test_input_aware_chain_checks_its_options():
    with pytest.raises(TypeError, match="InputAwareChain: input_size must be a callable"):
        InputAwareChain(mlp_blocks(3, D), input_size=5)
    with pytest.raises(ValueError, match="InputAwareChain: measure_options key 'bogus'"):
        InputAwareChain(mlp_blocks(3, D), measure_options={"bogus": 1})
    with pytest.raises(ValueError, match="InputAwareChain: loss must be"):
        InputAwareChain(mlp_blocks(3, D), loss="foo")


# ----------------------------------------------------------- options the planner never reads
@pytest.mark.parametrize("planner, option, value", [
    ("rotor", "samples", 3),
    ("pofo", "input_size", len),
    ("periodic", "mimose", Mimose(3, samples=3)),
    ("mimose", "chain", Chain.random(3, seed=0)),
    ("mimose", "measure_options", FAST),
    ("mimose", "on_chain", lambda c: c),
])
@pytest.mark.parametrize("entry", ["checkpoint", "wrap"])
def test_an_option_the_planner_ignores_raises(entry, planner, option, value):
    with pytest.raises(ValueError, match=f"{option}=.* has no effect with planner='{planner}'"):
        if entry == "checkpoint":
            scheduler.checkpoint(Net(), "1GiB", planner, **{option: value})
        else:
            scheduler.wrap(mlp_blocks(3, D), "1GiB", planner, **{option: value})


def test_options_of_a_plan_planner_raise():
    plan = scheduler.planners.mimose.plan_from_checkpoints(3, [0])
    with pytest.raises(ValueError, match="chain=.* has no effect with a Plan as planner"):
        scheduler.wrap(mlp_blocks(3, D), "1GiB", plan, chain=Chain.random(3, seed=0))


def test_samples_with_a_given_mimose_raises():
    with pytest.raises(ValueError, match="samples=5 has no effect .*mimose= has its own"):
        scheduler.wrap(mlp_blocks(3, D), "1GiB", "mimose", mimose=Mimose(3, samples=3),
                       samples=5)


@pytest.mark.parametrize("entry", ["checkpoint", "wrap"])
def test_bandwidth_without_pofo_raises(entry):
    with pytest.raises(ValueError, match="bandwidth=1000000000.0 has no effect with "
                                         "planner='rotor'.*pofo"):
        if entry == "checkpoint":
            scheduler.checkpoint(Net(), "1GiB", "rotor", bandwidth=1e9)
        else:
            scheduler.wrap(mlp_blocks(3, D), "1GiB", "rotor", bandwidth=1e9)
    with pytest.raises(ValueError, match="bandwidth=1000000000.0 has no effect with a callable planner"):
        scheduler.wrap(mlp_blocks(3, D), None, lambda c, b: None, bandwidth=1e9)
    with pytest.raises(ValueError, match="bandwidth=1000000000.0 has no effect with a Plan"):
        scheduler.wrap(mlp_blocks(3, D), None, Plan([("F_all", 0), ("F_all", 1), ("F_all", 2),
                                                     ("F_all", 3), ("B", 3), ("B", 2), ("B", 1),
                                                     ("B", 0)]), bandwidth=1e9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read: no warning
        scheduler.wrap(mlp_blocks(3, D), "1GiB", "pofo", bandwidth=1e9)
        scheduler.wrap(mlp_blocks(3, D), "1GiB", "mimose", samples=3)


@pytest.mark.parametrize("entry", ["checkpoint", "wrap"])
def test_loss_with_mimose_raises(entry):
    with pytest.raises(ValueError, match="loss='mse' has no effect with planner='mimose'"):
        if entry == "checkpoint":
            scheduler.checkpoint(Net(), "1GiB", "mimose", loss="mse")
        else:
            scheduler.wrap(mlp_blocks(3, D), "1GiB", "mimose", loss="mse")


def test_sample_input_with_mimose_raises():
    with pytest.raises(ValueError, match="sample_input=.* has no effect with planner='mimose'"):
        scheduler.wrap(mlp_blocks(3, D), "1GiB", "mimose", sample_input=torch.randn(4, D))


# ------------------------------------------------------------------- checkpoint's budget
def test_checkpoint_budget_is_required():
    with pytest.raises(TypeError, match="budget"):
        scheduler.checkpoint(Net())  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="budget"):
        scheduler.checkpoint(Net(), planner="rotor")  # type: ignore[call-arg]
    model = scheduler.checkpoint(Net(), None)  # None, given: no limit
    assert scheduler.runtime.checkpoint.checkpointed(model).runners[0].budget is None


# ------------------------------------------------------------------------------ swap
@pytest.mark.parametrize("planner, options, match", [
    ("lms", {"swapin_ahed": 3}, "key 'swapin_ahed' is not an option of planner='lms'"),
    ("window", {"bandwidth": 1e9}, "key 'bandwidth' is not an option of planner='window'"),
    ("greedy", {"slots": 100}, "key 'slots' is not an option of planner='greedy'"),
    (lambda seq: None, {"swapin_ahead": 2}, "not an option of a callable planner"),
    ("lms", {"swapin_ahead": 2.7}, "planner_options\\['swapin_ahead'\\] must be a positive "
                                   "int \\(steps\\), got 2.7"),
    ("lms", {"swapout_threshold": True}, "planner_options\\['swapout_threshold'\\]"),
    ("dynprog", {"slots": 0}, "planner_options\\['slots'\\] must be a positive int or None"),
    ("dynprog", {"bandwidth": "fast"}, "planner_options\\['bandwidth'\\] must be positive "
                                       "bytes/s .*got 'fast'"),
    ("greedy", {"bandwidth": -1}, "planner_options\\['bandwidth'\\]"),
])
def test_swap_planner_options_checked_at_construction(planner, options, match):
    with pytest.raises(ValueError, match="scheduler.swap: .*" + match):
        scheduler.swap(budget="1MiB", planner=planner, device="cpu", planner_options=options)


def test_swap_planner_options_not_a_dict():
    with pytest.raises(TypeError, match="planner_options must be a dict"):
        scheduler.swap(planner="lms", device="cpu", planner_options=[("swapin_ahead", 1)])


@pytest.mark.parametrize("bw", ["12GB/s", "12GB", "12 GB/s", 12e9, 12_000_000_000])
def test_swap_bandwidth_strings_are_rates(bw):
    ctx = scheduler.swap(budget="1MiB", planner="dynprog", device="cpu",
                         planner_options={"bandwidth": bw, "slots": 50})
    assert ctx.planner_options["bandwidth"] == 12e9


def test_swap_allocator_and_cache_size_checked_at_construction():
    with pytest.raises(TypeError, match="scheduler.swap: allocator must have a "
                                        "set_pressure_callback"):
        scheduler.swap(device="cpu", allocator=object())
    with pytest.raises(ValueError, match="scheduler.swap: cache_size must be a positive int, "
                                         "got 0"):
        scheduler.swap(device="cpu", cache_size=0)


# ------------------------------------------------------------------- one bandwidth parser
@pytest.mark.parametrize("bw", ["12GB/s", "12GB", " 12 GB/s ", 12e9, 12_000_000_000, "12e9",
                                " 1.2e10/s", "12000000000"])
def test_every_entry_reads_bandwidth_alike(bw):
    assert parse_rate(bw, "x") == runtime_parse_rate(bw, "x") == 12e9
    assert offload.bandwidth_arg(bw, allow_zero=True) == 12e9
    c = Chain.random(3, seed=1)
    M = offload.peak_memory(c)
    for solve in (offload.greedy, offload.dynprog, pofo.solve):
        assert solve(c, M, bw).planner  # a plan, no error
    assert best.solve(c, M, bw).planner


@pytest.mark.parametrize("bw", ["fast", -1, float("nan"), True, "12GB/h", [1], "-12e9", "nan",
                                "1e400"])
def test_every_entry_refuses_bad_bandwidth_alike(bw):
    c = Chain.random(3, seed=1)
    for call in (lambda: offload.greedy(c, 100, bw), lambda: pofo.solve(c, 100, bw),
                 lambda: best.solve(c, 100, bw), lambda: runtime_parse_rate(bw, "x")):
        with pytest.raises(ValueError, match="bandwidth must be .*bytes/s"):
            call()


def test_bandwidth_zero_is_the_planners_no_channel_only():
    assert parse_rate(0, "x", allow_zero=True) == 0.0
    with pytest.raises(ValueError, match="wrap: bandwidth must be positive"):
        scheduler.wrap(mlp_blocks(3, D), "1GiB", "pofo", bandwidth="0GB/s")


def test_planners_stay_torch_free():
    import subprocess
    import sys
    # (the planners' warnings point at the user's line: vmalloc.user_warning, torch-free;
    # dir(scheduler) lists the runtimes' entry points without loading them)
    code = ("import sys; import scheduler.units, scheduler.planners.offload, "
            "scheduler.planners.pofo, scheduler.planners.best, scheduler.planners.mimose, "
            "scheduler.planners.window, vmalloc.user_warning; "
            "assert {'checkpoint', 'wrap', 'swap'} <= set(dir(scheduler)); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    from _subproc import python_env
    r = subprocess.run([sys.executable, "-c", code], env=python_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------- smaller ones
def _ready_mimose() -> Mimose:
    m = Mimose(4, samples=3)
    for s in (10, 20, 30):
        m.observe(s, s * 4, [s * 10] * 4, [s * 4] * 4, [1e-3 * s] * 4)
    return m


@pytest.mark.parametrize("size", [-5, 0, float("nan"), float("inf"), "25", True])
def test_mimose_plan_refuses_a_bad_input_size(size):
    with pytest.raises(ValueError, match="Mimose.plan: input_size must be a positive number"):
        _ready_mimose().plan(size, 900)


@pytest.mark.parametrize("budget", [-1, 0, float("nan"), "abc", True])
def test_mimose_plan_refuses_a_bad_budget(budget):
    with pytest.raises(ValueError, match="Mimose.plan: budget"):
        _ready_mimose().plan(25, budget)


def test_mimose_plan_reads_a_size_string():
    m = _ready_mimose()
    assert m.plan(25, "1KiB").meta["checkpointed"] == m.plan(25, 1024).meta["checkpointed"]
    assert m.cache.hits == 1  # one key for both


def test_cache_size_errors_name_the_entry():
    with pytest.raises(ValueError, match="Mimose: cache_size must be a positive int, got 0"):
        Mimose(3, cache_size=0)
    with pytest.raises(ValueError, match="PlanCache: capacity must be a positive int, got True"):
        PlanCache(True)  # type: ignore[arg-type]


def test_swap_planner_options_take_numpy_ints():
    import numpy as np
    ctx = scheduler.swap(planner="dynprog", budget="1MiB", device="cpu",
                         planner_options={"slots": np.int64(50)})
    assert ctx.planner_options["slots"] == 50 and type(ctx.planner_options["slots"]) is int
