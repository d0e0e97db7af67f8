"""scheduler.checkpoint counts the model's outputs its caller drops before the backward (the
logits of ``model(**batch).loss``) as memory of the tail's forward only, and those it keeps
(``out = model(**batch); out.loss.backward()``) through the backward, as seen at the
profiling step's backward (scheduler/runtime/tail_outputs.py): plans within the measured peak
either way, gradients bit-identical, a re-plan only where the step contradicts the assumption."""
from __future__ import annotations

import copy
import sys
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch import nn

import scheduler
from scheduler.planners import rotor
from scheduler.runtime.checkpoint import checkpointed
from scheduler.runtime.tail_outputs import counted
from scheduler.units import format_bytes

from _subproc import ROOT, python_env
from test_checkpoint_hf import FAST, assert_same, make, step
from test_tail import clean, stacks_left_clean  # noqa: F401  (fixture)
from wrap_models import one_thread  # noqa: F401  (autouse fixture)


def keep_step(model: nn.Module, batch: Dict[str, Any], seed: int) -> torch.Tensor:
    """A step that holds the model's output (logits and all) through its backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach()


def cpu_peak(run: Callable[[], Any]) -> int:
    sys.path.insert(0, f"{ROOT}/bench")
    try:
        from hf import cpu_peak as peak
    finally:
        sys.path.remove(f"{ROOT}/bench")
    return peak(run)


def peak_of(model: nn.Module, batch: Dict[str, Any], how: Callable[..., torch.Tensor]) -> int:
    """The allocator's peak over a step (the CPU's from the profiler's events; CUDA's
    max_memory_allocated), gradients allocated before (as the planner counts them: outside
    the chain); for ``keep_step``, with the last step's output alive through the forward, as
    ``out = model(**batch)`` keeps it until it is bound again."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(7)
    state: Dict[str, Any] = {}
    if how is keep_step:
        state["out"] = model(**batch)
        state["out"].loss.backward()

    def run() -> None:
        if how is keep_step:
            state["out"] = model(**batch)
            state["out"].loss.backward()
        else:
            model(**batch).loss.backward()
    if not next(model.parameters()).is_cuda:
        return cpu_peak(run)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


WIDE = 1024   # a vocabulary whose logits set the least memory a plan needs (VOCAB's do not)


def build(name: str) -> Tuple[nn.Module, Dict[str, Any]]:
    """``make(name)``, or ``gpt2-wide``: GPT-2 with a wide vocabulary, as real ones are."""
    if name != "gpt2-wide":
        return make(name)
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=WIDE,
                                  n_positions=32, bos_token_id=0, eos_token_id=0, use_cache=False)
    ids = torch.randint(0, WIDE, (2, 12))
    return transformers.GPT2LMHeadModel(cfg).train(), {"input_ids": ids, "labels": ids}


def logits_bytes(model: nn.Module, batch: Dict[str, Any]) -> int:
    b, s = batch["input_ids"].shape
    return b * s * model.config.vocab_size * 4


def runner_of(model: nn.Module) -> Any:
    (r,) = checkpointed(model).runners
    return r


def plain(name: str, budget: Any = 1 << 40, device: str = "cpu", **options: Any
          ) -> Tuple[nn.Module, nn.Module, Dict[str, Any]]:
    ref, batch = build(name)
    ref.to(device)
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, budget, "rotor", measure_options=FAST, **options)
    return ref, model, {k: v.to(device) for k, v in batch.items()}


def counted_kept(name: str, device: str = "cpu") -> Any:
    """The chain with the outputs counted through the backward (``on_chain=`` turns the
    adaptation off)."""
    chains: List[Any] = []
    _, model, batch = plain(name, device=device, on_chain=lambda c: chains.append(c) or c)
    step(model, batch, 0)
    return chains[0]


def budgets(name: str, device: str = "cpu") -> Tuple[int, int]:
    """The least memory of a plan with the logits held by the caller, and dropped."""
    kept = counted_kept(name, device)
    model, batch = build(name)
    n = logits_bytes(model, batch)
    return rotor.min_memory(counted(kept, 0, n)), rotor.min_memory(counted(kept, n, 0))


# ------------------------------------------------------------------------------ dropped
@pytest.mark.parametrize("name", ["gpt2-wide", "llama"])
def test_dropped_logits_leave_the_backward(name):
    ref, model, batch = plain(name)
    for seed in range(3):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), name)
    r = runner_of(model)
    c, kept, L = r.last_plan.chain, counted_kept(name), r.L
    logits = logits_bytes(model, batch)
    assert c.meta["tail"]["outputs"] == {"dropped": logits, "held": 0}
    assert c.xbar[L] == kept.xbar[L] - logits and c.fw_tmp[L] == kept.fw_tmp[L] + logits
    assert c.fck_tmp[L] == kept.fck_tmp[L] + logits and c.bw_tmp == kept.bw_tmp
    # the first step assumed it (the plan is used from the next step on) and its backward
    # said so: one plan, no second
    assert r.profiling_steps == 1 and r.stats()["plans_computed"] == 1
    assert checkpointed(model).tail.dropped == {1}   # (loss, logits): the logits


@pytest.mark.parametrize("how", [step, keep_step])
def test_the_least_budget_holds_whatever_the_caller_keeps(how):
    """At the least budget of the caller's loop (the logits dropped, or held through the
    backward and the next forward), bit-identical, and the allocator's real peak stays
    within the plan's prediction (it did not with the logits held, counted through the
    tail's backward only: 1.08x)."""
    lo_held, lo_dropped = budgets("gpt2-wide")
    assert lo_dropped < lo_held
    budget = lo_dropped if how is step else lo_held
    ref, model, batch = plain("gpt2-wide", budget)
    for seed in range(3):
        assert_same(ref, model, how(ref, batch, seed), how(model, batch, seed), "gpt2")
    r = runner_of(model)
    assert r.last_plan.predicted_peak <= budget
    assert peak_of(model, batch, how) <= r.last_plan.predicted_peak


# ------------------------------------------------------------------------------ kept
def test_kept_logits_are_planned_again_with_them():
    """The caller holds the output through its backward: the first step's plan (which
    assumed it dropped) is made again at the next step, on the chain that counts it, and a
    budget only the dropped logits made room for is refused there, in the forward."""
    name = "gpt2-wide"
    kept = counted_kept(name)
    ref, model, batch = plain(name)
    for seed in range(3):
        assert_same(ref, model, keep_step(ref, batch, seed), keep_step(model, batch, seed), name)
    r = runner_of(model)
    c, logits = r.last_plan.chain, logits_bytes(model, batch)
    assert c.meta["tail"]["outputs"] == {"dropped": 0, "held": logits}
    assert list(c.bw_tmp) == [v + logits for v in kept.bw_tmp]   # beside every op
    assert list(c.fw_tmp[:-1]) == [v + logits for v in kept.fw_tmp[:-1]]
    assert c.xbar[c.L] == kept.xbar[c.L] - logits
    assert r.profiling_steps == 1 and r.stats()["plans_computed"] == 2
    assert checkpointed(model).tail.dropped == set()
    assert peak_of(model, batch, keep_step) <= r.last_plan.predicted_peak

    lo_kept, lo_dropped = budgets(name)
    ref, model, batch = plain(name, (lo_dropped + lo_kept) // 2)
    keep_step(model, batch, 0)   # profiling: planned as if dropped, seen kept
    with pytest.raises(scheduler.InfeasibleError):
        keep_step(model, batch, 1)
    assert clean()


def test_a_new_shape_is_planned_on_what_the_last_backward_saw():
    """A shape's plan follows what its profiling step's caller did, and only ever moves to
    held after it (the next test); a new shape guesses what the last one saw and is corrected
    at its next step if wrong."""
    ref, model, batch = plain("gpt2")
    short = {k: v[:, :8] for k, v in batch.items()}
    for b in (batch, short):   # held at the first shape: the second guesses held, no re-plan
        for seed in range(2):
            assert_same(ref, model, keep_step(ref, b, seed), keep_step(model, b, seed), "gpt2")
    r = runner_of(model)
    assert r.profiling_steps == 2 and r.stats()["plans_computed"] == 3   # 1 re-plan, not 2
    assert r.last_plan.chain.meta["tail"]["outputs"]["dropped"] == 0
    for seed in range(2):   # the loop drops them now: that shape's plan stays (held: safe)
        assert_same(ref, model, step(ref, short, seed), step(model, short, seed), "gpt2")
    assert r.stats()["plans_computed"] == 3
    third = {k: v[:, :6] for k, v in batch.items()}
    for seed in range(2):   # a new shape: guessed held, seen dropped, planned again
        assert_same(ref, model, step(ref, third, seed), step(model, third, seed), "gpt2")
    assert r.stats()["plans_computed"] == 5
    assert r.last_plan.chain.meta["tail"]["outputs"] == {"dropped": logits_bytes(model, third),
                                                         "held": 0}


def test_a_later_step_that_keeps_the_outputs_is_planned_again_with_them():
    """Every later step is watched too: a logging step that keeps the outputs the plan
    counted dropped (planned at the least budget with them dropped: that step could pass it
    by the logits) is said at the next step, planned again held, and stays so when the loop
    drops them again. At a budget only dropped logits make room for, the plan stays as it
    was, unwatched from then on, and a warning says how far such a step can pass it."""
    import warnings
    lo_held, lo_dropped = budgets("gpt2-wide")
    ref, model, batch = plain("gpt2-wide", lo_held)
    for seed in range(3):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
    r, logits = runner_of(model), logits_bytes(model, batch)
    assert r.stats()["plans_computed"] == 1
    assert r.last_plan.chain.meta["tail"]["outputs"] == {"dropped": logits, "held": 0}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert_same(ref, model, keep_step(ref, batch, 3), keep_step(model, batch, 3), "gpt2")
        assert not said and r.stats()["plans_computed"] == 1   # (said at the next step)
        for seed in range(4, 8):
            assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
    assert [str(w.message) for w in said if "counted as dropped" in str(w.message)] == [
        f"{r.name}: a step held {format_bytes(logits)} of the model's outputs into its backward "
        "that its plan counted as dropped before it (as the earlier steps of this input shape "
        "did): that step's peak could pass the budget by as much; planned with them held from "
        "this step on. A loop that keeps the outputs on some steps (logging) can say "
        "outputs='held' to plan so from the start"]
    # planned again once, held, and not back: the loop's drops since change nothing
    assert r.stats()["plans_computed"] == 2 and r.profiling_steps == 1
    assert r.last_plan.chain.meta["tail"]["outputs"] == {"dropped": 0, "held": logits}
    assert r.last_plan.predicted_peak <= lo_held
    assert peak_of(model, batch, keep_step) <= r.last_plan.predicted_peak

    ref, model, batch = plain("gpt2-wide", (lo_dropped + lo_held) // 2)
    for seed in range(2):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
    r = runner_of(model)
    assert_same(ref, model, keep_step(ref, batch, 2), keep_step(model, batch, 2), "gpt2")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for seed in range(3, 5):
            assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
        keep_step(model, batch, 5)   # (no longer watched: said once)
        step(model, batch, 6)
    (overshoot,) = [str(w.message) for w in said if "no plan fits" in str(w.message)]
    assert overshoot.startswith(
        f"{r.name}: a step held {format_bytes(logits)} of the model's outputs into its "
        "backward that its plan counted as dropped before it, and with them held no plan fits "
        "the budget (the least is ")
    assert overshoot.endswith(
        f"): the plan that counts them dropped stays, and a step that holds them can pass the "
        f"budget by up to {format_bytes(logits)}. Drop them before the backward on such steps "
        "(loss = model(**batch).loss), or give that budget")
    assert not [w for w in said if "planned with them held" in str(w.message)]
    assert r.last_plan.chain.meta["tail"]["outputs"] == {"dropped": logits, "held": 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_later_steps_are_watched_where_the_tail_frees_the_last_blocks_output(dtype):
    """A bf16 Llama's final RMSNorm casts to float32 and saves nothing of its input, so the
    tail frees the last block's output before the model returns: the later step's hook is
    made while it lives (the watch never ran there)."""
    model, batch = make("llama")
    model.to(dtype)
    scheduler.checkpoint(model, 1 << 40, "rotor", measure_options=FAST)
    for seed in range(3):
        step(model, batch, seed)
    r = runner_of(model)
    assert r.last_plan.chain.meta["tail"]["outputs"]["held"] == 0
    keep_step(model, batch, 3)   # (planned again, unsaid: that step kept within the budget)
    step(model, batch, 4)
    assert r.last_plan.chain.meta["tail"]["outputs"]["dropped"] == 0
    assert r.stats()["plans_computed"] == 2


def test_a_later_step_of_another_output_structure_is_not_taken_for_held():
    """A step without labels returns no loss: the logits move to position 0 and the
    position the plan counted dropped is missing; nothing is concluded from it."""
    import warnings
    ref, model, batch = plain("gpt2-wide")
    for seed in range(3):
        step(model, batch, seed)
    r, ids = runner_of(model), batch["input_ids"]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        logits = model(input_ids=ids).logits
        nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        del logits
        for seed in range(2):
            step(model, batch, seed)
    assert not [w for w in said if "counted as dropped" in str(w.message)]
    assert r.stats()["plans_computed"] == 1
    assert r.last_plan.chain.meta["tail"]["outputs"]["held"] == 0


def test_a_profiling_backward_after_the_next_forward_leaves_the_shape_held():
    """Two forwards, then one backward of both: the second forward found no backward yet
    and planned the shape with the outputs held; the late backward does not reopen it (no
    watching, no warning, no re-plan at a later step that holds them)."""
    import warnings
    _, model, batch = plain("gpt2-wide")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first, second = model(**batch).loss, model(**batch).loss
        (first + second).backward()
        del first, second
    r = runner_of(model)
    logits = logits_bytes(model, batch)
    assert r.last_plan.chain.meta["tail"]["outputs"] == {"dropped": 0, "held": logits}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for seed in range(2):
            step(model, batch, seed)
        keep_step(model, batch, 2)
        step(model, batch, 3)
    assert not [w for w in said if "counted as dropped" in str(w.message)]
    assert r.stats()["plans_computed"] == 2
    assert r.last_plan.chain.meta["tail"]["outputs"] == {"dropped": 0, "held": logits}


def test_plan_for_answers_with_what_the_last_backward_found():
    """A correction found in a backward is applied at the next forward; a ``plan_for`` query
    before it answers with the plan that forward will run."""
    _, model, batch = plain("gpt2-wide")
    r = runner_of(model)
    seen: List[Any] = []
    begin = r._begin
    r._begin = lambda args, kwargs: seen.append((args, kwargs)) or begin(args, kwargs)
    keep_step(model, batch, 0)   # profiling: guessed dropped, seen held
    asked = r.plan_for(*seen[0])
    assert asked.chain.meta["tail"]["outputs"]["dropped"] == 0
    keep_step(model, batch, 1)
    assert r.last_plan is asked


def test_outputs_a_caller_term_saved_count_as_held():
    """The model returns its loss and the caller adds a term of the logits (a z-loss): they
    are freed during the backward, not before it, so they count as held (as dropped, the
    plan peaked at 1.13x its prediction)."""
    lo_held, _ = budgets("gpt2-wide")
    ref, model, batch = plain("gpt2-wide", lo_held)

    def zloss(m: nn.Module, seed: int) -> torch.Tensor:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        return zloss_step(m, batch)

    for seed in range(3):
        assert_same(ref, model, zloss(ref, seed), zloss(model, seed), "gpt2")
    r = runner_of(model)
    assert r.last_plan.chain.meta["tail"]["outputs"] == {
        "dropped": 0, "held": logits_bytes(model, batch)}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    assert cpu_peak(lambda: zloss_step(model, batch)) <= r.last_plan.predicted_peak


def zloss_step(model: nn.Module, batch: Dict[str, Any]) -> torch.Tensor:
    """A step whose loss adds a z-loss term of the logits to the model's own."""
    out = model(**batch)
    loss = out.loss + 1e-4 * torch.logsumexp(out.logits, -1).square().mean()
    del out
    loss.backward()
    return loss.detach()


def test_no_backward_after_the_profiling_forward_plans_with_the_outputs():
    """Nothing said which outputs the caller drops: the next forward plans with them held."""
    ref, model, batch = plain("gpt2")
    kept = counted_kept("gpt2")
    out = model(**batch)   # the profiling forward, never backward
    del out
    for seed in (1, 2):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
    r = runner_of(model)
    held = counted(kept, 0, logits_bytes(model, batch))
    assert (r.last_plan.chain.xbar, r.last_plan.chain.bw_tmp) == (held.xbar, held.bw_tmp)
    assert r.profiling_steps == 1


def test_on_chain_keeps_the_outputs_counted():
    chains: List[Any] = []
    _, model, batch = plain("gpt2", on_chain=lambda c: chains.append(c) or c)
    for seed in range(2):
        step(model, batch, seed)
    assert "outputs" not in chains[0].meta["tail"]
    assert runner_of(model).stats()["plans_computed"] == 1


def test_a_budget_changed_before_the_backward_came_plans_with_the_outputs_held():
    """A profiling forward without a backward, then another budget, then a loop that holds
    the outputs: the new budget's plan counts them held (the guess was the shape's, not the
    budget's)."""
    ref, model, batch = plain("gpt2-wide")
    out = model(**batch)   # the profiling forward, never backward
    del out
    r = runner_of(model)
    r.budget = budgets("gpt2-wide")[0]
    for seed in (1, 2):
        assert_same(ref, model, keep_step(ref, batch, seed), keep_step(model, batch, seed), "gpt2")
    assert r.last_plan.chain.meta["tail"]["outputs"] == {
        "dropped": 0, "held": logits_bytes(model, batch)}
    assert peak_of(model, batch, keep_step) <= r.last_plan.predicted_peak


def test_a_loss_computed_by_the_caller_keeps_the_outputs_counted():
    """No loss from the model: the caller's own loss saves what the tail does not see (the
    log-softmax of the logits); the logits counted through the tail's backward stand for it,
    and a warning says the budget may not hold."""
    ref, model, batch = plain("gpt2-wide")
    ids = batch["input_ids"]

    def outside(m: nn.Module, seed: int) -> torch.Tensor:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = nn.functional.cross_entropy(m(input_ids=ids).logits.flatten(0, 1), ids.flatten())
        loss.backward()
        return loss.detach()

    import warnings
    with warnings.catch_warnings(record=True) as said:   # outputs below 1% of the budget
        warnings.simplefilter("always")
        for seed in range(2):
            assert_same(ref, model, outside(ref, seed), outside(model, seed), "gpt2")
    assert not [w for w in said if "returned no loss" in str(w.message)]
    r = runner_of(model)
    assert "outputs" not in r.last_plan.chain.meta["tail"] and r.stats()["plans_computed"] == 1

    ref, model, batch = plain("gpt2-wide", budgets("gpt2-wide")[0])
    model.eval()   # (an input-gradient pass, not training: nothing to say)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        outside(model, 0)
    assert not [w for w in said if "returned no loss" in str(w.message)]
    ref, model, batch = plain("gpt2-wide", budgets("gpt2-wide")[0])
    with pytest.warns(UserWarning, match=r"returned no loss, only outputs "
                      r"\(the largest that needs a gradient: 98304 B \(96.00 KiB\)\).*Pass labels="):
        outside(model, 0)


DDP = r"""
import datetime, socket, sys, warnings
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
warnings.simplefilter("ignore")
import test_tail_outputs as T
from torch.nn.parallel import DistributedDataParallel
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
try:
    for options in ({}, {"outputs": "held"}):
        _, model, batch = T.plain("gpt2-wide", **options)
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        for seed in range(2):
            T.keep_step(ddp, batch, seed)
        print(T.runner_of(model).last_plan.chain.meta["tail"].get("outputs"))
finally:
    dist.destroy_process_group()
"""


def test_under_a_process_group_the_outputs_count_as_before_unless_told():
    """DDP hands the caller copies of the outputs (``_DDPSink``): the model's own would always
    look dropped, so under a process group they are not watched; ``outputs="held"`` says."""
    import subprocess
    r = subprocess.run([sys.executable, "-c", DDP, f"{ROOT}/tests"], env=python_env(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    _, batch = build("gpt2-wide")
    n = batch["input_ids"].numel() * WIDE * 4
    assert r.stdout.split("\n")[:2] == ["None", str({"dropped": 0, "held": n})], r.stdout


@pytest.mark.parametrize("said", ["dropped", "held"])
def test_outputs_said_are_counted_so_unwatched(said):
    ref, model, batch = plain("gpt2-wide", outputs=said)
    for seed in range(3):   # the loop drops them; "held" is believed all the same
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
    r = runner_of(model)
    n = logits_bytes(model, batch)
    assert r.last_plan.chain.meta["tail"]["outputs"] == (
        {"dropped": n, "held": 0} if said == "dropped" else {"dropped": 0, "held": n})
    assert r.stats()["plans_computed"] == 1 and checkpointed(model).tail.dropped is None


def test_outputs_refused_where_it_means_nothing_or_is_misspelt():
    model, _ = build("gpt2")
    with pytest.raises(ValueError, match="outputs must be one of .*got 'kept'"):
        scheduler.checkpoint(copy.deepcopy(model), 1 << 40, outputs="kept")
    with pytest.raises(ValueError, match="outputs='held' has no effect with planner='mimose'"):
        scheduler.checkpoint(copy.deepcopy(model), 1 << 40, "mimose", outputs="held")
    with pytest.raises(ValueError, match="outputs='dropped' has no effect.*loss= stand-in"):
        scheduler.checkpoint(copy.deepcopy(model), 1 << 40, outputs="dropped", loss="sum")
    with pytest.raises(ValueError, match="scheduler.wrap: outputs='held' has no effect.*no tail"):
        scheduler.wrap(nn.Sequential(nn.Linear(4, 4)), 1 << 20, outputs="held")
    scheduler.wrap(nn.Sequential(nn.Linear(4, 4)), 1 << 20, outputs=None)   # (the default)


def test_a_runner_pickled_before_outputs_existed_still_steps():
    """``__setstate__`` fills in what a runner pickled by an older version lacks."""
    ref, model, batch = plain("gpt2")
    step(model, batch, 0)
    r = runner_of(model)
    state = r.__getstate__()
    for name in ("outputs", "outputs_book"):
        state.pop(name)
        del r.__dict__[name]
    state["_tail_unverified"] = {}   # (what a runner of the version before kept instead)
    r.__setstate__(state)
    assert r.outputs == "watch" and r.outputs_book.watches == {}
    assert "_tail_unverified" not in r.__dict__
    assert_same(ref, model, step(ref, batch, 1), step(model, batch, 1), "gpt2")


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic_kernels")   # gradients compared bit for bit
@pytest.mark.parametrize("how", [step, keep_step])
def test_cuda_outputs_as_the_caller_treats_them(how):
    """On CUDA (the allocator's statistics measure the tail; the autograd device thread frees
    what a backward frees): dropped or held as on the CPU, and the step's real peak
    (max_memory_allocated) within the plan's prediction near the loop's least budget (the
    allocator's 512-byte rounding: 5%)."""
    lo_held, lo_dropped = budgets("gpt2-wide", "cuda")
    # (+2%: another model's measurement; the allocator's first use of a kernel's workspace
    # may land in one and not the other)
    budget = int(1.02 * (lo_dropped if how is step else lo_held))
    ref, model, batch = plain("gpt2-wide", budget, "cuda")
    for seed in range(3):
        assert_same(ref, model, how(ref, batch, seed), how(model, batch, seed), "gpt2 cuda")
    r = runner_of(model)
    n = logits_bytes(model, batch)
    assert r.last_plan.chain.meta["tail"]["outputs"] == (
        {"dropped": n, "held": 0} if how is step else {"dropped": 0, "held": n})
    peak = peak_of(model, batch, how)
    assert peak <= 1.05 * r.last_plan.predicted_peak, (peak, r.last_plan.predicted_peak)


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic_kernels")
def test_cuda_a_later_step_that_keeps_the_outputs_plans_them_held():
    """On CUDA, where the backward's hooks and the outputs' frees run on autograd's device
    thread: a logging step after dropped ones is seen, the next step plans them held (said),
    and a held step's real peak then stays within the prediction (5%, as above)."""
    lo_held, _ = budgets("gpt2-wide", "cuda")
    ref, model, batch = plain("gpt2-wide", int(1.02 * lo_held), "cuda")
    for seed in range(3):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2 cuda")
    assert_same(ref, model, keep_step(ref, batch, 3), keep_step(model, batch, 3), "gpt2 cuda")
    with pytest.warns(UserWarning, match="counted as dropped"):
        assert_same(ref, model, step(ref, batch, 4), step(model, batch, 4), "gpt2 cuda")
    r = runner_of(model)
    assert r.last_plan.chain.meta["tail"]["outputs"] == {
        "dropped": 0, "held": logits_bytes(model, batch)}
    peak = peak_of(model, batch, keep_step)
    assert peak <= 1.05 * r.last_plan.predicted_peak, (peak, r.last_plan.predicted_peak)
