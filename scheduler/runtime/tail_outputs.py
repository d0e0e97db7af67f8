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
(``OutputsBook.seen``); no backward before it: planned with all held.
Every later step of the shape is watched the same way, cheaply (``ShapeWatch``: the outputs
at the positions the profiling step found): one the plan counted dropped that a step holds
(a logging step that keeps the logits) is planned again as held from the next step on, with
a warning where that step could have passed the budget; never back (held is the safe side).
Where no plan fits with them held, the plan stays, unwatched, and a warning says by how much
such a step can pass the budget (``OutputsBook.settle``). What backwards find (on autograd's
thread) is applied at the next forward or ``plan_for`` (``OutputsBook.take``), on the thread
that plans. ``outputs="dropped"`` or ``"held"`` (an option of ``scheduler.checkpoint``) says
it instead, unwatched: for a loop that holds them only now and then (planned held from the
start), or under DDP.

Where (``ChainRunner.outputs_mode``): the runner's own measurement (not Mimose's, not an
``InputAwareChain``'s) of a model that returns its loss (a loss the caller computes saves
what the tail does not see: the logits counted through the tail's backward stand for it);
watched only without ``on_chain=`` (the caller's code, maybe a collective, would run in a
backward) and without a process group (DDP hands the caller copies of the outputs).
Elsewhere the outputs count as before.
"""
from __future__ import annotations

import weakref
from typing import (Any, Callable, Dict, FrozenSet, Hashable, List, Optional, Sequence, Set,
                    Tuple)

import torch

from vmalloc import user_warning
from ..chain import Chain, add_outside
from ..errors import InfeasibleError
from ..profile.autograd_graph import graph_nodes
from ..profile.storage import storage_bytes, storage_key
from ..units import format_bytes
from .block_calls import tensor_leaves


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


class ShapeWatch:
    """One shape's outputs as its plans count them: ``assumed``, the positions (in the
    model's output) counted dropped, of ``bytes`` (every output the tail made that nothing
    saved, by position) on ``kept`` (the chain that counts them through the tail's backward
    only). A later step is checked in two halves: ``start`` when its last block returns (the
    hook on that block's outputs, registered while they live: a bf16 RMSNorm saves nothing of
    its input, which the tail then frees before the model returns), ``see`` when the model
    returns its outputs. An output counted dropped that the caller still holds when the
    backward begins is counted held from then on (``OutputsBook.held``), never back."""

    def __init__(self, key: Hashable, kept: Chain, sizes: Dict[int, int], assumed: Set[int]):
        self.key = key   # (its shape's plans at every budget are made again on a correction)
        self.kept = kept
        self.bytes = dict(sizes)
        self.assumed = set(assumed)

    def chain_for(self, gone: Set[int]) -> Chain:
        dropped = sum(n for i, n in self.bytes.items() if i in gone)
        return counted(self.kept, dropped, sum(self.bytes.values()) - dropped)

    def start(self, lasts: Sequence[torch.Tensor], runner: Any) -> List[Returned]:
        """Hook the backward's arrival at ``lasts`` (the last block's outputs) for this step;
        the returned list gets the model's outputs to check (``see``); left empty (the call
        never returned them: an interrupt), the hook does nothing."""
        box: List[Returned] = []
        runner_ref = weakref.ref(runner)

        def seen() -> None:
            r = runner_ref()
            if r is None or not box:
                return
            try:
                held = (self.assumed & set(box[0].bytes)) - box[0].gone()
                if held:
                    self.assumed = self.assumed - held   # (a new set: readers hold the old)
                    r.outputs_book.held(self.key, self.chain_for(self.assumed),
                                        sum(self.bytes[i] for i in held))
            except Exception as e:  # noqa: BLE001 - never the user's backward's failure
                r.outputs_book.say_later.append(
                    f"{r.name}: checking the model's outputs after a step failed ({e!r}); its "
                    "plan stands")

        on_backward(lasts, seen)
        return box

    def see(self, output: Any, box: List[Returned]) -> None:
        """The model returned ``output``: watch its outputs at the positions counted dropped,
        if it has them all, at the sizes measured (else another structure: nothing to
        check)."""
        assumed = self.assumed
        if not assumed:
            return
        leaves = list(tensor_leaves(output))
        if max(assumed) >= len(leaves):
            return
        found = [(i, leaves[i]) for i in sorted(assumed)]
        if any(not isinstance(t, torch.Tensor) or storage_bytes([t]) != self.bytes[i]
               for i, t in found):
            return
        box.append(Returned(found))


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
    later = ShapeWatch(key, kept, watch.bytes, assumed)   # (later steps)
    chain_for = later.chain_for

    # weakly: the hooks live as long as the step's graph, which must not keep the model
    probe_ref, runner_ref = weakref.ref(probe), weakref.ref(runner)

    def seen() -> None:
        me, r = probe_ref(), runner_ref()
        if me is None or r is None:
            return
        gone = set(watch.gone())
        me.dropped = gone
        # (a forward that came first planned the shape held: that stands, unwatched)
        if r.outputs_book.seen(key, None if gone == assumed else chain_for(gone)):
            later.assumed = set(gone)

    runner.outputs_book.guessed(key, chain_for(set()), later)
    on_backward(lasts, seen)
    return chain_for(assumed)


def shape_of(key: Hashable) -> Hashable:
    """A plan key (``ChainRunner._key``: signature, budget, train mode, autocast state) less
    its budget: what a measured chain depends on."""
    signature_, _budget, training, autocast = key  # type: ignore[misc]
    return signature_, training, autocast


class OutputsBook:
    """A chain runner's record of how its shapes' plans count the model's outputs
    (``ShapeWatch``), and of what backwards found since: found on autograd's thread,
    applied by the runner's next forward (``take``), on the thread that plans."""

    def __init__(self, name: str):
        self.name = name
        # shapes planned on a guess before their profiling step's backward: the chain that
        # counts the outputs all held (planned so if the next forward comes first)
        self.unverified: Dict[Hashable, Chain] = {}
        self.watches: Dict[Hashable, ShapeWatch] = {}   # later steps are checked by these
        # shape -> (chain to plan on, bytes a later step held that were counted dropped)
        self.corrections: Dict[Hashable, Tuple[Chain, int]] = {}
        # shapes planned held after such a step: (the chain before, its bytes, what to say once
        # the plan is made), to go back to where no plan fits with them held (``settle``)
        self.fallback: Dict[Hashable, Tuple[Optional[Chain], int, str]] = {}
        self.say_later: List[str] = []   # said at the next step's forward

    def __getstate__(self) -> Dict[str, Any]:
        return dict(self.__dict__, say_later=[])   # (a copy does not repeat this one's news)

    # ------------------------------------------------------------- from the backward hooks
    def guessed(self, key: Hashable, held: Chain, watch: ShapeWatch) -> None:
        """``key``'s plan guesses which outputs the caller drops, before a backward has said:
        ``held`` plans its shape at its next step unless ``seen`` comes first; ``watch``
        checks its later steps."""
        self.unverified[shape_of(key)] = held
        self.watches[shape_of(key)] = watch

    def seen(self, key: Hashable, chain: Optional[Chain]) -> bool:
        """The profiling step's backward saw which outputs the caller dropped: the plans for
        ``key``'s shape stand (``chain`` None) or are made again on ``chain``. False (nothing
        done) where a forward came first and planned the shape with them all held: that
        stands."""
        shape = shape_of(key)
        if shape not in self.unverified:
            return False
        if chain is not None:   # (first: a forward on another thread finds one or the other)
            self.corrections[shape] = (chain, 0)
        self.unverified.pop(shape, None)
        return True

    def held(self, key: Hashable, chain: Chain, nbytes: int) -> None:
        """A later step of ``key``'s shape held ``nbytes`` of outputs into its backward that
        its plan counted as dropped: planned again on ``chain`` (them held)."""
        self.corrections[shape_of(key)] = (chain, nbytes)

    # ------------------------------------------------------------- at the runner's forward
    def take(self, key: Hashable, step: bool, measured: Dict[Hashable, Chain],
             old_peak: Callable[[Hashable], Optional[float]], budget: Optional[int]
             ) -> List[Tuple[Hashable, Chain]]:
        """The shapes to plan again, and on which chains: at a ``step`` (not a ``plan_for``
        query), ``key``'s shape if no backward came after its profiling step (all held),
        then every correction found since (observed: they win over that guess). The news
        waiting is said at a step. ``measured``: the chains planned on now; ``old_peak``: a
        shape's plan's predicted peak at ``budget`` (a held step that kept within it is not
        worth a warning)."""
        out: List[Tuple[Hashable, Chain]] = []
        if step:
            while self.say_later:
                user_warning.warn(self.say_later.pop(0))
            held = self.unverified.pop(shape_of(key), None)
            if held is not None:
                out.append((shape_of(key), held))
                watch = self.watches.get(shape_of(key))
                if watch is not None:
                    watch.assumed = set()
        while self.corrections:
            try:
                shape, (chain, nbytes) = self.corrections.popitem()
            except KeyError:   # (emptied meanwhile)
                break
            if nbytes:
                peak = old_peak(shape)
                over = peak is None or budget is None or peak + nbytes > budget
                self.fallback[shape] = (measured.get(shape), nbytes, (
                    f"{self.name}: a step held {format_bytes(nbytes)} of the model's outputs "
                    "into its backward that its plan counted as dropped before it (as the "
                    "earlier steps of this input shape did): that step's peak could pass the "
                    "budget by as much; planned with them held from this step on. A loop "
                    "that keeps the outputs on some steps (logging) can say outputs='held' to "
                    "plan so from the start") if over else "")
            out.append((shape, chain))
        return out

    def settle(self, key: Hashable, plan: Callable[[], Any],
               replan: Callable[[Hashable, Chain], None]) -> Any:
        """``plan()`` for ``key``; where it is the first plan of a shape planned held after
        a later step held its outputs, say so, and where no plan fits with them held, go back
        to the chain before (``replan``), stop watching the shape, say the overshoot that
        such a step leaves, and ``plan()`` on it."""
        fallback = self.fallback.pop(shape_of(key), None)
        try:
            made = plan()
        except InfeasibleError as e:
            if fallback is None or fallback[0] is None:
                raise
            before, nbytes, _ = fallback
            replan(shape_of(key), before)
            self.watches.pop(shape_of(key), None)
            need = f" (the least is {format_bytes(e.min_memory)})" if e.min_memory else ""
            user_warning.warn(
                f"{self.name}: a step held {format_bytes(nbytes)} of the model's outputs into "
                "its backward that its plan counted as dropped before it, and with them held "
                f"no plan fits the budget{need}: the plan that counts them dropped stays, and "
                f"a step that holds them can pass the budget by up to {format_bytes(nbytes)}. "
                "Drop them before the backward on such steps (loss = model(**batch).loss), "
                "or give that budget")
            return plan()
        if fallback is not None and fallback[2]:
            user_warning.warn(fallback[2])
        return made
