"""scheduler.checkpoint measures the model's tail (final norm, LM head, loss) as the chain's
loss stage L on its profiling step (issue 13): sizes close to logits + log-softmax, gradients
bit-identical, nothing left on the saved-tensor-hook or dispatch-mode stacks whatever the user
does (no backward, a raise, an interrupt, a second call), nothing done on other steps."""
from __future__ import annotations

import copy
import warnings
from typing import Any, List

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import scheduler
from scheduler import simulate
from scheduler.planners import rotor
from scheduler.planners.mimose import plan_from_checkpoints
from scheduler.runtime import hook_stack, tail as tail_mod
from scheduler.runtime.checkpoint import checkpointed

from test_checkpoint_hf import FAST, VOCAB, assert_same, make, step
from wrap_models import one_thread  # noqa: F401  (autouse fixture)


def clean() -> bool:
    """Nothing on the saved-tensor-hook or dispatch-mode stacks."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is None and \
        _get_current_dispatch_mode() is None and not hook_stack._stale


@pytest.fixture(autouse=True)
def stacks_left_clean():
    yield   # (the probes' warnings are each model's own: every test's model says them)
    assert clean()


def checkpointed_model(name: str, budget: Any = 1 << 40, **options: Any):
    ref, batch = make(name)
    model = copy.deepcopy(ref)
    chains: List[Any] = []
    scheduler.checkpoint(model, budget, "rotor", measure_options=FAST,
                         on_chain=lambda c: chains.append(c) or c, **options)
    return ref, model, batch, chains


def head(model: nn.Module) -> nn.Module:
    return model.get_output_embeddings()


def test_a_call_inside_an_except_block_is_measured():
    """A retry inside ``except`` (after an OOM, say) is a normal call: the exception being
    handled around it is not the forward raising."""
    ref, model, batch, chains = checkpointed_model("gpt2")
    try:
        raise RuntimeError("out of memory (the caller retries)")
    except RuntimeError:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "raised" warning
            lr, lm = step(ref, batch, 0), step(model, batch, 0)
    assert_same(ref, model, lr, lm, "gpt2")
    (c,) = chains
    assert c.meta["tail"]["measured"] == "op-tracer estimate" and c.xbar[c.L] > 0



# ------------------------------------------------------------------------------ sizes
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_tail_measured_close_to_logits_and_log_softmax(name):
    ref, model, batch, chains = checkpointed_model(name)
    lr, lm = step(ref, batch, 0), step(model, batch, 0)  # the profiling step
    assert_same(ref, model, lr, lm, name)
    (c,) = chains
    L = c.L
    b, s = batch["input_ids"].shape
    hidden = model.config.hidden_size
    logits = b * s * VOCAB * 4
    h_bytes = b * s * hidden * 4
    assert c.meta.get("tail", {}).get("measured") == "op-tracer estimate"
    # logits (returned) + log-softmax (saved by cross-entropy) + the LM head's input (and the
    # norm's normalised value for RMSNorm), a few small tensors (labels, statistics)
    assert 2 * logits <= c.xbar[L] <= 2 * logits + 2 * h_bytes + 1024, c.xbar[L]
    # gradients of log-softmax and logits, and the LM head's weight gradient (the replay asks
    # for the last block's outputs only: it is counted, not measured); tied to the input
    # embedding (GPT-2), it is held until the head's backward: counted outside the chain
    t, out = c.meta["tail"], c.meta["outside"]
    head = model.get_output_embeddings().weight.numel() * 4
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert out["tied_grads"] == (head if tied else 0)
    own = 0 if tied else head
    assert logits + own <= t["bw_tmp"] <= 3 * logits + own, t["bw_tmp"]
    # every op of the chain carries the memory held outside it (at least the input
    # embedding's saved indices are the caller's: not counted)
    assert c.bw_tmp[L] == t["bw_tmp"] + out["backward"] and c.fw_tmp[L] == t["fw_tmp"] + \
        out["forward"] and out["backward"] == out["forward"] + out["tied_grads"]
    assert c.fw[L] > 0 and c.bw[L] > 0
    assert c.x[L] == h_bytes and c.delta[L] == h_bytes  # the last block's output, its grad
    for seed in (1, 2):  # the plan made on that chain runs
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), name)
    (r,) = checkpointed(model).runners
    assert r.last_plan.chain is c and r.profiling_steps == 1


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_low_budget_bit_identical_and_held_within_prediction(name):
    _, probe, batch, chains = checkpointed_model(name)
    step(probe, batch, 0)  # the chain, tail included
    (c,) = chains
    lo = rotor.min_memory(c)
    hi = simulate(c, plan_from_checkpoints(c.L, [])).peak_memory
    budget = int(lo + 0.05 * (hi - lo)) + 1
    assert lo > c.x[c.L] + c.xbar[c.L]  # the plans count the tail
    ref, _ = make(name)
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, budget, "rotor", track_memory=True, measure_options=FAST)
    for seed in range(3):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed),
                    f"{name} step {seed}")
    (r,) = checkpointed(model).runners
    assert "measured" in r.last_plan.chain.meta.get("tail", {})
    held = r.stats()["last_peak_bytes"]
    assert 0 < held <= r.last_plan.predicted_peak
    assert r.last_stats.recomputed_forwards > 0


def test_t5_decoder_tail_encoder_plans_without_it():
    ref, model, batch, chains = checkpointed_model("t5")
    assert_same(ref, model, step(ref, batch, 0), step(model, batch, 0), "t5")
    enc, dec = chains
    assert "tail" not in enc.meta  # its "tail" is the decoder, planned in its own chain
    assert "measured" in dec.meta.get("tail", {}) and dec.xbar[dec.L] >= 2 * 2 * 7 * VOCAB * 4


# ------------------------------------------------------------------------------ lifecycle
def test_only_the_profiling_step_is_measured():
    ref, model, batch, chains = checkpointed_model("gpt2")
    during: List[bool] = []
    head(model).register_forward_pre_hook(
        lambda m, a: during.append(not clean()))
    for seed in range(3):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
        assert clean()
    assert during == [True, False, False]
    assert len(chains) == 1


def test_no_backward_then_next_step():
    ref, model, batch, chains = checkpointed_model("gpt2")
    out = model(**batch)  # the profiling forward, never backward
    assert clean() and "measured" in chains[0].meta.get("tail", {})
    del out
    for seed in (1, 2):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
    assert checkpointed(model).runners[0].profiling_steps == 1


def test_two_forwards_one_backward():
    ref, model, batch, _ = checkpointed_model("gpt2")
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        loss = m(**batch).loss + m(**batch).loss
        assert clean()
        loss.backward()
    assert_same(ref, model, torch.zeros(()), torch.zeros(()), "two forwards")


def _raises_once(exc: BaseException) -> Any:
    """A forward pre-hook that raises ``exc`` at its first call only."""
    calls = []

    def hook(m: nn.Module, a: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise exc
    return hook


def test_tail_raises_then_trains():
    ref, model, batch, chains = checkpointed_model("gpt2")
    h = head(model).register_forward_pre_hook(_raises_once(RuntimeError("boom in the tail")))
    with pytest.warns(UserWarning, match="raised after its last block"):
        with pytest.raises(RuntimeError, match="boom"):
            model(**batch)
    assert clean() and not chains  # not planned on: the shape is measured again...
    for seed in (1, 2):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
    h.remove()
    assert len(chains) == 1 and "xbar" in chains[0].meta["tail"]  # ...at its next step
    assert checkpointed(model).runners[0].stats()["profiling_steps"] == 2  # (one failed)


def _failing_tail(monkeypatch, failures: List[int]) -> None:
    """The tail's measurement (its replayed backward) fails while ``failures[0]`` > 0."""
    measure = tail_mod.TailProbe._tail_chain

    def tail_chain(self, *a):
        if failures[0] > 0:
            failures[0] -= 1
            raise torch.OutOfMemoryError("out of memory in the replay (simulated)")
        return measure(self, *a)
    monkeypatch.setattr(tail_mod.TailProbe, "_tail_chain", tail_chain)


def test_a_failed_tail_measurement_is_measured_again_not_kept(monkeypatch):
    # planned on the stand-in loss stage (the tail costs nothing), the shape ran at 1.39x its
    # budget for good; it is measured again at its next step instead
    _failing_tail(monkeypatch, [tail_mod.TAIL_TRIES - 1])
    ref, model, batch, chains = checkpointed_model("gpt2")
    runner = checkpointed(model).runners[0]
    with pytest.warns(UserWarning, match="measured again at its next step"):
        for seed in range(tail_mod.TAIL_TRIES + 1):
            assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
    assert runner.stats()["profiling_steps"] == tail_mod.TAIL_TRIES
    assert len(chains) == 1 and "xbar" in chains[0].meta["tail"] and not runner._tail_failures


def test_a_tail_that_never_measures_is_planned_on_the_stand_in_with_a_warning(monkeypatch):
    # each of two models in one process says its own failures (a warning per model, not
    # per process), and after TAIL_TRIES plans on the stand-in, saying the budget may not hold
    _failing_tail(monkeypatch, [1 << 30])
    for _ in range(2):
        ref, model, batch, chains = checkpointed_model("gpt2")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for seed in range(tail_mod.TAIL_TRIES + 2):
                step(model, batch, seed)
        said = [str(w.message) for w in seen]
        assert len([m for m in said if "measured again at its next step" in m]) == 1, said
        assert len([m for m in said if "budget may not hold" in m]) == 1, said
        assert checkpointed(model).runners[0].stats()["profiling_steps"] == tail_mod.TAIL_TRIES
        assert len(chains) == 1 and "failed" in chains[0].meta["tail"]


def test_an_input_aware_chain_never_learns_a_failed_tail(monkeypatch):
    from scheduler.runtime.input_aware import InputAwareChain
    _failing_tail(monkeypatch, [1])
    ref, batch = make("gpt2")
    model = copy.deepcopy(ref)
    src = InputAwareChain(model.transformer.h, samples=3, measure_options=FAST)
    learnt = []
    learn = src.learn
    monkeypatch.setattr(src, "learn", lambda size, chain: learnt.append(chain) or
                        learn(size, chain))
    scheduler.checkpoint(model, 1 << 40, "rotor", chain=src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (said: the tests above)
        for seed in range(2):
            step(model, batch, seed)
    assert len(learnt) == 1 and "xbar" in learnt[0].meta["tail"], [c.meta for c in learnt]


def _interrupt_in_the_tail(model: nn.Module, batch: Any) -> None:
    """A Ctrl-C in the model's head, after its last block, on a profiling step."""
    def interrupt(m, a):
        raise KeyboardInterrupt

    h = head(model).register_forward_pre_hook(interrupt)
    try:
        model(**batch)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interrupt did not reach the caller")
    finally:
        h.remove()


def test_interrupt_in_the_tail_is_cleaned_at_the_next_call():
    ref, model, batch, chains = checkpointed_model("gpt2")
    _interrupt_in_the_tail(model, batch)
    assert not clean()  # always_call forward hooks do not run on an interrupt...
    with pytest.warns(UserWarning, match="interrupted"):
        lm = step(model, batch, 1)  # ...the next call of the model pops them
    assert clean()
    assert_same(ref, model, step(ref, batch, 1), lm, "gpt2")


def test_an_interrupted_tail_records_nothing_until_the_next_call():
    # a Ctrl-C handler goes on without calling the model (it saves it, say): the entries the
    # interrupted call left pushed must not trace and keep its tensors meanwhile
    ref, model, batch, chains = checkpointed_model("gpt2")
    _interrupt_in_the_tail(model, batch)
    tracer = _get_current_dispatch_mode()
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)[0].__self__
    w = torch.randn(64, 64, requires_grad=True)
    for _ in range(3):
        (torch.tanh(w @ w) * w).sum().backward()
    assert isinstance(tracer, tail_mod.TailTracer) and not tracer.active and not tracer._keep
    assert not hooks.recording and not hooks.saved
    with pytest.warns(UserWarning, match="interrupted"):
        lm = step(model, batch, 1)
    assert clean()
    assert_same(ref, model, step(ref, batch, 1), lm, "gpt2")


def test_an_interrupted_tail_keeps_nothing_of_its_caller_alive():
    # the interrupted call's frame tells the probe the call has ended; held past the end it
    # would keep the caller's locals (the model, its optimizer): a collection lets it go
    import gc
    import weakref
    ref, model, batch, chains = checkpointed_model("gpt2")

    def train(model: nn.Module, held: torch.Tensor) -> None:
        _interrupt_in_the_tail(model, batch)

    held = torch.zeros(1 << 16)
    gone = [weakref.ref(model), weakref.ref(held)]
    train(model, held)
    del model, held
    gc.collect()   # (no op runs before it)
    assert [r() for r in gone] == [None, None]
    _, other, _, measured = checkpointed_model("gpt2")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step(other, batch, 1)   # a new model's first step: its tail is measured
    assert not [w for w in seen if "are active around" in str(w.message)], \
        [str(w.message) for w in seen]
    assert "measured" in measured[0].meta.get("tail", {}) and clean()


def test_an_interrupt_inside_a_block_ends_the_models_call():
    # the model's forward hook never runs on an interrupt: the next call is a new forward of
    # the model, not one inside the interrupted one (no 'ran a second time' warning)
    ref, model, batch, chains = checkpointed_model("gpt2")
    h = model.transformer.h[1].register_forward_pre_hook(_raises_once(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        model(**batch)
    h.remove()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for seed in (1, 2):
            assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2")
    assert not [w for w in seen if "second time" in str(w.message)], seen
    probe = checkpointed(model).tail
    assert probe.depth == 0 and probe.calls == 3


def test_hooks_around_the_model_keep_the_stand_in():
    ref, model, batch, chains = checkpointed_model("gpt2")
    with pytest.warns(UserWarning, match="saved-tensor hooks or a dispatch mode"):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            lm = step(model, batch, 0)
    assert "tail" not in chains[0].meta
    assert_same(ref, model, step(ref, batch, 0), lm, "gpt2")


def test_context_left_open_in_the_tail_is_popped_later(monkeypatch):
    ref, model, batch, chains = checkpointed_model("gpt2")
    opened = []
    noted = []   # what our hooks noted, as the measurement reads it (after they went inert)
    measure = tail_mod.TailProbe._tail_chain

    def tail_chain(self, rec, *a):
        noted.append(len(rec.hooks.saved))
        return measure(self, rec, *a)
    monkeypatch.setattr(tail_mod.TailProbe, "_tail_chain", tail_chain)

    def open_context(m, a, out):  # a hook that leaves a saved-tensor context open
        if not opened:
            ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            ctx.__enter__()
            opened.append(ctx)

    h = head(model).register_forward_hook(open_context)
    with pytest.warns(UserWarning, match="still open when it returned"):
        lm = step(model, batch, 0)
    h.remove()
    assert "tail" in chains[0].meta and hook_stack._stale  # measured; our hooks inert below
    assert noted and noted[0] > 0   # what the head saved is counted though they stay pushed
    opened[0].__exit__(None, None, None)  # the user's context closes...
    assert_same(ref, model, step(ref, batch, 0), lm, "gpt2")
    assert_same(ref, model, step(ref, batch, 1), step(model, batch, 1), "gpt2")
    assert clean()  # ...and the next call of the model popped ours


def test_loss_outside_the_model():
    ref, model, batch, chains = checkpointed_model("gpt2")
    ids = batch["input_ids"]
    for seed in range(2):
        grads = []
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            logits = m(input_ids=ids).logits
            nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
            grads.append([p.grad for p in m.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    (c,) = chains
    logits = ids.numel() * VOCAB * 4
    # logits and the LM head's input; the loss computed after the model returns is not seen
    assert logits <= c.xbar[c.L] < 2 * logits


def test_undo_between_forward_and_backward():
    ref, model, batch, _ = checkpointed_model("gpt2")
    loss = model(**batch).loss
    scheduler.runtime.checkpoint.undo(model)
    assert clean()
    loss.backward()


# ------------------------------------------------------------------------------ fallbacks
class Detached(nn.Module):
    """A model whose output does not depend on its blocks' output through a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.detach().sum() * self.w


def test_unreached_tail_warns_and_keeps_the_stand_in():
    model = Detached()
    chains: List[Any] = []
    scheduler.checkpoint(model, 1 << 30, "rotor", measure_options=FAST,
                         on_chain=lambda c: chains.append(c) or c)
    with pytest.warns(UserWarning, match="does not depend on its last block"):
        model(torch.randn(4, 8)).backward()
    (c,) = chains
    assert "tail" not in c.meta and c.meta["loss"] == "sum"


class Routed(nn.Module):
    """A block returning, beside its output, what it computed on the way to it (router
    logits, attention probabilities), as transformers 4's MoE blocks and BLOOM's do."""

    def __init__(self):
        super().__init__()
        self.gate, self.lin = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h: torch.Tensor):
        logits = self.gate(h)
        return self.lin(h) * torch.softmax(logits, -1), logits


class RoutedModel(nn.Module):
    def __init__(self, aux: bool):
        super().__init__()
        self.aux = aux
        self.layers = nn.ModuleList(Routed() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = []
        for layer in self.layers:
            x, g = layer(x)
            logits.append(g)
        loss = self.head(x).square().mean()
        if self.aux:  # a load-balancing loss: the tail reads every block's router logits
            loss = loss + 0.1 * sum(g.square().mean() for g in logits)
        return loss


@pytest.mark.parametrize("aux", [False, True], ids=["unread", "aux-loss"])
def test_tail_replay_never_enters_the_last_block(aux):
    """Of the last block's outputs, the replay asks only for those the tail reads that feed
    no other: the router logits feed the block's own output (read by the loss or not), so
    asking for their gradient would run the block's backward. The tail is measured, the
    gradients are plain training's."""
    torch.manual_seed(0)
    ref = RoutedModel(aux)
    model = copy.deepcopy(ref)
    chains: List[Any] = []
    scheduler.checkpoint(model, 1 << 30, "rotor", measure_options=FAST,
                         on_chain=lambda c: chains.append(c) or c)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "measuring the model's tail failed"
        for seed in range(2):
            grads = []
            for m in (ref, model):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(seed)
                m(x).backward()
                grads.append([p.grad for p in m.parameters()])
            assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert chains and "failed" not in chains[0].meta.get("tail", {"failed": "not measured"})


class Viewed(nn.Module):
    """A block returning its output and a view of it (reshaped for the next stage)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor):
        h = torch.tanh(self.lin(h))
        return h, h.view(-1, 2, 4)


class ViewedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Viewed() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x, _ = layer(x)
        return self.head(x).square().mean()


def test_an_output_viewed_by_another_is_still_the_tails_input():
    """A view's backward reads nothing saved: the output it views is still asked for, and
    the tail is measured (not the stand-in)."""
    torch.manual_seed(0)
    model = ViewedModel()
    chains: List[Any] = []
    scheduler.checkpoint(model, 1 << 30, "rotor", measure_options=FAST,
                         on_chain=lambda c: chains.append(c) or c)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(4, 8)).backward()
    assert chains and "tail" in chains[0].meta and "failed" not in chains[0].meta["tail"]


def test_wrap_and_loss_option_keep_their_loss_stage():
    blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))
    chains: List[Any] = []
    w = scheduler.wrap(blocks, 1 << 30, on_chain=lambda c: chains.append(c) or c,
                       measure_options=FAST, loss="mse")
    assert w.runner.tail is None
    w(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert chains[0].meta["loss"] == "mse" and "tail" not in chains[0].meta
    ref, model, batch, chains = checkpointed_model("gpt2", loss="cross_entropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, batch, 0)
    # the probe only numbers the model's forwards with loss= given: it measures nothing
    assert not checkpointed(model).tail.measures and "tail" not in chains[0].meta


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic_kernels")   # gradients compared bit for bit
def test_cuda_tail_from_the_allocator():
    ref, model, batch, chains = checkpointed_model("gpt2")
    ref.cuda(), model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    for seed in range(3):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "gpt2 cuda")
    (c,) = chains
    L = c.L
    logits = batch["input_ids"].numel() * VOCAB * 4
    assert c.meta["tail"].get("measured") == "cuda allocator statistics", c.meta["tail"]
    assert c.xbar[L] >= 2 * logits and c.bw_tmp[L] >= logits, (
        f"logits {logits} bytes: xbar[L] {c.xbar[L]} (expected >= logits + log-softmax), "
        f"bw_tmp[L] {c.bw_tmp[L]} (expected >= logits); tail {c.meta['tail']}")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_mimose_learns_the_tail(name):
    """Mimose's collection steps measure the tail too: its plans count the logits and the
    log-softmax (they once planned with a free loss stage and overshot the budget by them)."""
    ref, batch = make(name)
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, 1 << 40, "mimose")
    for seed in range(2):  # a collection step, then the plan for the same size
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), name)
    (r,) = checkpointed(model).runners
    b, s = batch["input_ids"].shape
    c = r.last_plan.chain
    assert r.last_plan.planner == "mimose" and c.meta["tail"] == "estimated"
    assert c.xbar[c.L] >= 2 * b * s * VOCAB * 4       # logits + log-softmax
    assert c.bw_tmp[c.L] > 0 and r.stats()["mimose_collections"] == 1
    # ... and what the step holds outside the chain (the causal mask, the head's saved
    # tensors), in every op's transient, as rotor's measured chains have it
    out = c.meta["outside"]
    assert out["forward"] > 0 and all(v >= out["forward"] for v in c.fw_tmp + c.bw_tmp)


def test_mimose_never_mixes_samples_with_and_without_the_tail():
    """A collection step whose tail (or blocks' transients) could not be measured is dropped
    once samples carry one (a zero in the fit would undercount every size's); without a
    first tail (transients), none."""
    ref, batch = make("gpt2")
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, 1 << 40, "mimose")
    (r,) = checkpointed(model).runners
    L = r.L
    tmp = lambda n: {"fw_tmp": (2.0 * n,) * L, "bw_tmp": (3.0 * n,) * L,  # noqa: E731
                     "fck_tmp": (5.0 * n,) * L}
    sample = lambda n, t=True: (float(n), 4.0 * n, (8.0 * n,) * L, (4.0 * n,) * L,  # noqa
                                (1e-3,) * L, tmp(n) if t else None, False)
    tail = [40.0, 8.0, 30.0, 1e-3, 2e-3]
    r._observe_sample(sample(10), tail, [64.0, 16.0])
    with pytest.warns(UserWarning, match="tail not measured.*sample is dropped"):
        r._observe_sample(sample(20), None, None)
    with pytest.warns(UserWarning, match="transients not measured.*sample is dropped"):
        r._observe_sample(sample(30, t=False), tail, [64.0, 16.0])
    est = r.mimose.estimator
    assert est.has(10) and not est.has(20) and not est.has(30) and r.collections == 1
    assert est.measured(10).tmp["bw_tmp"].tolist() == [30.0] * L
    r2 = type(r).__new__(type(r))
    r2.__dict__.update(r.__dict__, _mimose_tails=None, collections=0,
                       mimose=scheduler.planners.mimose.Mimose(L))
    r2._observe_sample(sample(10, t=False), None, None)     # the first had none:
    r2._observe_sample(sample(20), tail, [64.0, 16.0])      # none learnt
    assert r2.collections == 2 and r2.mimose.estimator.measured(20).tail is None
    assert r2.mimose.estimator.measured(20).tmp is None


@pytest.mark.parametrize("where", ["tail", "transients"])
def test_a_first_mimose_sample_whose_measurement_failed_does_not_decide_the_run(where):
    """An out-of-memory in the tail (or while the blocks' transients are measured) on the
    first collection step: its sample is dropped and collected again, not taken as 'this model
    has no tail' for the whole run (every plan would then leave the tail's memory out)."""
    from scheduler.runtime import mimose_steps
    ref, batch = make("gpt2")
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, 1 << 40, "mimose")
    (r,) = checkpointed(model).runners
    L = r.L
    tmp = {"fw_tmp": (2.0,) * L, "bw_tmp": (3.0,) * L, "fck_tmp": (5.0,) * L}
    tail = [40.0, 8.0, 30.0, 1e-3, 2e-3]

    def sample(n: int, failed: bool = False):
        broken = failed and where == "transients"
        return (float(n), 4.0 * n, (8.0 * n,) * L, (4.0 * n,) * L, (1e-3,) * L,
                None if broken else tmp, broken)

    def failed_step(n: int) -> None:
        if where == "tail":
            r._observe_sample(sample(n), None, None, tail_failed=True)
        else:
            r._observe_sample(sample(n, failed=True), tail, [64.0, 16.0])

    with pytest.warns(UserWarning, match="failed on a Mimose collection step before any"):
        failed_step(10)
    assert r._mimose_tails is None and r.collections == 0
    r._observe_sample(sample(10), tail, [64.0, 16.0])   # collected again: measured
    assert r._mimose_tails and r._mimose_tmp and r.collections == 1
    assert r.mimose.estimator.measured(10).tail is not None
    # a measurement that always fails: learnt without it after a few tries, said
    r2 = type(r).__new__(type(r))
    r2.__dict__.update(r.__dict__, _mimose_tails=None, _mimose_tmp=None, _first_failures=0,
                       collections=0, mimose=scheduler.planners.mimose.Mimose(L))
    r = r2
    for _ in range(mimose_steps.FIRST_SAMPLE_TRIES - 1):
        with pytest.warns(UserWarning, match="before any"):
            failed_step(10)
    with pytest.warns(UserWarning, match="learns without them from now on"):
        failed_step(10)
    assert r.collections == 1 and r._mimose_tails is (where != "tail")


def _interrupt_in_block(model: nn.Module, batch: Any) -> None:
    """A Ctrl-C inside block 1 (the forward's likeliest place for one)."""
    def interrupt(m, a):
        raise KeyboardInterrupt

    h = model.transformer.h[1].attn.register_forward_pre_hook(interrupt)
    try:  # (not pytest.raises: its traceback would keep the frames alive)
        model(**batch)
    except KeyboardInterrupt:
        pass
    finally:
        h.remove()


@pytest.mark.parametrize("where", ["block", "tail"])
def test_del_model_after_a_ctrl_c_frees_it_at_once(where):
    # the probe knew the interrupted call by its frame, held: the frame holds the model (its
    # 'self'), a cycle through the model's hooks that only a collection freed; and a recording
    # in progress held the profiling step's graph, which reaches the runner, which held the
    # probe: a cycle through autograd's C++ nodes, never freed
    import gc
    import weakref
    ref, model, batch, chains = checkpointed_model("gpt2")
    if where == "block":
        step(model, batch, 0)
    (_interrupt_in_block if where == "block" else _interrupt_in_the_tail)(model, batch)
    gone = [weakref.ref(model), weakref.ref(checkpointed(model).tail),
            weakref.ref(model.transformer.h[0].attn.c_attn.weight)]
    gc.disable()
    try:
        del model
        assert [r() for r in gone] == [None, None, None]
    finally:
        gc.enable()


def test_a_ctrl_c_in_the_tail_leaves_nothing_pushed_once_the_model_is_gone():
    # the tracer and hooks of a tail interrupted by a Ctrl-C were popped only at a checkpointed
    # model's next call: with none, every later op ran through the tracer (torch.compile
    # compiled nothing); they go with the model now, or with its undo
    ref, model, batch, chains = checkpointed_model("gpt2")
    _interrupt_in_the_tail(model, batch)
    assert not clean()
    del model
    assert clean()
    ref, model, batch, chains = checkpointed_model("gpt2")
    _interrupt_in_the_tail(model, batch)
    scheduler.runtime.checkpoint.undo(model)
    assert clean()


def test_a_call_in_the_interrupted_calls_place_is_a_new_call():
    # the interrupted call is known by its place (depth, id of its frame): a new call of the
    # model from the same line takes that place, and is not taken for a call inside it
    ref, model, batch, chains = checkpointed_model("gpt2")
    probe = checkpointed(model).tail
    for _ in range(3):
        _interrupt_in_block(model, batch)
        assert probe.depth == 1   # (no forward hook on an interrupt)
    assert probe.calls == 3
    _interrupt_in_the_tail(model, batch)  # (the profiling step's, recording)
    assert probe.calls == 4 and not clean()
    with pytest.warns(UserWarning, match="interrupted"):
        lm = step(model, batch, 1)
    assert probe.depth == 0 and probe.calls == 5 and clean()
    assert_same(ref, model, step(ref, batch, 1), lm, "gpt2")


def test_no_python_code_of_the_runtime_runs_in_a_garbage_collection():
    # a Ctrl-C's KeyboardInterrupt raised inside a gc callback or a weakref finalizer is lost
    # (CPython prints it and goes on): the runtime runs none there, even mid-forward
    import gc
    import sys
    ref, model, batch, chains = checkpointed_model("gpt2")
    ran: List[str] = []

    def profile(frame, event, arg):
        if event == "call" and "/scheduler/" in frame.f_code.co_filename:
            ran.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    def collect(m, a):
        sys.setprofile(profile)
        try:
            gc.collect()
        finally:
            sys.setprofile(None)

    h = model.transformer.h[1].register_forward_pre_hook(collect)
    step(model, batch, 0)
    h.remove()
    assert not ran, ran
