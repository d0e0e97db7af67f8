"""The model's outputs and what the caller does with them: the logits of
``loss = model(**batch).loss`` are gone before the backward (the Trainer's loop), those of
``out = model(**batch); out.loss.backward()`` live through the backward and the next step's
forward (accelerate's examples).

The tail probe (``tail.TailProbe``) counts what the tail created and returned in ``xbar[L]``,
as if it lived through the tail's backward only: too much for the first loop (GPT-2's logits,
batch x sequence x vocabulary, 1.5 GiB at 8 x 1024 in fp32: the H100 run predicted 6.62 GiB
for HF's own plan, measured 4.97 GiB), too little for the second (1.08x the prediction at the
least budget, CPU, vocabulary 1024).

So each profiling step watches the outputs the tail created that no backward node saved
(``created_outputs``: a finalizer on each storage) and, once its backward reaches the last
block's output (``on_backward``), reads which were freed before that backward began
(``Returned.gone``). ``counted`` moves their bytes from ``xbar[L]`` to the tail's forward;
those still held are counted beside every op too. The plan made at the end of the profiling
forward guesses (the first time: all dropped; later shapes: what the last backward saw): it
is used from the next step on, and a wrong guess is planned again at that step
(``ChainRunner.tail_seen``); no backward before it: planned with all held.
``outputs="dropped"`` or ``"held"`` (an option of ``scheduler.checkpoint``) says it
instead, unwatched: for a loop that holds them only now and then, or under DDP.

Where (``ChainRunner.outputs_mode``): the runner's own measurement (not Mimose's, not an
``InputAwareChain``'s) of a model that returns its loss (a loss the caller computes saves
what the tail does not see: the logits counted through the tail's backward stand for it);
watched only without ``on_chain=`` (the caller's code, maybe a collective, would run in a
backward) and without a process group (DDP hands the caller copies of the outputs).
Elsewhere the outputs count as before.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, FrozenSet, Hashable, List, Sequence, Set, Tuple

import torch

from ..chain import Chain, add_outside
from ..profile.autograd_graph import graph_nodes
from ..profile.storage import storage_bytes, storage_key


class Returned:
    """The tail's own outputs nothing saved, by position in the model's output (its tensor
    leaves): their bytes, and which storages were freed outside any backward, i.e. (read
    from within the step's backward) before it began. Freed during a backward means alive
    at its start (a term of the caller's loss saved them: a z-loss's logsumexp of the
    logits), which counts as held."""

    def __init__(self, found: Sequence[Tuple[int, torch.Tensor]]):
        self.bytes: Dict[int, int] = {i: storage_bytes([t]) for i, t in found}
        self._freed_outside: Set[int] = set()
        for i, t in found:
            # a storage's Python object lives as long as the storage (PyTorch preserves it),
            # so this runs when the memory is freed, on the thread that frees it
            weakref.finalize(t.untyped_storage(), self._freed, i).atexit = False

    def _freed(self, i: int) -> None:
        if torch._C._current_graph_task_id() == -1:   # not inside a backward
            self._freed_outside.add(i)

    def gone(self) -> FrozenSet[int]:
        """The positions freed outside any backward so far."""
        return frozenset(self._freed_outside)

    def bytes_of(self, positions: Set[int]) -> int:
        return sum(n for i, n in self.bytes.items() if i in positions)


def created_outputs(outs: Sequence[torch.Tensor], lasts: Sequence[torch.Tensor],
                    held: Set[int]) -> List[Tuple[int, torch.Tensor]]:
    """The model's outputs (``outs``, its tensor leaves) its loss was computed from in the
    tail (their autograd nodes lie between the loss's and the last block's outputs'
    ``lasts``), one per storage, bar the storages in ``held`` (what the tail saved, the
    weights, the last block's outputs) and one-element tensors (the loss, which the caller
    holds to call its backward). An output without a gradient, one the loss does not read,
    or one from before the tail (a block's hidden states) is not one of them: it stays
    counted. None at all when the model returns no loss: the caller computes it from the
    outputs, saving what the tail does not see (the log-softmax of the logits), which the
    logits counted through the tail's backward stand for, as before."""
    losses = [t.grad_fn for t in outs if t.numel() == 1 and t.grad_fn is not None]
    if not losses:
        return []
    stops = [t.grad_fn for t in lasts if t.grad_fn is not None]
    # one walk over the tail's graph; its nodes held, so that their ids stay theirs
    nodes = list(graph_nodes(losses, stops))
    inside = {id(n) for n in nodes}
    found: List[Tuple[int, torch.Tensor]] = []
    seen = set(held)
    for i, t in enumerate(outs):
        key = storage_key(t)
        if key not in seen and t.numel() > 1 and id(t.grad_fn) in inside:
            seen.add(key)
            found.append((i, t))
    return found


def counted(chain: Chain, dropped: int, held: int) -> Chain:
    """``chain``, whose ``xbar[L]`` counts the tail's outputs through the tail's backward only,
    with ``dropped`` bytes of them gone before the backward and ``held`` bytes held by the
    caller: both moved from ``xbar[L]`` to the tail's forward (``fw_tmp[L]``, ``fck_tmp[L]``);
    the held ones also counted beside every op (``add_outside``): through the whole backward,
    and through the next step's forward too (``out = model(**batch)`` binds the new output
    once that forward is over)."""
    n = dropped + held
    if n <= 0:
        return chain
    L = chain.L
    cols: Dict[str, List[int]] = {"xbar": list(chain.xbar)}
    cols["xbar"][L] -= n
    for k in ("fw_tmp", "fck_tmp"):
        col = list(getattr(chain, k)) or [0] * (L + 1)
        col[L] += n
        cols[k] = col
    tail = dict(chain.meta.get("tail") or {}, outputs={"dropped": dropped, "held": held})
    chain = chain.replace(meta={**chain.meta, "tail": tail}, **cols)
    return add_outside(chain, held) if held else chain


def on_backward(lasts: Sequence[torch.Tensor], then: Callable[[], None]) -> None:
    """Call ``then`` once, when the backward first reaches one of the last block's outputs
    (the tail's backward is over; the caller's references are what they are during it). The
    hooks stay, inert, until the graph goes (removing a hook from inside one is not safe)."""
    fired: List[bool] = []

    def hook(grad: torch.Tensor) -> None:
        if not fired:
            fired.append(True)
            then()

    for t in lasts:
        if t.requires_grad and t.grad_fn is not None:
            t.register_hook(hook)


def planned(probe: Any, runner: Any, key: Hashable, lasts: Sequence[torch.Tensor], kept: Chain,
            found: Sequence[Tuple[int, torch.Tensor]], mode: str = "watch") -> Chain:
    """The chain a profiling step of ``key`` plans on: ``kept`` (the tail's outputs ``found``
    counted through its backward only) with the outputs dropped counted in the tail's
    forward, the held ones beside every op: all of them one way where ``mode`` (the runner's
    ``outputs=``) says so; watched (``mode`` "watch"): those ``probe`` (the model's
    ``TailProbe``) last saw dropped (all, the first time), and the step's backward, reaching
    ``lasts``, tells ``runner`` what it saw."""
    if mode != "watch":
        n = sum(storage_bytes([t]) for _, t in found)
        return counted(kept, n if mode == "dropped" else 0, n if mode == "held" else 0)
    watch = Returned(found)
    every = set(watch.bytes)
    assumed = every if probe.dropped is None else probe.dropped & every

    def chain_for(gone: Set[int]) -> Chain:
        return counted(kept, watch.bytes_of(gone), watch.bytes_of(every - gone))

    # weakly: the hooks live as long as the step's graph, which must not keep the model
    probe_ref, runner_ref = weakref.ref(probe), weakref.ref(runner)

    def seen() -> None:
        me, r = probe_ref(), runner_ref()
        if me is None or r is None:
            return
        gone = set(watch.gone())
        me.dropped = gone
        r.tail_seen(key, None if gone == assumed else chain_for(gone))

    runner.tail_unverified(key, chain_for(set()))
    on_backward(lasts, seen)
    return chain_for(assumed)
