"""The swap runtime's stream ordering, on the CPU with a fake ``torch.cuda``.

On the CPU every copy is done when it returns, so a read that skips the wait for a swap-in's
copy, or a storage let go while a swap-out's copy still reads it, goes unnoticed; on a GPU the
first gives whatever the memory held (silently wrong gradients), the second a copy of memory
handed out again. Here the runtime runs its CUDA code over CPU tensors: fake side streams and
events, and a host-to-device copy that lands only once a stream waits for its event (or the
event is synchronized): until then the memory holds garbage. The fake logs every wait and
``record_stream``; each read of swapped-in bytes must come after a wait for their copy (or the
copy's end), from every stream that reads them, and with that stream recorded.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

import scheduler
from scheduler.planners.swap_schedule import DEVICE, STATE_NAMES, SwapSchedule
from scheduler.runtime import swap as swap_mod
from scheduler.runtime import swap_transfers
from scheduler.runtime.swap_stats import Residency, new_counters
from scheduler.runtime.swap_vars import Handle, Var

GARBAGE = 0x7F  # what swapped-in memory holds until its copy lands


class FakeStream:
    """A side or compute stream: ``role`` is "out"/"in" for the runtime's pair (it makes them
    in that order, ``SwapTransfers.streams_for``), the name given otherwise."""

    made = 0

    def __init__(self, device: Any = None, name: Optional[str] = None):
        if name is None:
            FakeStream.made += 1
            name = "out" if FakeStream.made % 2 else "in"
        self.role = self.name = name
        self.unrecorded: List["_Copy"] = []  # copies issued since the last event recorded

    def wait_stream(self, other: Any) -> None:
        LOG.append(("wait_stream", self, other))

    def wait_event(self, event: "FakeEvent") -> None:
        LOG.append(("wait_event", self, event))
        event.land()  # the copy's bytes are there for whoever runs after the wait

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class _Copy:
    """A host-to-device copy in flight: the bytes it writes, put in place when it lands."""

    def __init__(self, dst: torch.Tensor, data: torch.Tensor):
        self.storage = weakref.ref(dst.untyped_storage())  # (keeps no device memory alive)
        self.data = data

    def land(self) -> None:
        storage = self.storage()
        if storage is not None:
            torch.empty((0,), dtype=torch.uint8).set_(storage).copy_(self.data)


class FakeEvent:
    """Done only when synchronized (or told so): a copy that runs as long as a test wants."""

    def __init__(self, enable_timing: bool = False):
        self.done = False
        self.copies: List[_Copy] = []

    def record(self, stream: Any = None) -> None:
        stream = CURRENT[0] if stream is None else stream
        self.copies, stream.unrecorded = stream.unrecorded, []
        for c in self.copies:
            COPY_EVENTS.append((c.storage, self))

    def land(self) -> None:
        for c in self.copies:
            c.land()
        self.copies = []

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.land()
        self.done = True

    def elapsed_time(self, other: "FakeEvent") -> float:
        return 0.0


LOG: List[Tuple[Any, ...]] = []
COPY_EVENTS: List[Tuple[Any, FakeEvent]] = []  # (weakref to the swap-in's storage, its event)
DEFAULT = FakeStream(name="default")
CURRENT: List[FakeStream] = [DEFAULT]


@contextlib.contextmanager
def on_stream(stream: FakeStream):
    prev, CURRENT[0] = CURRENT[0], stream
    try:
        yield
    finally:
        CURRENT[0] = prev


def fake_copy_bytes(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    dst.copy_(src)
    stream = CURRENT[0]
    if non_blocking and stream.role == "in":  # in flight until its event is waited for
        stream.unrecorded.append(_Copy(dst, src.clone()))
        dst.view(torch.uint8).fill_(GARBAGE)


def fake_record_stream(self: torch.Tensor, stream: Any) -> None:
    LOG.append(("record", weakref.ref(self.untyped_storage()), stream))


class StreamVar(Var):
    """A var made on the stream current when the tensor was saved (as on CUDA)."""

    __slots__ = ()

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.stream = CURRENT[0]


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda``'s streams and events faked; the runtime's copies go through
    ``fake_copy_bytes``. Returns the list of stream-order faults seen at reads."""
    LOG.clear()
    COPY_EVENTS.clear()
    CURRENT[0] = DEFAULT
    FakeStream.made = 0
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: CURRENT[0])
    monkeypatch.setattr(torch.Tensor, "record_stream", fake_record_stream)
    monkeypatch.setattr(swap_transfers, "copy_bytes", fake_copy_bytes)
    monkeypatch.setattr(swap_mod, "Var", StreamVar)
    faults: List[str] = []
    ensure = swap_transfers.SwapTransfers.ensure_resident

    def checked(self, var, budget):
        ensure(self, var, budget)
        if var.in_tensor is not None:
            faults.append(f"var {var.vid} ({STATE_NAMES[var.state]}): swapped-in memory still pending "
                          "after its use")
        stream, storage = CURRENT[0], var.storage
        copy = [e for ref, e in COPY_EVENTS if ref() is storage]
        if not copy:  # not bytes a swap-in copied: nothing to wait for
            return
        event = copy[-1]
        if not (event.done or ("wait_event", stream, event) in LOG):
            faults.append(f"var {var.vid} read on {stream} before its copy landed")
        if not any(e[0] == "record" and e[1]() is storage and e[2] is stream for e in LOG):
            faults.append(f"var {var.vid} read on {stream}, which was not recorded")

    monkeypatch.setattr(swap_transfers.SwapTransfers, "ensure_resident", checked)
    yield faults
    CURRENT[0] = DEFAULT


def gpu_like(ctx: "swap_mod.SwapContext") -> "swap_mod.SwapContext":
    """A CPU context that runs its CUDA code paths (over the fakes)."""
    ctx._transfers.cuda = True
    return ctx


def plan_from(build):
    """A callable planner: ``build(steps, phases, var, si, so, rel)`` per var read in both the
    forward and the backward."""
    def planner(seq):
        n = len(seq.steps)
        si: List[List[int]] = [[] for _ in range(n)]
        so: List[List[int]] = [[] for _ in range(n)]
        rel: List[List[int]] = [[] for _ in range(n)]
        uses: Dict[int, List[int]] = {}
        for i, step in enumerate(seq.steps):
            for v in step:
                uses.setdefault(v, []).append(i)
        for v, u in uses.items():
            fwd = [i for i in u if seq.phases[i] == "F"]
            bwd = [i for i in u if seq.phases[i] == "B"]
            if fwd and bwd:
                build(max(fwd), min(bwd), v, si, so, rel)
        return SwapSchedule(tuple(map(tuple, si)), tuple(map(tuple, so)),
                            tuple(map(tuple, rel)), blocking_release=True)
    return planner


def train(model, x, ctx=None, steps=3):
    grads = []
    cm = ctx if ctx is not None else contextlib.nullcontext()
    with cm:
        for _ in range(steps):
            model.zero_grad()
            model(x).square().sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def assert_same(a, b):
    for ga, gb in zip(a, b):
        for i, (p, q) in enumerate(zip(ga, gb)):
            assert torch.equal(p, q), f"gradient of parameter {i} differs"


# ----------------------------------------------- 1. swapped in, swapped out again, then read
def test_a_swap_in_swapped_out_again_before_its_use_is_still_waited_for(fake_cuda):
    """swap_in(v) (the copy in flight), then swap_out(v) (a host copy exists: no copy, v is
    OUT with its swap-in pending), then v is read: the read waits for the copy, and the
    swapped-in memory is recorded on the reading stream."""
    def build(last_f, first_b, v, si, so, rel):
        if first_b - last_f >= 4:
            so[last_f].append(v)
            rel[last_f + 1].append(v)
            si[first_b - 2].append(v)   # swapped in two steps ahead,
            so[first_b - 2].append(v)   # then out again at once (no copy): OUT at its use

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    x = torch.randn(16, 64)
    ref = train(model, x)
    ctx = gpu_like(scheduler.swap(window="1GiB", planner=plan_from(build), device="cpu"))
    got = train(model, x, ctx)
    assert ctx.stats()["swapped_in_bytes"] > 0, "nothing swapped in: not a test of the order"
    assert not fake_cuda, fake_cuda[:4]
    assert_same(ref, got)


# ------------------------------------------------- 2. one saved tensor read from two streams
class OnStream(torch.autograd.Function):
    """``h @ w`` run on ``stream``; its backward too (as autograd runs a node on its forward
    op's stream)."""

    @staticmethod
    def forward(ctx, h, w, stream):
        ctx.stream = stream
        ctx.save_for_backward(h, w)
        return h @ w

    @staticmethod
    def backward(ctx, g):
        with on_stream(ctx.stream):
            h, w = ctx.saved_tensors
            return g @ w.t(), h.t() @ g, None


class TwoStreams(nn.Module):
    """``tanh(lin(x))`` read by two ops on two streams, then a few layers (a gap for the
    swap)."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.w1 = nn.Parameter(torch.randn(d, d) / d)
        self.w2 = nn.Parameter(torch.randn(d, d) / d)
        self.tail = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh())
                                    for _ in range(3)])
        self.s1, self.s2 = FakeStream(name="s1"), FakeStream(name="s2")

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        with on_stream(self.s1):
            y1 = OnStream.apply(h, self.w1, self.s1)
        with on_stream(self.s2):
            y2 = OnStream.apply(h, self.w2, self.s2)
        return self.tail(y1 + y2)


def test_every_stream_that_reads_a_swapped_in_tensor_waits_for_its_copy(fake_cuda):
    def build(last_f, first_b, v, si, so, rel):
        if first_b - last_f >= 3:
            so[last_f].append(v)
            rel[last_f + 1].append(v)
            si[first_b - 1].append(v)

    torch.manual_seed(0)
    model = TwoStreams()
    x = torch.randn(16, 64)
    ref = train(model, x)
    ctx = gpu_like(scheduler.swap(window="1GiB", planner=plan_from(build), device="cpu"))
    reads: List[Tuple[int, str]] = []
    ensure = swap_transfers.SwapTransfers.ensure_resident

    def logged(self, var, budget):
        ensure(self, var, budget)
        reads.append((var.vid, CURRENT[0].name))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(swap_transfers.SwapTransfers, "ensure_resident", logged)
        got = train(model, x, ctx)
    assert ctx.stats()["swapped_in_bytes"] > 0, "nothing swapped in: not a test of the order"
    # h was read from both side streams (and the default one, by tanh's backward)
    h_reads = {vid: {s for v, s in reads if v == vid} for vid, _ in reads}
    assert any({"s1", "s2"} <= streams for streams in h_reads.values()), h_reads
    assert not fake_cuda, fake_cuda[:4]
    assert_same(ref, got)


# ----------------------------------------- 3. a swap-out called off while its copy is running
@pytest.mark.parametrize("call_off", ["swap_in", "save_again"])
@pytest.mark.parametrize("drained_first", [True, False])
def test_a_called_off_swap_out_keeps_its_storage_until_the_copy_ends(fake_cuda, call_off,
                                                                     drained_first):
    """The swap-out's copy still reads the device storage when the swap-out is called off (a
    swap-in while it is OUT, or the forward saving the tensor again): the storage must
    outlive every handle until that copy's event completed, and go at the next poll after."""
    transfers = swap_transfers.SwapTransfers(False, new_counters(), Residency())
    transfers.cuda = True  # (the pool unpinned: CPU tensors)
    t = torch.randn(1024)
    storage = t.untyped_storage()
    var = StreamVar(0, 0, storage, storage.nbytes(), storage.data_ptr(), t.device)
    handle = Handle(var, t, var.keeper(storage))
    var.handles.append(weakref.ref(handle))
    transfers.residency.add(var)
    transfers.swap_out(var)
    copy = var.out_event
    assert copy is not None and not copy.query()
    if call_off == "swap_in":
        transfers.swap_in(var)
    else:
        transfers.save_again(var, storage, t._version)
    assert var.state == DEVICE
    alive = weakref.ref(storage)
    del t, storage, handle  # every handle dies (the keeper with them), the program's tensor too
    if drained_first:
        transfers.forget(var)  # the drain sees the deaths
    transfers.poll()
    assert alive() is not None, "the storage went while the swap-out's copy still reads it"
    copy.done = True
    assert alive() is not None
    transfers.poll()
    if not drained_first:
        transfers.forget(var)
    assert alive() is None, "the storage outlived its copy"
    assert not transfers.copying and not transfers.parked
