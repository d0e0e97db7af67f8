"""Forward-only graphs that overlap (an evaluation loop that forgot ``no_grad``: ``out =
model(x)`` each batch, the old graph dies only after the next forward) never free every saved
tensor of the running iteration at once, so no pack started a new one: after 3000 batches the
recording held 24000 events and the next backward planned them (6.6 s). Such a recording (no
backward, mostly dead, as long as the longest plan known) is dropped now; a long forward whose
tensors are all alive (a model called many times before one backward), gradient accumulation
and retain_graph are recorded and planned as before."""
import contextlib

import torch
from torch import nn

import scheduler
from scheduler.runtime.swap_sequence import DEAD_RECORDING_EVENTS


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())])


def batch(i):
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(i))


def swap():
    return scheduler.swap(window="1MiB", budget=64 << 10, device="cpu")


def test_an_eval_loop_without_no_grad_keeps_the_recording_bounded():
    model = build()
    ctx = swap()
    with ctx:
        model(batch(0)).sum().backward()  # one training step: a plan exists
        per_batch = len(ctx.last_entry.expected)
        most = 0
        last = None
        for i in range(1, 400):
            last = model(batch(i))  # the previous batch's graph dies after this forward
            most = max(most, len(ctx._seq.events))
        del last
        assert most <= DEAD_RECORDING_EVENTS + 2 * per_batch  # was 8 events a batch, for good
        assert ctx.stats()["iterations"] > 1
        model(batch(0)).sum().backward()  # the next training step plans a bounded sequence
        assert len(ctx.last_recorded) <= DEAD_RECORDING_EVENTS + 2 * per_batch
    assert ctx.stats()["live_variables"] == 0


def run(ctx, step, steps=3):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    grads = []

    def loop():
        for i in range(steps):
            step(model, i)
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()

    with ctx if ctx is not None else contextlib.nullcontext():
        loop()
    return grads


def called_many_times(model, i):
    # 200 forwards of the model before one backward: > DEAD_RECORDING_EVENTS events, all alive
    sum(model(batch(100 * i + k)).square().mean() for k in range(200)).backward()


def accumulated(model, i):
    for k in range(4):
        model(batch(10 * i + k)).square().mean().backward()


def retained(model, i):
    loss = model(batch(i)).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()


def eval_between(model, i):
    last = None
    for k in range(150):  # overlapping forward-only graphs: dropped recordings
        last = model(batch(1000 + k))
    del last
    model(batch(i)).square().mean().backward()


def test_long_forwards_accumulation_and_retain_graph_are_planned_as_before():
    for step, plans in ((called_many_times, 1), (accumulated, 1), (retained, 1),
                        (eval_between, None)):
        ctx = swap()
        got = run(ctx, step)
        ref = run(None, step)
        assert all(torch.equal(a, b) for ga, gb in zip(got, ref) for a, b in zip(ga, gb))
        st = ctx.stats()
        if plans is not None:  # one sequence, planned once and followed since
            assert st["plans_computed"] == plans and st["plan_mismatches"] == 0, step
        assert st["live_variables"] == 0
