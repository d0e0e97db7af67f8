"""The op tracer holds no tensor (``profile.op_tracer``): a traced stage's intermediates and
gradients are freed as they would be untraced, and a stage measured on the CPU leaves nothing
behind for Python's collector (it once held every tensor a trace saw, and each stage's saved
tensors until a collection: a profiling step of a tiny GPT-2 peaked at 1.7x plain training).
Freed storages' addresses are then reused within one trace: the tracer must still tell each
storage apart, so its numbers are those of a tracer that holds every storage (no address reused),
which it falls back to on a torch without PyObject preservation of storages."""
from __future__ import annotations

import weakref
from typing import Callable, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from scheduler.profile import _trace as T
from scheduler.profile import measure_chain, op_tracer
from scheduler.profile.op_tracer import OpTracer
from scheduler.profile.storage import storage_key

from wrap_models import one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture
def holding(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Switch the tracer to the fallback that holds every storage it sees."""
    return lambda: monkeypatch.setattr(op_tracer, "_storages_preserved", lambda: False)


# ------------------------------------------------------------------------------ (a) nothing held
def test_an_intermediate_is_freed_during_the_trace(no_gc):
    x = torch.randn(1000)
    with OpTracer():
        y = x * 2
        ref = weakref.ref(y.untyped_storage())
        z = y.sin()
        del y
        assert ref() is None, "the tracer kept a traced op's output alive"
        del z


class _Spy(nn.Module):
    """Notes weak references to its intermediates' storages."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)
        self.refs: List[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = F.gelu(h)  # saved by b's matmul and by gelu's backward
        self.refs += [weakref.ref(t.untyped_storage()) for t in (h, g)]
        return self.b(g) + x


def _trace(block: nn.Module, x: torch.Tensor) -> Tuple[T.Tensors, dict]:
    inputs = T.fresh_inputs((x,), True)
    return T.trace_stage(lambda xs: T.call_block(block, xs, 0), inputs,
                         list(block.parameters()), set(), cuda_dropout=False, flops=False)


def test_a_traced_stage_leaves_nothing_for_the_collector(no_gc):
    block, x = _Spy(), torch.randn(8, 16)
    _trace(block, x)  # (a first trace imports lazily: an import's frames may outlive it)
    block.refs.clear()
    outputs, _ = _trace(block, x)  # (held, as the profilers hold a stage's outputs)
    alive = [ref() is not None for ref in block.refs]
    assert alive and not any(alive), \
        f"storages of the stage's intermediates alive after its trace: {alive}"


# ------------------------------------------------------------------------- (b) same numbers
def test_a_reused_address_is_another_storage():
    """Each iteration frees a large temporary, then makes a small value kept to the end,
    which mostly takes the temporary's address: the temporary is still not kept, nor the
    kept value large. The peaks are worked out by hand."""
    k, n = 64, 10
    x = torch.randn(n * k)
    kept: List[torch.Tensor] = []
    keys: List[int] = []
    tr = OpTracer()
    with tr:
        for i in range(n):
            t = x.sin()  # n k floats, freed at once
            keys.append(storage_key(t))
            del t
            kept.append(x[:k].cos())  # k floats, kept
            keys.append(storage_key(kept[-1]))
    assert len(set(keys)) < len(keys), "no address was reused: nothing tested"
    kept_keys = {storage_key(t) for t in kept}
    # at the last sin: its output, and the kept values made before it
    assert tr.peak_live(skip=set(), keep=kept_keys) == 4 * k * (n + n - 1)
    # the kept values left out (a stage's outputs): one temporary at a time
    assert tr.peak_live(skip=kept_keys) == 4 * k * n


# a small program of ops on 1-D tensors: (kind, a, b) with a, b picking among the live values
_STEP = st.tuples(st.sampled_from(["sin", "mul", "cat", "view", "inplace", "free", "sum"]),
                  st.integers(0, 50), st.integers(0, 50))


def _run(program: List[Tuple[str, int, int]], outs: int, kept: int) -> Tuple[int, ...]:
    torch.manual_seed(0)
    x = torch.randn(64)
    live = [x]
    tr = OpTracer()
    with tr:
        for kind, a, b in program:
            u, v = live[a % len(live)], live[b % len(live)]
            if kind == "sin":
                live.append(u[: 1 + b % u.numel()].sin())
            elif kind == "mul":
                n = min(u.numel(), v.numel())
                live.append(u[:n] * v[:n])
            elif kind == "cat":
                live.append(torch.cat([u, v]))
            elif kind == "view":
                live.append(u[b % u.numel():])
            elif kind == "inplace" and u is not x:
                u.mul_(1.5)
            elif kind == "free" and len(live) > 1:
                del live[1 + a % (len(live) - 1)]
            elif kind == "sum":
                live.append(u.sum().reshape(1))
    del u, v
    skip = {storage_key(t) for t in live[-outs:]} if outs else set()
    keep = {storage_key(t) for t in live[1:1 + kept]}
    return (len(tr.ops), tr.traffic, tr.peak_live(skip=set()), tr.peak_live(skip=skip),
            tr.peak_live(skip=skip, keep=keep), tr.peak_live(skip=set(), keep=keep))


@settings(max_examples=60, deadline=None)
@given(st.lists(_STEP, min_size=1, max_size=40), st.integers(0, 3), st.integers(0, 3))
def test_the_numbers_are_those_of_a_tracer_holding_every_storage(program, outs, kept):
    weak = _run(program, outs, kept)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(op_tracer, "_storages_preserved", lambda: False)
        held = _run(program, outs, kept)
    assert weak == held


class _Churn(nn.Module):
    """Many temporaries of one size, freed and made again: addresses reused in one trace."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        acc = h
        for i in range(4):
            t = torch.sin(h + i)
            acc = acc + (t * t).cos()
        return acc


class _Inplace(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(d, d), nn.Linear(d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y.mul_(2)  # (addmm saves its inputs, not its output)
        return self.drop(F.relu(self.b(F.relu(y, inplace=True)), inplace=True)) + x


class _Pass(nn.Module):
    """Returns its input beside a view of a new value."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return x, torch.tanh(self.a(x)).view(x.shape)


class _Join(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * y


def _blocks() -> List[nn.Module]:
    torch.manual_seed(0)
    return [_Churn(), _Inplace(), _Pass(), _Join(), nn.Identity(), _Churn()]


def _numbers(chain) -> dict:
    return {k: list(getattr(chain, k)) for k in ("x", "xbar", "delta", "fw_tmp", "bw_tmp",
                                                  "fck_tmp")}


def test_measured_chains_are_those_of_a_tracer_holding_every_storage(holding):
    x = torch.randn(4, 8, 24)
    weak = _numbers(measure_chain(_blocks(), x, loss="sum", repeat=1, warmup=0))
    holding()
    held = _numbers(measure_chain(_blocks(), x, loss="sum", repeat=1, warmup=0))
    assert weak == held


def test_meta_chains_are_those_of_a_tracer_holding_every_storage(holding):
    from scheduler.profile import meta_chain
    weak = meta_chain(_blocks(), (4, 8, 24), loss="sum")
    holding()
    held = meta_chain(_blocks(), (4, 8, 24), loss="sum")
    assert _numbers(weak) == _numbers(held)
    assert list(weak.fw) == list(held.fw) and list(weak.bw) == list(held.bw)  # (bytes moved)
