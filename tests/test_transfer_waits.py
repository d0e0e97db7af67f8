"""The chain runtime waits for every prefetch before the data is read, as CUDA needs.

On the CPU a prefetch's copy is done when ``prefetch_storage`` returns, so a read that skips
``ChainTransfers.wait`` goes unnoticed; on a GPU the copy runs on a side stream and such a read
gets whatever the memory held (silently wrong gradients). ``deferred_copies`` makes the CPU
behave like the GPU here: a prefetched storage holds garbage until ``ChainTransfers.wait`` (the
compute stream's wait on the copy's event) is called for it. Under it, plans with transfers
(written by hand, from every offloading planner, and random ones the simulator accepts) must
still give plain training's gradients bit for bit; and a prefetch must leave alone a storage
that never left the device (a value a block passed through, which later blocks still read).
"""
from __future__ import annotations

import random
from typing import List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from torch import nn

import scheduler
from scheduler import InvalidPlanError, Plan, simulate
from scheduler.planners import offload as offload_planners
from scheduler.planners import pofo
from scheduler.profile import meta_chain
from scheduler.runtime import chain_transfers

from wrap_models import one_thread  # noqa: F401  (autouse fixture)
from wrap_models import mlp_blocks, plain_step, random_rotor_plan, twins, wrapped_step

D = 16
L = 4
GARBAGE = 0x7F  # bytes a prefetched storage holds until it is waited for


class _CopyInFlight:
    """A prefetch's event: the bytes land when the compute stream waits for it."""

    def __init__(self, storage: torch.UntypedStorage, data: torch.Tensor):
        self.storage, self.data, self.done = storage, data, False

    def land(self) -> None:
        if not self.done:
            chain_transfers.storage_bytes_view(self.storage).copy_(self.data)
            self.done = True

    def query(self) -> bool:  # the pinned pool reuses the buffer once the copy is done
        return self.done

    def synchronize(self) -> None:
        self.land()


@pytest.fixture
def deferred_copies(monkeypatch):
    """Prefetches behave as on a GPU: the data is there only once waited for. Returns the
    list of (storage bytes before, whether it copied) of every prefetch the runtime issued."""
    prefetch, seen = chain_transfers.ChainTransfers.prefetch_storage, []

    def prefetch_storage(self, sc):
        before, copied = sc.storage.nbytes(), self.prefetched_bytes
        prefetch(self, sc)  # the real bookkeeping (sizes, pool, counters), a CPU copy
        copied = self.prefetched_bytes > copied
        seen.append((before, copied))
        if copied:  # the copy is in flight: the memory holds garbage until the wait
            view = chain_transfers.storage_bytes_view(sc.storage)
            sc.event = _CopyInFlight(sc.storage, view.clone())
            view.fill_(GARBAGE)

    def wait(sc):
        if isinstance(sc.event, _CopyInFlight):
            sc.event.land()
            sc.event = None

    monkeypatch.setattr(chain_transfers.ChainTransfers, "prefetch_storage", prefetch_storage)
    monkeypatch.setattr(chain_transfers.ChainTransfers, "wait", staticmethod(wait))
    return seen


def _same_as_plain(plan: Plan, make=lambda: mlp_blocks(L, D), x=None) -> None:
    blocks, ref = twins(make)
    x = torch.randn(8, D, requires_grad=True) if x is None else x
    model = scheduler.wrap(blocks, None, planner=plan)
    loss_ref, grads_ref = plain_step(ref, (x,))
    x.grad = None
    loss, grads = wrapped_step(model, (x,))
    assert torch.equal(loss, loss_ref)
    differ = [i for i, (a, b) in enumerate(zip(grads, grads_ref)) if not torch.equal(a, b)]
    assert not differ, f"gradients of parameters {differ} differ: {[(o.kind, o.stage) for o in plan]}"
    assert model.last_stats.prefetched > 0, "the plan prefetched nothing: not a test of waits"


def _chain():
    # compute slow enough next to 1 GB/s that pofo offloads rather than recomputes
    return meta_chain(mlp_blocks(L, D), (8, D), loss="mse", cuda_dropout=False, input_grad=True,
                      flops_per_s=1e8)


# each reads a prefetched value somewhere a wait had been missing (or needed)
PLANS = {
    # B 2 reads its input, xbar[1]'s output, which moved with xbar[1] and came back
    "backward-reads-prefetched-input": [
        ("F_all", 0), ("F_all", 1), ("F_all", 2), ("offload", 2), ("F_all", 3), ("F_all", 4),
        ("B", 4), ("B", 3), ("prefetch", 2), ("B", 2), ("B", 1), ("B", 0)],
    # the forward phase prefetches x[2] and the loop's call of block 2 reads it right away
    "forward-reads-prefetched-input": [
        ("F_ck", 0), ("F_ck", 1), ("offload", 2), ("prefetch", 2), ("F_all", 2), ("F_all", 3),
        ("F_all", 4), ("B", 4), ("B", 3), ("B", 2), ("F_all", 1), ("B", 1), ("F_all", 0),
        ("B", 0)],
    # a recomputation reads a prefetched checkpoint
    "recomputation-reads-prefetched-checkpoint": [
        ("F_ck", 0), ("F_ck", 1), ("offload", 1), ("F_all", 2), ("F_all", 3), ("F_all", 4),
        ("B", 4), ("B", 3), ("B", 2), ("prefetch", 1), ("F_all", 1), ("B", 1), ("F_all", 0),
        ("B", 0)],
    # a recomputed F_all reads a prefetched xbar's output
    "recomputation-reads-prefetched-xbar": [
        ("F_ck", 0), ("F_all", 1), ("offload", 2), ("F_ck", 2), ("F_all", 3), ("F_all", 4),
        ("B", 4), ("B", 3), ("prefetch", 2), ("F_all", 2), ("B", 2), ("B", 1), ("F_all", 0),
        ("B", 0)],
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_hand_written_plans_wait_for_their_prefetches(deferred_copies, name):
    plan = Plan(PLANS[name], planner=name)
    simulate(_chain(), plan, bandwidth=1e9)  # a valid plan
    _same_as_plain(plan)


@pytest.mark.parametrize("planner", ["greedy", "dynprog", "vdnn", "pofo"])
@pytest.mark.parametrize("frac", [0.0, 0.25, 0.5, 0.75])
def test_offloading_planners_plans_wait_for_their_prefetches(deferred_copies, planner, frac):
    chain = _chain()
    lo, hi = offload_planners.min_memory(chain), offload_planners.peak_memory(chain)
    memory = int(lo + frac * (hi - lo))
    try:
        plan = {"greedy": lambda: offload_planners.greedy(chain, memory, 1e9),
                "dynprog": lambda: offload_planners.dynprog(chain, memory, 1e9, slots=None),
                "vdnn": lambda: offload_planners.vdnn(chain, memory, 1e9),
                "pofo": lambda: pofo.solve(chain, memory, 1e9)}[planner]()
    except scheduler.InfeasibleError:
        pytest.skip(f"{planner} has no plan at {frac} of the range")
    if not any(op.kind == "prefetch" for op in plan):
        pytest.skip(f"{planner}'s plan at {frac} of the range has no transfers")
    _same_as_plain(plan)


def _with_random_transfers(plan: Plan, rng: random.Random) -> Plan:
    """``plan`` with one to three offload/prefetch pairs of random stages at random places."""
    ops: List[Tuple[str, int]] = [(op.kind, op.stage) for op in plan]
    for _ in range(rng.randint(1, 3)):
        s = rng.randint(1, L - 1)
        i = rng.randint(0, len(ops))
        j = rng.randint(i, len(ops))
        ops.insert(j, ("prefetch", s))
        ops.insert(i, ("offload", s))
    return Plan(ops, planner="random-transfers")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.filter_too_much])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_plans_with_transfers_wait_for_their_prefetches(deferred_copies, seed):
    deferred_copies.clear()  # (the fixture is shared by the examples)
    rng = random.Random(seed)
    plan = _with_random_transfers(random_rotor_plan(L, rng), rng)
    try:
        simulate(_chain(), plan, bandwidth=1e9)  # the reference says what a valid plan is
    except InvalidPlanError:
        assume(False)
    assume(any(op.kind == "prefetch" for op in plan))
    _same_as_plain(plan)


class _First(nn.Module):
    def __init__(self):
        super().__init__()
        self.h, self.bias = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.h(x)), self.bias(x)


class _PassesBiasOn(nn.Module):
    """Returns its second input unchanged: later blocks read that very storage."""

    def __init__(self):
        super().__init__()
        self.h = nn.Linear(D, D)

    def forward(self, h, bias):
        return torch.tanh(self.h(h)) + bias, bias


class _Last(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.Linear(D, D)

    def forward(self, h, bias):
        return torch.tanh(self.h(h)) * bias


def test_a_prefetch_leaves_a_storage_that_never_left_the_device_alone(deferred_copies):
    # x[1] = (h, bias); bias is passed through blocks 1 and 2 to block 3, so the offload of
    # x[1] must not free it, and its prefetch must not copy into it (on a GPU, resizing a
    # live storage reallocates it on the copy stream: its readers would see a copy in flight)
    plan = Plan([("F_ck", 0), ("offload", 1), ("F_ck", 1), ("F_all", 2), ("F_all", 3),
                 ("F_all", 4), ("B", 4), ("prefetch", 1), ("B", 3), ("B", 2), ("F_all", 1),
                 ("B", 1), ("F_all", 0), ("B", 0)], planner="pass-through")
    _same_as_plain(plan, lambda: [_First(), _PassesBiasOn(), _PassesBiasOn(), _Last()],
                   torch.randn(8, D))
    assert any(copied for _, copied in deferred_copies), "nothing was prefetched"
    assert all(before == 0 for before, copied in deferred_copies if copied), (
        f"a prefetch copied into a storage that was still on the device: {deferred_copies}")
