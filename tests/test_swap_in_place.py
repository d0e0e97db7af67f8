"""The swap runtime keeps an iteration in place: a plan that moves nothing, followed by two
iterations in a row, lets the next ones keep their saved tensors where they are and only count
their bytes (``swap_sequence``, "In place"). Gradients stay bit-identical, the budget holds,
a new input shape finds its own plan, and an iteration that outgrows the room falls back."""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import scheduler
from scheduler.planners.swap_schedule import SwapSchedule
from scheduler.runtime.swap import KeptInPlaceWarning, PlanOverBudgetWarning

from test_swap_runtime import (MODELS, FakeAllocator, assert_bit_identical, batch_mlp, mlp,
                               train)

BIG = 1 << 30  # a budget every test model fits in: its plans move nothing


def swap(budget=BIG, **kw):
    kw.setdefault("window", 1 << 20)
    return scheduler.swap(budget=budget, device="cpu", min_bytes=0, **kw)


def per_step(ctx, keys=("iterations_in_place", "last_iteration_peak_resident_bytes",
                        "peak_resident_bytes", "plans_computed", "plan_switches",
                        "plan_mismatches")):
    """A ``train`` check that records the chosen stats after each step."""
    seen = []
    return seen, lambda i: seen.append({k: ctx.stats()[k] for k in keys})


def linear_step(lin, n=8):
    lin(torch.randn(n, 16)).exp().sum().backward()


def warm_up(ctx, lin, n=8):
    """Three steps on batch ``n`` inside the open ``ctx`` (record, follow twice): the next
    iteration is kept in place."""
    for _ in range(3):
        linear_step(lin, n)
    assert ctx._seq.in_place.on


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_identical_in_place(name):
    """Every model of the swap tests (a transformer with dropout among them), 7 steps: from the
    fourth on, in place; each step's gradients equal plain training's bit for bit, and its peak
    the tracked iterations' (a training step holds its saved tensors until its backward)."""
    build, batch = MODELS[name]
    ref = train(build, batch, steps=7)
    ctx = swap()
    seen, check = per_step(ctx)
    got = train(build, batch, ctx=ctx, steps=7, check=check)
    assert_bit_identical(got, ref)
    s = ctx.stats()
    assert s["iterations"] == 7 and s["iterations_in_place"] == 4
    assert s["plans_computed"] == 1 and s["plan_cache_hits"] == 6
    assert s["swapped_out_bytes"] == 0 and s["live_variables"] == 0
    peaks = [p["last_iteration_peak_resident_bytes"] for p in seen]
    assert peaks[0] > 0 and peaks == [peaks[0]] * 7


def test_gradients_identical_in_place_on_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from transformers import GPT2Config, GPT2LMHeadModel

    def run(ctx):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                           n_positions=32))  # dropout on: masks must match
        grads = []
        with ctx if ctx is not None else contextlib.nullcontext():
            for s in range(6):
                g = torch.Generator().manual_seed(s)
                ids = torch.randint(0, 64, (2, 16), generator=g)
                torch.manual_seed(100 + s)
                model(ids, labels=ids).loss.backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                model.zero_grad(set_to_none=True)
        return grads

    ref = run(None)
    ctx = swap()
    got = run(ctx)
    assert ctx.stats()["iterations_in_place"] == 3
    for a, b in zip(got, ref):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_in_place_peak_equals_the_tracked_peak():
    """The bytes an iteration kept in place counts are its tracked peak, step by step."""
    ctx = swap()
    seen, check = per_step(ctx)
    train(mlp, batch_mlp, ctx=ctx, steps=5, check=check)
    assert [s["iterations_in_place"] for s in seen] == [0, 0, 0, 1, 2]
    tracked = seen[2]["last_iteration_peak_resident_bytes"]
    assert tracked > 0
    assert [s["last_iteration_peak_resident_bytes"] for s in seen[3:]] == [tracked, tracked]
    assert seen[-1]["peak_resident_bytes"] == tracked


def test_no_budget_never_keeps_in_place():
    """Without a budget nothing bounds what an unplanned sequence may need."""
    nothing = lambda seq: SwapSchedule.empty(len(seq))  # noqa: E731
    ctx = swap(budget=None, planner=nothing)
    train(mlp, batch_mlp, ctx=ctx, steps=6)
    s = ctx.stats()
    assert s["iterations"] == 6 and s["iterations_in_place"] == 0
    assert s["plan_cache_hits"] == 5


def test_a_plan_that_moves_something_is_never_kept_in_place():
    ref = train(mlp, batch_mlp, steps=6)
    probe = swap()
    train(mlp, batch_mlp, ctx=probe, steps=1)
    ctx = swap(budget=probe.stats()["peak_resident_bytes"] // 2, window=4096)
    got = train(mlp, batch_mlp, ctx=ctx, steps=6)
    assert_bit_identical(got, ref)
    s = ctx.stats()
    assert s["iterations_in_place"] == 0 and s["swapped_out_bytes"] > 0


def test_a_new_shape_finds_its_own_plan():
    """In place on batch 8, then batch 16, whose plan (made at step 1) moves tensors: its first
    saved tensor differs, so the iteration takes the full path from its start, switches to that
    plan and keeps the budget."""
    sizes = [16, 8, 8, 8, 8, 16, 16, 8]
    probe = swap()
    train(mlp, batch_mlp, ctx=probe, steps=2, sizes=[16, 8])
    small = probe.stats()["last_iteration_peak_resident_bytes"]
    ref = train(mlp, batch_mlp, steps=len(sizes), sizes=sizes)
    ctx = swap(budget=small + 1024, window=4096)   # batch 8 fits; batch 16 must swap
    seen, check = per_step(ctx)
    got = train(mlp, batch_mlp, ctx=ctx, steps=len(sizes), sizes=sizes, check=check)
    assert_bit_identical(got, ref)
    assert [s["iterations_in_place"] for s in seen] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [s["plans_computed"] for s in seen] == [1, 2, 2, 2, 2, 2, 2, 2]
    assert seen[5]["plan_switches"] == seen[4]["plan_switches"] + 1
    # (step 1: batch 8 departs from batch 16's plan at its first event, none known: recorded)
    assert [s["plan_mismatches"] for s in seen] == [0, 1, 1, 1, 1, 1, 1, 1]
    assert seen[-1]["peak_resident_bytes"] <= small + 1024
    assert ctx.stats()["swapped_out_bytes"] > 0


class Grows(nn.Module):
    """Its first layer's output has the same size every step; ``extra`` more layers run when
    set (a sequence that departs from the plan after its first saved tensor)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 64)
        self.more = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.head = nn.Linear(64, 10)
        self.extra = 0

    def forward(self, x):
        h = torch.tanh(self.first(x))
        for layer in self.more[:self.extra]:
            h = torch.tanh(layer(h))
        return self.head(h)


def test_outgrowing_the_room_falls_back_and_the_next_iteration_records():
    """The same first saved tensor, then more layers than the plan knew, past the room: the
    pack that would pass it takes the full path for the rest of the iteration (the bytes kept
    so far counted as resident); that iteration is not planned, the next records. Gradients
    stay exact throughout."""
    def run(ctx, budget_room=None):
        torch.manual_seed(0)
        model = Grows()
        grads, stats = [], []
        with ctx if ctx is not None else contextlib.nullcontext():
            for i in range(7):
                model.extra = 4 if i >= 3 else 0
                x, y = batch_mlp(i)
                nn.functional.cross_entropy(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
                model.zero_grad(set_to_none=True)
                if ctx is not None:
                    stats.append(ctx.stats())
        return grads, stats

    ref, _ = run(None)
    probe = swap()
    run_probe = run(probe)[1]
    small = run_probe[0]["last_iteration_peak_resident_bytes"]
    big = run_probe[-1]["last_iteration_peak_resident_bytes"]
    assert big > small
    ctx = swap(budget=(small + big) // 2, window=1 << 20)
    # what step 3 kept in place cannot move: the budget is passed, loudly
    with pytest.warns(KeptInPlaceWarning, match="outgrew its plan partway"):
        got, stats = run(ctx)
    for a, b in zip(got, ref):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert [s["iterations_in_place"] for s in stats] == [0, 0, 0, 0, 0, 0, 0]
    # steps 0-2 small (record, follow twice); step 3 in place, outgrows the room: a mismatch,
    # not planned; step 4 departs from the small plan (a mismatch) and records the grown
    # sequence; 5-6 follow it
    assert [s["plan_mismatches"] for s in stats] == [0, 0, 0, 1, 2, 2, 2]
    assert [s["plans_computed"] for s in stats] == [1, 1, 1, 1, 2, 2, 2]
    assert stats[-1]["swapped_out_bytes"] > 0


def test_a_saved_tensor_changed_in_place_raises_in_place():
    ctx = swap()
    lin = nn.Linear(16, 16)
    with ctx:
        for _ in range(4):
            x = torch.randn(8, 16, requires_grad=True)
            lin(x).exp().sum().backward()
        assert ctx._seq.in_place.on
        y = lin(torch.randn(8, 16, requires_grad=True)).exp()
        y.add_(1)   # exp saved its output
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_without_the_end_callback_the_next_pack_ends_an_iteration_in_place(monkeypatch):
    """Older torch has no engine callback: the first pack after a backward ends the
    iteration, in place as on the full path."""
    from scheduler.runtime import swap as swap_module
    monkeypatch.setattr(swap_module.SwapContext, "_queue_end_callback", lambda self: None)
    ref = train(mlp, batch_mlp, steps=7)
    ctx = swap()
    got = train(mlp, batch_mlp, ctx=ctx, steps=7)
    assert_bit_identical(got, ref)
    s = ctx.stats()
    # (the last iteration is still open: no pack came after its backward)
    assert s["iterations"] == 6 and s["iterations_in_place"] == 3


def test_stats_during_an_iteration_in_place_count_what_it_saved():
    ctx = swap()
    with ctx:
        lin = nn.Linear(16, 16)
        warm_up(ctx, lin)
        before = ctx.stats()
        y = lin(torch.randn(8, 16)).exp()
        during = ctx.stats()
        assert during["resident_bytes"] == before["last_iteration_peak_resident_bytes"] > 0
        y.sum().backward()
        after = ctx.stats()
    assert after["iterations_in_place"] == 1 and after["resident_bytes"] == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([4, 8, 16]), min_size=1, max_size=10),
       st.sampled_from([0.5, 0.8, 1.5]))
def test_property_any_shapes_any_budget(sizes, frac):
    """Any sequence of batch sizes, a budget that fits all of them, some or none: gradients
    equal plain training's and the budget holds (a new batch size shows at the first saved
    tensor: no iteration kept in place outgrows its room)."""
    probe = swap()
    train(mlp, batch_mlp, ctx=probe, steps=1, sizes=[16])
    full = probe.stats()["peak_resident_bytes"]
    budget = int(full * frac)
    ref = train(mlp, batch_mlp, steps=len(sizes), sizes=sizes)
    ctx = swap(budget=budget, window=4096)
    got = train(mlp, batch_mlp, ctx=ctx, steps=len(sizes), sizes=sizes)
    assert_bit_identical(got, ref)
    s = ctx.stats()
    assert s["peak_resident_bytes"] <= budget
    if frac >= 1:
        assert s["swapped_out_bytes"] == 0


def test_a_graph_kept_after_its_iteration_still_counts():
    """A graph kept past its iteration (``retain_graph=True``, still referenced) holds the
    tensors that iteration kept in place: they count as resident, and against the room, until
    the graph dies; and since they could not move if a later iteration needed the room, that
    plan is not kept in place again."""
    budget = 1 << 20
    ctx = swap(budget=budget)
    lin = nn.Linear(16, 16)
    with ctx:
        warm_up(ctx, lin)
        kept = lin(torch.randn(8, 16)).exp().sum()
        kept.backward(retain_graph=True)
        s = ctx.stats()
        assert s["iterations_in_place"] == 1
        held = s["resident_bytes"]
        assert held == s["last_iteration_peak_resident_bytes"] > 0
        assert not ctx._seq.in_place.on and ctx._seq.active.in_place_refused
        linear_step(lin)
        assert ctx.stats()["resident_bytes"] == held
        del kept
        assert ctx.stats()["resident_bytes"] == 0
        for _ in range(3):
            linear_step(lin)
        assert not ctx._seq.in_place.on
    assert ctx.stats()["iterations_in_place"] == 1


def test_a_second_forward_before_a_backward_leaves_in_place():
    """An evaluation loop without ``torch.no_grad()`` after training: the second forward is one
    pack more than the plan has, so the iteration leaves in place there (what it kept counts
    until it dies) and the plan is not kept in place again; nothing is counted twice."""
    ctx = swap()
    lin = nn.Linear(16, 16)
    with ctx:
        warm_up(ctx, lin)
        one = ctx.stats()["last_iteration_peak_resident_bytes"]
        outs = [lin(torch.randn(8, 16)).exp() for _ in range(5)]   # eval, graphs kept
        assert not ctx._seq.in_place.on and ctx._seq.active.in_place_refused
        assert ctx.stats()["resident_bytes"] == 5 * one
        del outs
        assert ctx.stats()["resident_bytes"] == 0
        for _ in range(4):
            linear_step(lin)
        assert not ctx._seq.in_place.on
    assert ctx.stats()["iterations_in_place"] == 0


def test_a_plan_that_moves_nothing_over_the_budget_is_not_kept_in_place():
    """A planner may move nothing where the sequence does not fit (the runtime then evicts on
    demand): such a plan is followed, never kept in place."""
    probe = swap()
    train(mlp, batch_mlp, ctx=probe, steps=1)
    peak = probe.stats()["peak_resident_bytes"]
    ref = train(mlp, batch_mlp, steps=6)
    ctx = swap(budget=peak * 3 // 4, planner=lambda seq: SwapSchedule.empty(len(seq)))
    with pytest.warns(PlanOverBudgetWarning):
        got = train(mlp, batch_mlp, ctx=ctx, steps=6)
    assert_bit_identical(got, ref)
    s = ctx.stats()
    assert s["iterations_in_place"] == 0 and s["budget_evictions"] > 0
    assert s["peak_resident_bytes"] <= peak * 3 // 4


def test_a_backward_through_an_older_graph_does_not_end_the_iteration():
    """A tensor kept in place by an earlier iteration, read in a backward during this one,
    is not this iteration's: only its own tensors' backward ends it."""
    ctx = swap()
    lin = nn.Linear(16, 16)
    with ctx:
        warm_up(ctx, lin)
        old = lin(torch.randn(8, 16)).exp().sum()   # kept in place under batch 8's plan
        old.backward(retain_graph=True)             # kept past its iteration
        warm_up(ctx, lin, 16)                       # batch 16: a plan of its own
        before = ctx.stats()["iterations"]
        y = lin(torch.randn(16, 16)).exp().sum()    # this iteration's forward
        old.backward()                              # an earlier iteration's graph
        assert ctx.stats()["iterations"] == before and ctx._seq.in_place.on
        y.backward()
        assert ctx.stats()["iterations"] == before + 1
    assert ctx.stats()["iterations_in_place"] == 2


def test_exiting_after_leaving_in_place_keeps_counting_what_was_kept():
    """The context exits in an iteration that left in place partway: what it kept stays
    counted until it dies (exit's resync must not drop it)."""
    ctx = swap(budget=1 << 20)
    lin = nn.Linear(16, 16)
    with ctx:
        warm_up(ctx, lin)
        outs = [lin(torch.randn(8, 16)).exp() for _ in range(2)]   # the second leaves
        held = ctx.stats()["resident_bytes"]
        assert held > 0 and not ctx._seq.in_place.on
    assert ctx.stats()["resident_bytes"] >= held
    del outs
    assert ctx.stats()["resident_bytes"] == 0


def test_an_interrupt_between_a_death_and_its_count_is_mended(monkeypatch):
    """A Ctrl-C inside the runtime's bookkeeping of a kept tensor's death (after the death was
    taken, before the bytes were uncounted) must not leave those bytes charged for good: the
    next iteration's end, or the exit, counts again from what is still held."""
    from scheduler.runtime.swap_stats import Residency
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6))
    real = Residency.set_unmanaged
    calls = {"n": 0, "armed": False}

    def interrupted(self, nbytes):
        if calls["armed"]:
            calls["n"] += 1
            if calls["n"] == 2:   # the second: the uncounting of the outgrown iteration's bytes
                raise KeyboardInterrupt
        return real(self, nbytes)

    monkeypatch.setattr(Residency, "set_unmanaged", interrupted)
    ctx = swap(budget=10_000_000)
    with ctx:
        for i in range(10):
            x = torch.randn(16, 64)
            calls["armed"] = i == 5
            try:
                h = x
                for blk in blocks[:6 if i == 5 else 4]:   # step 5 outgrows the plan
                    h = blk(h)
                h.square().mean().backward()
            except KeyboardInterrupt:
                pass
            calls["armed"] = False
        assert calls["n"] >= 2
    s = ctx.stats()
    assert s["resident_bytes"] == 0 and ctx._residency.unmanaged == 0
    assert not ctx._seq.in_place.held



# ------------------------------------------------------------- under a pressure callback
def pressed_at(fake, ctx, steps, where):
    """A forward hook for ``train``'s model that asks ``fake``'s pressure callback for 1 MiB in
    the given steps (counted by the hook's calls: one per forward); it records
    ``(step, freed, resident before, resident after, storages on the host)``."""
    calls = []

    def hook(module, args, out):
        step = len(calls)
        if step in steps:
            before = ctx.stats()["resident_bytes"]
            freed = fake.callback(1 << 20)
            # per storage evicted: its bytes, and those its tensors have now
            on_host = [(g.nbytes, [r().untyped_storage().nbytes() for r in g.members])
                       for g in ctx._seq.in_place.evictor.on_host.values()]
            calls.append((step, freed, before, ctx.stats()["resident_bytes"], on_host))
        else:
            calls.append((step, None))
    return calls, hook


def train_pressed(steps, pressed, where=4, build=mlp):
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    seen, check = per_step(ctx, ("iterations_in_place", "in_place_evicted_bytes",
                                 "plan_mismatches", "resident_bytes"))
    calls = []

    def build_hooked():
        model = build()
        nonlocal calls
        calls, hook = pressed_at(fake, ctx, pressed, where)
        model[where].register_forward_hook(hook)
        return model
    got = train(build_hooked, batch_mlp, ctx=ctx, steps=steps, check=check)
    return ctx, got, seen, calls


def test_a_pressure_callback_still_keeps_in_place():
    """vmalloc's allocator (or one given) may ask for room: tensors kept in place can still
    be evicted (``swap_in_place_pressure``), so iterations are kept in place under it too."""
    ref = train(mlp, batch_mlp, steps=6)
    ctx, got, seen, calls = train_pressed(6, pressed=())
    assert_bit_identical(got, ref)
    s = ctx.stats()
    assert s["iterations_in_place"] == 3 and s["in_place_evicted_bytes"] == 0
    assert s["pressure_calls"] == 0 and s["resident_bytes"] == 0


def test_pressure_in_an_iteration_kept_in_place_evicts_kept_tensors():
    """Step 3 is kept in place; in its forward the allocator runs short. The callback evicts
    the kept storages only the graph holds (the ReLU's output, oldest first), to the host:
    their tensors stay, with no bytes, and the backward brings them back. Gradients equal plain
    training's; the iteration left in place there and is not planned; its plan is kept in
    place again only after a streak of 4 (steps 4-5 are tracked)."""
    ref = train(mlp, batch_mlp, steps=6)
    ctx, got, seen, calls = train_pressed(6, pressed={3})
    assert_bit_identical(got, ref)
    step, freed, before, after, on_host = calls[3]
    assert freed is True and on_host
    # the storages evicted had bytes; their tensors are alive (the graph holds them), with none
    assert all(n > 0 and now == [0] * len(now) and now for n, now in on_host)
    evicted = sum(n for n, _ in on_host)
    assert after == before - evicted
    assert [p["iterations_in_place"] for p in seen] == [0, 0, 0, 0, 0, 0]
    assert seen[3]["in_place_evicted_bytes"] == evicted
    assert seen[3]["plan_mismatches"] == seen[2]["plan_mismatches"] + 1   # not planned
    s = ctx.stats()
    assert s["pressure_calls"] == 1 and s["pressure_freed_bytes"] == evicted
    assert not ctx._seq.active.in_place_refused and ctx._seq.active.in_place_after == 4
    assert not ctx._seq.in_place.evictor.on_host and s["resident_bytes"] == 0


def test_after_pressure_the_plan_is_kept_in_place_again_after_a_longer_streak():
    """A spike (a cuDNN workspace) made an iteration kept in place leave: the fast path comes
    back after 4 followed iterations, after 8 once a second spike made another leave (it was
    refused for good once: a single spike cost the rest of the training); gradients equal."""
    ref = train(mlp, batch_mlp, steps=20)
    ctx, got, seen, calls = train_pressed(20, pressed={3, 8})
    assert_bit_identical(got, ref)
    assert [c[1] for c in calls if c[1] is not None] == [True, True]
    done = [p["iterations_in_place"] for p in seen]
    # 0-2 followed; 3 in place, leaves (pressure); 4-7 followed; 8 in place, leaves
    # (pressure); 9-16 followed; 17-19 in place
    assert [b - a for a, b in zip([0] + done, done)] == [0] * 17 + [1, 1, 1]
    assert ctx._seq.active.in_place_after == 8 and not ctx._seq.active.in_place_refused


def test_the_wait_after_pressure_comes_down_after_a_long_run_in_place():
    """One spike (step 3) doubles the wait to 4; twice that many iterations kept in place in
    a row (8-15) halve it back to 2, so the next spike (step 20) doubles it to 4, not 8:
    a rare spike costs less each time, while steady pressure keeps it high."""
    ref = train(mlp, batch_mlp, steps=24)
    ctx, got, seen, calls = train_pressed(24, pressed={3, 20})
    assert_bit_identical(got, ref)
    done = [p["iterations_in_place"] for p in seen]
    # 0-2 followed; 3 leaves; 4-7 followed; 8-19 in place (the wait halves at 15, no pause);
    # 20 leaves (pressure); 21-23 followed (3 < the wait of 4)
    assert [b - a for a, b in zip([0] + done, done)] == [0] * 8 + [1] * 12 + [0] * 4
    assert ctx._seq.active.in_place_after == 4 and not ctx._seq.active.in_place_refused


def test_a_run_in_place_is_counted_from_the_last_pressure():
    """The 6 iterations kept in place before the second spike do not count towards halving
    the wait it doubled (8): 11 kept in place after it are fewer than 16."""
    ref = train(mlp, batch_mlp, steps=34)
    ctx, got, seen, calls = train_pressed(34, pressed={3, 14})
    assert_bit_identical(got, ref)
    # 3 leaves: wait 4; 4-7 followed; 8-13 in place; 14 leaves: wait 8; 15-22 followed;
    # 23-33 in place
    assert ctx._seq.active.in_place_after == 8


def test_a_kept_tensor_the_program_holds_is_not_evicted():
    """The batch (held by the loop) and the Tanh's output (read by the Linear whose forward
    runs) are saved too: evicting them would free nothing; they keep their bytes."""
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    model = mlp()
    seen = {}

    def hook(module, args, out):
        if ctx._seq.in_place.on:
            seen["freed"] = fake.callback(1 << 30)   # more than there is: all it can
            seen["input"] = args[0].untyped_storage().nbytes()
    model[4].register_forward_hook(hook)
    x = batch_mlp(0)[0]
    with ctx:
        for _ in range(4):
            model(x).square().mean().backward()
    assert seen["freed"] is True and seen["input"] > 0
    assert x.untyped_storage().nbytes() > 0
    assert ctx.stats()["in_place_evicted_bytes"] > 0


class ReadsThenAsks(torch.autograd.Function):
    """Its backward reads what it saved (its input, and a mask that needs no gradient, as
    dropout's), then asks the allocator for room (a backward's output allocation under
    pressure), then computes with what it read."""
    fake = None

    @staticmethod
    def forward(ctx, x):
        mask = (x > 0).to(x.dtype)   # (made from a tensor, not autograd's: no history)
        ctx.save_for_backward(x, mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        x, mask = ctx.saved_tensors
        ReadsThenAsks.fake.callback(1 << 30)
        return g * mask + x * 0


def test_pressure_during_a_backward_spares_the_tensors_its_node_reads():
    """In the backward of an iteration kept in place, the node running has read its saved
    tensors: the pressure callback it triggers must not evict them (the node holds tensors of
    its own on their storages: autograd would hand it our very tensor for the mask, which needs
    no gradient; evicted, the node read a storage of no bytes and crashed), but may evict the
    kept tensors the backward has yet to read, which come back at their unpack. Gradients
    equal plain training's."""
    class Quiet:
        callback = staticmethod(lambda n: False)

    def run(fake):
        torch.manual_seed(0)
        layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        grads = []
        for step in range(5):
            ReadsThenAsks.fake = fake if step == 4 else Quiet
            h = batch_mlp(step)[0]
            for i, lin in enumerate(layers):
                h = torch.tanh(lin(h))
                if i == 2:
                    h = ReadsThenAsks.apply(h)
            h.square().mean().backward()
            grads.append([p.grad.clone() for p in layers.parameters()])
            layers.zero_grad(set_to_none=True)
        return grads

    ref = run(Quiet)
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    with ctx:
        got = run(fake)
    for a, b in zip(got, ref):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    s = ctx.stats()
    assert s["iterations_in_place"] == 1 and s["pressure_calls"] == 1
    assert s["in_place_evicted_bytes"] > 0 and s["resident_bytes"] == 0


def test_pressure_in_a_tracked_iteration_delays_keeping_in_place():
    """An iteration that met pressure does not count towards the two that let the next be
    kept in place: its plan did not fit the device as it was."""
    ctx, got, seen, calls = train_pressed(7, pressed={2})
    assert [p["iterations_in_place"] for p in seen] == [0, 0, 0, 0, 0, 1, 2]


def test_host_copies_of_a_graph_that_dies_unread_are_dropped():
    """Kept tensors evicted in a forward whose graph is then dropped (no backward): their host
    copies go with the graph; nothing stays counted."""
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    lin, act = nn.Linear(16, 64), nn.Linear(64, 16)
    with ctx:
        for _ in range(3):
            act(torch.tanh(lin(torch.randn(8, 16)))).exp().sum().backward()
        assert ctx._seq.in_place.on
        out = act(torch.tanh(lin(torch.randn(8, 16)))).exp().sum()
        assert fake.callback(1 << 20) is True
        assert ctx._seq.in_place.evictor.on_host
        del out
        act(torch.tanh(lin(torch.randn(8, 16)))).exp().sum().backward()
        assert not ctx._seq.in_place.evictor.on_host
    assert ctx.stats()["resident_bytes"] == 0 and ctx._residency.unmanaged == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 6),
                          st.sampled_from([1, 4096, 1 << 30])), max_size=6),
       st.lists(st.sampled_from([8, 16]), min_size=8, max_size=8))
def test_property_pressure_anywhere(asks, sizes):
    """Pressure at any layer's forward of any step (``(step, layer, bytes asked)``), over any
    batch sizes: whatever was evicted, tracked or kept in place, gradients equal plain
    training's and nothing stays counted or on the host after the last step."""
    ref = train(mlp, batch_mlp, steps=len(sizes), sizes=sizes)
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    step = {"i": -1}

    def build():
        model = mlp()
        model[0].register_forward_pre_hook(lambda m, a: step.update(i=step["i"] + 1))
        for layer in range(len(model)):
            def ask(module, args, out, layer=layer):
                for s, at, nbytes in asks:
                    if (s, at) == (step["i"], layer):
                        fake.callback(nbytes)
            model[layer].register_forward_hook(ask)
        return model
    got = train(build, batch_mlp, ctx=ctx, steps=len(sizes), sizes=sizes)
    assert_bit_identical(got, ref)
    s = ctx.stats()
    assert s["resident_bytes"] == 0 and ctx._residency.unmanaged == 0
    assert not ctx._seq.in_place.evictor.on_host
    assert s["pressure_calls"] == len(asks)   # (every step and layer asked for runs)


def test_pressure_in_a_backward_before_it_reads_a_kept_tensor_still_ends_the_iteration():
    """A node that runs first in the backward (before any kept tensor is read) meets pressure:
    the iteration leaves in place there, and its backward still ends it (it once ran on into
    the next step's forward, one iteration short for good)."""
    class AskFirst(torch.autograd.Function):
        fake = None

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if AskFirst.fake is not None:
                AskFirst.fake.callback(1 << 30)
            return g

    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    model = mlp()
    counts = []
    with ctx:
        for i in range(7):
            x, y = batch_mlp(i)
            AskFirst.fake = fake if i == 3 else None
            loss = AskFirst.apply(nn.functional.cross_entropy(model(x), y))
            loss.backward()
            counts.append(ctx.stats()["iterations"])
    assert counts == [1, 2, 3, 4, 5, 6, 7]
    s = ctx.stats()
    assert s["in_place_evicted_bytes"] > 0 and s["resident_bytes"] == 0


def test_an_interrupt_in_a_restore_brings_the_right_bytes_back(monkeypatch):
    """A Ctrl-C between a restore's growing the storage and its copy: the retry copies the
    bytes in (it once took the storage for one never evicted and read uninitialised memory)."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 256)
    x = torch.randn(8, 16)

    def loss():
        return lin(x).exp().sum()   # its backward reads exp's result: only autograd holds it
    ref = torch.autograd.grad(loss(), lin.weight)[0]
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    real = torch.UntypedStorage.copy_
    armed = {"on": False}

    def cut(self, src, *args):
        if armed["on"] and src.device.type == "cpu" and self.nbytes():
            armed["on"] = False
            raise KeyboardInterrupt
        return real(self, src, *args)
    monkeypatch.setattr(torch.UntypedStorage, "copy_", cut)
    with ctx:
        for _ in range(3):
            loss().backward()
        lin.zero_grad()
        out = loss()
        assert fake.callback(1 << 30) is True
        armed["on"] = True
        with pytest.raises(KeyboardInterrupt):
            out.backward()
        assert not armed["on"]
        lin.zero_grad()
        out.backward()   # (its sum's node saved nothing: the graph is whole)
    assert torch.equal(lin.weight.grad, ref)


def test_host_copies_die_with_their_graph_after_the_context_exits():
    """The host copy of an evicted kept tensor hangs on the tensor: a graph that dies unread
    after the context exited takes it along (no call into the runtime needed)."""
    import weakref
    from scheduler.runtime.swap_in_place_pressure import HOST
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    lin = nn.Linear(16, 256)
    with ctx:
        for _ in range(3):
            lin(torch.randn(8, 16)).exp().sum().backward()
        out = lin(torch.randn(8, 16)).exp().sum()
        assert fake.callback(1 << 30) is True
        kept = [r() for g in ctx._seq.in_place.evictor.on_host.values() for r in g.members]
        hosts = [weakref.ref(t.__dict__[HOST]) for t in kept]
        del kept
    assert hosts and all(h() is not None for h in hosts)
    del out
    assert all(h() is None for h in hosts)


def test_pressure_in_an_iteration_kept_in_place_restarts_the_streak():
    """Pressure before an iteration kept in place kept anything (nothing of it to evict) lets
    it stay in place, but it does not count towards the next: two iterations without pressure
    come first."""
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    lin = nn.Linear(16, 64)
    seen = []
    with ctx:
        for i in range(8):
            if i in (3, 6):
                assert ctx._seq.in_place.on and fake.callback(1) is False
            lin(torch.randn(8, 16)).exp().sum().backward()
            seen.append(ctx.stats()["iterations_in_place"])
    assert seen == [0, 0, 0, 1, 1, 1, 2, 2]


def test_pressure_after_the_last_pack_still_lets_the_backward_end_the_iteration():
    """Pressure between the forward's last saved tensor and the backward (the loss's last
    allocation, backward's gradient seed): the iteration leaves in place with nothing tracked
    after, and its backward, reading only kept tensors, still ends it."""
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    lin = nn.Linear(16, 256)
    counts = []
    with ctx:
        for i in range(7):
            out = lin(torch.randn(8, 16)).exp().sum()
            if i == 3:
                assert ctx._seq.in_place.on and fake.callback(1 << 30) is True
            out.backward()
            counts.append(ctx.stats()["iterations"])
    assert counts == [1, 2, 3, 4, 5, 6, 7]
    assert ctx.stats()["resident_bytes"] == 0


def test_an_interrupt_right_after_the_shrink_still_brings_the_bytes_back(monkeypatch):
    """A Ctrl-C as ``resize_(0)`` returns, before the eviction is done: the backward copies the
    bytes back (it once took the storage for one never shrunk and read nothing)."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 256)
    x = torch.randn(8, 16)

    def loss():
        return lin(x).exp().sum()
    ref = torch.autograd.grad(loss(), lin.weight)[0]
    real = torch.UntypedStorage.resize_
    armed = {"on": False}

    def cut(self, n):
        out = real(self, n)
        if armed["on"] and n == 0:
            armed["on"] = False
            raise KeyboardInterrupt
        return out
    monkeypatch.setattr(torch.UntypedStorage, "resize_", cut)
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    with ctx:
        for _ in range(3):
            loss().backward()
        lin.zero_grad()
        out = loss()
        armed["on"] = True
        with pytest.raises(KeyboardInterrupt):
            fake.callback(1 << 30)
        out.backward()
    assert torch.equal(lin.weight.grad, ref)


def hooked_like_vmalloc(monkeypatch):
    """A context whose tracked packs hook a fake "vmalloc" allocator per device, as they hook
    vmalloc's on a GPU (``_hook_pressure``): ``(context, allocator)``."""
    import scheduler.runtime.swap as swap_mod
    fake = FakeAllocator()
    monkeypatch.setattr(swap_mod, "_find_vmalloc_allocator", lambda device: fake)
    ctx = swap()
    real = ctx._pack_locked

    def pack_locked(t, storage, nbytes):
        ctx._hook_pressure(t.device)
        return real(t, storage, nbytes)
    monkeypatch.setattr(ctx, "_pack_locked", pack_locked)
    return ctx, fake


def test_a_context_entered_again_hooks_vmalloc_again(monkeypatch):
    """vmalloc's allocator is hooked at the first tracked pack on its device; exiting unhooks
    it. Entered again while iterations are kept in place (nothing tracked), the context hooks it
    again at once: without it a kept iteration would meet an out-of-memory with no rescue."""
    ctx, fake = hooked_like_vmalloc(monkeypatch)
    lin = nn.Linear(16, 256)
    for epoch in range(2):
        with ctx:
            for _ in range(4):
                lin(torch.randn(8, 16)).exp().sum().backward()
                assert fake.callback is not None
        assert fake.callback is None
    assert ctx.stats()["iterations_in_place"] == 1 + 4


def test_another_threads_pressure_never_takes_what_a_node_reads():
    """A thread allocating under vmalloc (a prefetching loader) may call the pressure callback
    while a backward reads a kept tensor: the node's own tensor is made before anything else,
    so the storage it reads is held from then on. Gradients equal plain training's."""
    import threading
    fake = FakeAllocator()
    ctx = swap(allocator=fake)
    stop = threading.Event()
    errors = []

    def presser():
        while not stop.is_set():
            try:
                fake.callback(1 << 30)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    xs = [torch.randn(32, 64) for _ in range(12)]
    ref = []
    for x in xs:
        ref.append(torch.autograd.grad(model(x).square().sum(), list(model.parameters())))
    got = []
    with ctx:
        for x in xs[:4]:   # tracked, then kept in place
            got.append(torch.autograd.grad(model(x).square().sum(), list(model.parameters())))
        t = threading.Thread(target=presser)
        t.start()
        try:
            for x in xs[4:]:
                got.append(torch.autograd.grad(model(x).square().sum(),
                                               list(model.parameters())))
        finally:
            stop.set()
            t.join()
    assert not errors
    for a, b in zip(got, ref):
        assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_pressure_from_another_device_takes_nothing_here(monkeypatch):
    """vmalloc's allocator of one device asks for room there: saved tensors on another device,
    tracked or kept in place, would free nothing on it and are left alone (each device's
    allocator gets a callback bound to its device)."""
    ctx, fake = hooked_like_vmalloc(monkeypatch)
    lin = nn.Linear(16, 256)
    other = torch.device("cuda", 1)
    asked = []
    with ctx:
        for i in range(4):
            out = lin(torch.randn(8, 16)).exp().sum()
            if i == 3:   # kept in place: it stays so
                assert ctx._seq.in_place.on
                asked.append(ctx._on_pressure(1 << 30, device=other))
                assert ctx._seq.in_place.on
            out.backward()
        for i in range(2):   # (the streak starts again: pressure there too)
            lin(torch.randn(8, 16)).exp().sum().backward()
        out = lin(torch.randn(8, 16)).exp().sum()
        asked.append(ctx._on_pressure(1 << 30, device=other))   # in place again: nothing
        assert fake.callback.keywords == {"device": torch.device("cpu")}
        assert fake.callback(1 << 30) is True   # this device's
        out.backward()
    s = ctx.stats()
    assert asked == [False, False]
    assert s["pressure_calls"] == 3 and s["iterations_in_place"] == 1
    assert s["pressure_freed_bytes"] == s["in_place_evicted_bytes"] > 0   # this device's call


def test_tracked_saved_tensors_of_another_device_are_not_swapped_out_for_pressure():
    ctx = swap()
    lin = nn.Linear(16, 256)
    with ctx:
        x = lin(torch.randn(8, 16)).exp()   # the first iteration: tracked
        y = x.exp().sum()
        assert ctx._on_pressure(1 << 30, device=torch.device("cuda", 1)) is False
        assert ctx.stats()["pressure_freed_bytes"] == 0
        assert ctx._on_pressure(1 << 30, device=torch.device("cpu")) is True
        y.backward()
    assert ctx.stats()["pressure_freed_bytes"] > 0
