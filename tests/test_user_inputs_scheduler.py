"""What a user of ``scheduler`` gets from the README's names and from bad inputs: every dotted
name the README uses works after a plain ``import scheduler``; eval mode is planned when
gradients are wanted; ``mimose=`` with ``scheduler.checkpoint``; Mimose's and the swap
runtime's arguments checked where they are given, naming the argument; errors that print exact
byte counts; ``parse_rate`` without ``where``."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import scheduler
from scheduler import Chain, InfeasibleError
from scheduler.planners import best, offload, periodic, pofo, rotor
from scheduler.planners.mimose import Mimose
from scheduler.units import format_bytes, parse_rate

from _subproc import ROOT, python_env

README = os.path.join(ROOT, "README.md")


def _run(code: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    # outside the checkout: ``python -c`` puts the working directory first on sys.path
    return subprocess.run([sys.executable, "-c", code, *args], env=python_env(),
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------- 1. the README's dotted names
def readme_dotted_names():
    """Every ``scheduler.x.y`` the README names (file paths and file names excluded)."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    names = set()
    for m in re.finditer(r"(?<![\w/.-])scheduler\.[A-Za-z_][A-Za-z_0-9.]*", text):
        name = m.group(0).rstrip(".")
        if text[m.end():m.end() + 1] == "/" or name.endswith((".py", ".json", ".md")):
            continue  # a path, not an attribute
        names.add(name)
    return sorted(names)


def test_the_readme_names_the_lazily_loaded_submodules():
    names = readme_dotted_names()
    for must in ("scheduler.runtime.distributed.shutdown", "scheduler.plan_cache.PlanCache",
                 "scheduler.runtime.swap.install_global", "scheduler.profile.measure_chain"):
        assert must in names


# each name is looked up in its own child of one interpreter that imported torch (for speed)
# and ``scheduler``, nothing more: a submodule that loads only because another name's import
# pulled it in cannot hide
_RESOLVE = r"""
import operator, os, sys
import torch  # noqa: F401 - loaded once for every child; none of scheduler's submodules is
import scheduler
assert "scheduler.runtime" not in sys.modules, sorted(sys.modules)
failed = 0
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            operator.attrgetter(name.partition(".")[2])(scheduler)
        except BaseException as e:
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
            os._exit(1)
        os._exit(0)
    failed += os.waitpid(pid, 0)[1] != 0
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="one forked child per name")
def test_every_readme_name_resolves_after_a_plain_import(tmp_path):
    r = _run(_RESOLVE, tmp_path, *readme_dotted_names())
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_torchrun_ending_works_after_a_plain_import(tmp_path):
    r = _run("import scheduler; scheduler.runtime.distributed.shutdown()", tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("module", [scheduler, scheduler.runtime, scheduler.planners,
                                    scheduler.profile])
def test_unknown_names_still_raise_attribute_error(module):
    assert not hasattr(module, "no_such_thing")
    with pytest.raises(AttributeError,
                       match=rf"^module '{re.escape(module.__name__)}' has no attribute "
                             r"'no_such_thing'$"):
        getattr(module, "no_such_thing")
    assert not hasattr(module, "__wrapped__")  # Python's probes are no submodules


def test_planners_reached_from_import_scheduler_stay_torch_free(tmp_path):
    code = ("import sys, scheduler\n"
            "scheduler.planners.offload_follow, scheduler.planners.swap_schedule\n"
            "scheduler.planners.rotor, scheduler.planners.mimose, scheduler.plan_cache.PlanCache\n"
            "scheduler.units.parse_rate, scheduler.simulate\n"
            "assert not hasattr(scheduler.planners, 'nope')\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = _run(code, tmp_path)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------ 2. eval mode with gradients
class Stack(nn.Module):
    def __init__(self, n: int = 8, d: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Dropout(0.1), nn.Tanh())
                                    for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _stats(model):
    return scheduler.runtime.checkpoint.checkpointed(model).stats()["layers"]


def test_eval_mode_with_gradients_is_planned_and_no_grad_runs_plainly():
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    model = Stack().eval()  # fine-tuning with dropout off: gradients wanted, so a plan runs
    ref = Stack().eval()
    ref.load_state_dict(model.state_dict())
    scheduler.checkpoint(model, budget="115KB", planner="rotor")
    for _ in range(2):
        model(x).sum().backward()
    ref(x).sum().backward()
    got = _stats(model)
    assert got["profiling_steps"] == 1 and got["plans_computed"] == 1
    assert got["last_recomputed_forwards"] > 0
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, 2 * q.grad)
    plain = Stack().eval()
    scheduler.checkpoint(plain, budget="115KB", planner="rotor")
    with torch.no_grad():  # no gradient wanted: the blocks run plainly, nothing planned
        plain(x)
    got = _stats(plain)
    assert got["profiling_steps"] == 0 and got["plans_computed"] == 0


# ------------------------------------------------------------ 3. mimose= with checkpoint
class TwoLists(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.dec = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for block in [*self.enc, *self.dec]:
            x = block(x)
        return x


def test_checkpoint_uses_the_given_mimose_on_one_block_list():
    model = Stack(4, 16)
    mimose = Mimose(4, samples=3)
    scheduler.checkpoint(model, budget="1GiB", planner="mimose", mimose=mimose)
    runner = scheduler.runtime.checkpoint.checkpointed(model).runners[0]
    assert runner.mimose is mimose
    for n in (2, 3, 4, 5):
        model(torch.randn(n, 16)).sum().backward()
    assert mimose.ready and len(mimose.estimator.sizes) == 3
    with pytest.raises(ValueError, match=r"mimose= must be .*Mimose for 4 blocks, got one for "
                                         r"3 blocks"):
        scheduler.checkpoint(Stack(4, 16), budget="1GiB", planner="mimose",
                             mimose=Mimose(3, samples=3))


def test_checkpoint_refuses_one_mimose_for_several_block_lists():
    with pytest.raises(ValueError, match=r"mimose= serves one block list, and this model has 2 "
                                         r"\(enc, dec\)"):
        scheduler.checkpoint(TwoLists(), budget="1GiB", planner="mimose", blocks=["enc", "dec"],
                             mimose=Mimose(3, samples=3))


# ---------------------------------------------------------------- 4. Mimose's arguments
@pytest.mark.parametrize("kwargs, match", [
    ({"verify": "no"}, r"verify must be True or False, got 'no'"),
    ({"verify": 1}, r"verify must be True or False, got 1"),
    ({"rounds": -1}, r"rounds must be an int >= 0, got -1"),
    ({"rounds": 2.5}, r"rounds must be an int >= 0, got 2.5"),
    ({"n_blocks": 0}, r"n_blocks must be an int >= 1, got 0"),
    ({"n_blocks": True}, r"n_blocks must be an int >= 1, got True"),
    ({"samples": 2}, r"samples must be an int >= 3 .* got 2"),
    ({"samples": True}, r"samples must be an int >= 3 .* got True"),
    ({"bucket_ratio": "0.1"}, r"bucket_ratio must be in \[0, 1\), got '0.1'"),
    ({"bucket_ratio": math.nan}, r"bucket_ratio must be in \[0, 1\), got nan"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_mimose_checks_its_arguments(kwargs, match):
    args = dict({"n_blocks": 3}, **kwargs)
    with pytest.raises(ValueError, match=r"^Mimose: " + match):
        Mimose(**args)


def _ready_mimose(scale: int = 1) -> Mimose:
    m = Mimose(2, samples=3)
    for size in (10, 20, 30):
        b = size * scale
        m.observe(size, b * 4, [b * 8, b * 8], [b * 4, b * 4], [1.0, 1.0])
    return m


@pytest.mark.parametrize("size", [-5, 0, math.nan, math.inf, True, "10"])
def test_estimate_activation_bytes_checks_the_size_as_plan_does(size):
    m = _ready_mimose()
    for call in (m.estimate_activation_bytes, lambda s: m.plan(s, "1MiB")):
        with pytest.raises(ValueError, match=r"input_size must be a positive number, got "):
            call(size)
    assert m.estimate_activation_bytes(20) > 0


# ------------------------------------------------------------- 5. swap's window and budget
def test_mimose_rounds_0_goes_straight_to_the_floor():
    from scheduler.planners.mimose import Mimose
    assert Mimose(3, rounds=0).rounds == 0


@pytest.mark.parametrize("window", [0, "0", "0B"])
def test_a_zero_window_is_no_look_ahead(window):
    assert scheduler.swap(window=window, device="cpu").window == 0


@pytest.mark.parametrize("window", [-1, "-1MiB", "2 gigs"])
def test_swap_refuses_a_bad_window_at_the_call(window):
    with pytest.raises(ValueError, match=r"^scheduler\.swap: window"):
        scheduler.swap(window=window, device="cpu")


@pytest.mark.parametrize("budget", [0, "0", "0MiB"])
def test_swap_refuses_a_zero_budget_at_the_call(budget):
    with pytest.raises(ValueError, match=r"^scheduler\.swap: budget must be a positive byte "
                                         r"size .* or None for no limit, got "
                                         rf"{re.escape(repr(budget))}$"):
        scheduler.swap(budget=budget, device="cpu")
    assert scheduler.swap(budget=None, device="cpu").budget is None


def test_install_global_refuses_them_too():
    from scheduler.runtime.swap import global_context, install_global
    with pytest.raises(ValueError, match=r"install_global: window"):
        install_global(-1)
    with pytest.raises(ValueError, match=r"install_global: budget must be a positive"):
        install_global("1MiB", 0)
    assert global_context() is None


# --------------------------------------------------------------------- 6. swap's device
@pytest.mark.parametrize("device, error", [
    ("gpu", ValueError), (torch.cuda.device_count() + 5, ValueError), (-1, ValueError),
    ("meta", ValueError), (1.5, TypeError), (True, TypeError),
], ids=repr)
def test_swap_names_a_bad_device(device, error):
    with pytest.raises(error, match=r"^scheduler\.swap: device"):
        scheduler.swap(device=device)


def test_swap_takes_the_documented_device_forms():
    assert scheduler.swap(device="cpu").device == torch.device("cpu")
    assert scheduler.swap(device=torch.device("cpu")).device == torch.device("cpu")


# ------------------------------------------------------------- 7. exact bytes in errors
BIG = Chain.random(6, seed=3, max_size=4 << 20)


def _infeasible(call) -> str:
    with pytest.raises(InfeasibleError) as e:
        call()
    text = str(e.value)
    assert not re.search(r"\d\.?\d*e[+-]\d", text), text  # no %g exponent
    return text


def test_format_bytes_is_exact_and_readable():
    assert format_bytes(3145728) == "3145728 B (3.00 MiB)"
    assert format_bytes(3692170.5) == "3692170.5 B (3.52 MiB)"
    assert format_bytes(43) == "43 B"
    assert format_bytes(2 ** 70) == f"{2 ** 70} B (1073741824.00 TiB)"


def test_planner_errors_print_exact_bytes():
    need = rotor.min_memory(BIG, slots=500, memory=3 << 20)
    assert need > 3 << 20
    text = _infeasible(lambda: rotor.solve(BIG, 3 << 20))
    assert "memory=3145728 B (3.00 MiB) with 500 slots" in text
    assert f"the smallest memory that works is {format_bytes(need)}" in text
    assert "memory 3145728 B (3.00 MiB)" in _infeasible(lambda: pofo.solve(BIG, 3 << 20, 1e9))
    assert "memory 3145728 B (3.00 MiB)" in _infeasible(lambda: periodic.best(BIG, 3 << 20))
    assert "memory 3145728 B (3.00 MiB)" in _infeasible(lambda: offload.greedy(BIG, 3 << 20,
                                                                               1e9))
    assert "memory 3145728 B (3.00 MiB)" in _infeasible(lambda: best.solve(BIG, 3 << 20))


def test_mimose_infeasible_prints_exact_bytes():
    m = _ready_mimose(scale=100000)
    text = _infeasible(lambda: m.plan(20, "1MiB"))
    assert re.search(r"Mimose: budget 1048576 B \(1\.00 MiB\) is below the estimated peak with "
                     r"every block checkpointed \(\d+ B \([\d.]+ MiB\)\) for input size 20$",
                     text), text


# ------------------------------------------------------------------ 8. parse_rate's where
def test_parse_rate_needs_only_the_value():
    assert parse_rate("12GB/s") == 12e9
    assert parse_rate(None) is None
    with pytest.raises(ValueError, match=r"^parse_rate: bandwidth must be positive bytes/s"):
        parse_rate("fast")
