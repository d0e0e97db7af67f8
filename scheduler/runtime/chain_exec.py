"""Execute a Plan on real blocks, non-reentrant: the model's own forward loop calls the
blocks, autograd's own backward walks their real graph, and the plan decides what is kept.

Stages ``s = 0 .. L-1`` are the blocks, stage ``L`` is the loss, which lives outside the
chain. The ops mean what seed 002 Table 1 and DESIGN.md say (the simulator is the reference):

``F_none s``  run block s without keeping anything for backward; its input, if held as x[s],
              is dropped; the output is held as x[s+1].
``F_ck s``    the same, but the input is kept (a checkpoint).
``F_all s``   run block s keeping what autograd saves (xbar[s], output included) until ``B s``.
``B s``       backward of block s (autograd runs it): drops xbar[s], x[s].
``offload s`` / ``prefetch s``  move the value held as x[s] (or xbar[s-1]) to the host and back.

How (as ``torch.utils.checkpoint(use_reentrant=False)``, generalised to a plan over many
blocks): in the forward phase every block runs once, when the model's loop calls it, with
autograd recording its real graph, so parameter gradients reach ``.grad`` through the normal
``AccumulateGrad`` nodes exactly once (DDP, FSDP2, ``torch.autograd.grad`` and gradient hooks
see them). What the graph saves goes through ``saved_tensors_hooks``: under ``F_all`` the
tensor is kept in a holder; under ``F_ck``/``F_none`` only an empty holder is kept. In the
backward, the first unpack in block s's graph runs the plan's ops up to ``B s``:
recomputations (``F_ck``/``F_none`` without grad, from the checkpoints; ``F_all s`` with grad,
whose saved tensors fill block s's holders in order), offloads and prefetches. Any forward
after the first of its stage is a recomputation and runs with the random state and autocast
settings recorded at the first run, its modules' train/eval modes and parameter tensors
(``first_run``: a ``functional_call``'s included), the values its buffers had before the
first run where that run changed them in place (spectral norm's power iteration), and with
the block's buffers (batch-norm statistics) put back afterwards: the values, dropout masks
included, are those of plain training, so gradients are bit-identical. Recomputations call
the block module again (its hooks fire: FSDP2 gathers its parameters), with the arguments of
the loop's call (``block_calls``). Offloads and prefetches are ``chain_offload``'s: the step
owns an ``Offloader`` and calls it at each op.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, Dict, Hashable, List, Optional, Protocol,
                    Sequence, Set, Tuple)

import torch
from torch import nn

from ..errors import InvalidPlanError
from ..plan import FORWARD_KINDS
from ..profile.autograd_graph import differentiable
from . import accounting, buffers, first_run, rng
from .block_calls import BlockCall, tensor_leaves
from .chain_offload import Offloader
from .chain_transfers import ChainTransfers
from .compiled_plan import CompiledPlan
from .frames import Frame, Tensors
from .hf_outputs import outputs_not_captured

if TYPE_CHECKING:
    from .outside import Outside

# how the two errors of a forward that did not call every block end
LAYERDROP = "a model that skips blocks at random, LayerDrop, needs its layerdrop set to 0"


# ------------------------------------------------------------------------------------ state
def _saved_tensor_hooks_on() -> bool:
    """Whether saved-tensor hooks are on in this thread, or pushing them is refused
    (``disable_saved_tensors_hooks``: the chain's hooks then raise at block 0, as always);
    True where torch cannot say."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    if top is None or enabled is None:
        return True
    try:
        return top(True) is not None or not enabled()
    except (RuntimeError, TypeError):
        return True


def _backward_entered(step: "ChainStep", s: int, grad_outputs: Any) -> None:
    """Autograd is about to run block ``s``'s backward (a block left to autograd)."""
    step.entered = True
    step._check_all_called(s)


def _detached(ts: Sequence[torch.Tensor]) -> Tensors:
    return tuple(t.detach() for t in ts)


@dataclass
class RunStats:
    # peak of activation bytes held; None when the run did not track memory (a 0 would read
    # as a measured peak of nothing)
    peak_bytes: Optional[int] = None
    recomputed_forwards: int = 0
    offloaded: int = 0
    prefetched: int = 0
    input_offloads_skipped: int = 0  # offloads of the caller's input (frees nothing)


class Collector(Protocol):
    """What the step asks of a measuring collector (``mimose_collector.ShuttlingCollector``
    is one): it hands it the forward-phase run of every ``F_ck`` block before running it."""

    def measure(self, s: int, block: nn.Module, run: Callable[[Tuple[Any, ...]], Any],
                inp: Tuple[Any, ...], rg: Sequence[bool], state: Optional["rng.RngState"],
                exclude: Set[int], shared: Sequence[torch.Tensor] = ()) -> None:
        """Measure block ``s`` on ``inp`` (``run`` calls it); ``exclude``: storages that are
        not activations (weights); ``shared``: the call's other tensors (masks)."""


# ------------------------------------------------------------------------------------ step
def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` still shows the values ``b`` does: the same storage, offset, shape, strides
    and dtype. The loop's output object may have been given a new ``.data`` (straight-through
    quantization between blocks), which moves no version counter: it is then a changed value,
    not the output the step holds (a recomputation from the held one would read the old
    values)."""
    try:
        same_storage = a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one: by identity
        return True
    return same_storage and a.storage_offset() == b.storage_offset() and \
        a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


class ChainStep:
    """One forward + backward of the blocks following a compiled plan (see module doc).

    ``run_again(s, args, kwargs)`` calls block ``s`` for a recomputation (the module, so its
    hooks fire, without going through the runner again)."""

    def __init__(self, blocks: Sequence[nn.Module], cplan: CompiledPlan,
                 run_again: Callable[[int, Tuple[Any, ...], Dict[str, Any]], Any], *,
                 track_memory: bool = False,
                 transfers: Optional[Callable[[torch.device], ChainTransfers]] = None,
                 collector: Optional[Collector] = None,
                 state_tensors: Sequence[torch.Tensor] = (), name: str = "scheduler.wrap",
                 in_place: Optional[first_run.InPlaceBuffers] = None):
        self.blocks = blocks
        self.cplan = cplan
        self.L = cplan.L
        self.run_again = run_again
        self.track = track_memory
        self.collector = collector
        # which buffers the blocks' forwards change in place (kept by the runner across steps)
        self.in_place = in_place if in_place is not None else first_run.InPlaceBuffers()
        # the offloads and prefetches, on ``transfers`` (the transfer engine of a storage's
        # device); ``state_tensors``: what the blocks held as the step began, never activations
        self.offloader = Offloader(self, transfers, state_tensors)
        self.b_reached: Optional[int] = None  # the op of the B autograd was left to run
        self.name = name
        self.frames: List[Optional[Frame]] = [None] * self.L
        self.xs: Dict[int, Tensors] = {}              # values held as x[s]
        self.versions: Dict[int, Tuple[int, ...]] = {}  # of x[s] when it was stored
        self.anchors: Dict[int, Tensors] = {}         # x[s] the loop changed between blocks
        self.anchor_versions: Dict[int, Tuple[int, ...]] = {}  # of anchors[s] when anchored
        self.xbars: Dict[int, Frame] = {}             # F_all results, until B s
        self.stats = RunStats()
        self.devices: List[int] = []
        self.fptr = 0
        self.bptr = 0
        self.next = 0                                 # the block the loop calls next
        self.autograd_alone = False                   # blocks 0..L-2 left to autograd
        self.entered = False                          # the backward reached one of those
        # the last block's outputs as the loop may pass them on: by identity (weakly) and
        # their value (detached); see ``_previous``
        self.prev_out: Optional[Tuple[Tuple[weakref.ReferenceType, ...], Tensors]] = None
        self.failed_call: Optional[BlockCall] = None  # the call of the block running now
        # each block's outputs as the loop got them (weakly): alive after the forward, they
        # are held outside the plan (returned, kept in a list, saved by autograd outside the
        # blocks), and an offload must not leave them empty (``Offloader.restore_escaped``)
        self.loop_outs: Dict[int, Tuple[weakref.ReferenceType, ...]] = {}
        self.replaying = False  # runtime.tail replays the tail's backward (must not reach us)
        # set by the runner: the plan key a profiling step measures its chain for, the input
        # size of a Mimose collection step, and what a profiling or collection step holds
        # outside the chain (``tail.outside`` at block 0, when the model's tail is measured);
        # on a later step, what its plan counts of the model's outputs, to check (a
        # ``tail_outputs.ShapeWatch``)
        self.profile_key: Hashable = None
        self.input_size: Optional[float] = None
        self.outside: Optional["Outside"] = None
        self.watch: Any = None

    def abandon(self) -> None:
        """The forward failed half way: drop every reference to values and to the partial
        graph. (The failed call's arguments reach the graph, whose holders reach the frames and
        this step: a cycle through autograd's C++ nodes that the garbage collector cannot see,
        so it would never be freed.) Offloaded values still used outside the step get their
        memory back first (``Offloader.abandon``), judged once the calls' references, which
        are the step's, are gone."""
        self.prev_out = None
        if self.failed_call is not None:
            self.failed_call.x, self.failed_call.kept = (), []
        for f in self.frames:
            if f is not None:
                f.call.x = ()
                f.call.kept = []
        loop_outs, self.loop_outs = self.loop_outs, {}
        try:
            self.offloader.abandon(loop_outs)
        finally:
            for f in self.frames:
                if f is not None:
                    f.out = ()
            self.frames = [None] * self.L
            for d in (self.xs, self.anchors, self.xbars):
                d.clear()

    # -------------------------------------------------------------------------- values
    def _hold(self, s: int, value: Tensors) -> None:
        self.xs[s] = value
        self.versions[s] = tuple(t._version for t in value)

    def _check_version(self, s: int, value: Tensors, versions: Tuple[int, ...]) -> None:
        if tuple(t._version for t in value) != versions:
            raise RuntimeError(
                f"{self.name}: block {s} modifies its input in place, which a checkpointed "
                "chain cannot recompute (the input is the previous block's stored output); "
                "make the block's first operation out of place (e.g. inplace=False)")

    def _input(self, s: int, index: int, kind: str) -> Tensors:
        if s in self.anchors:
            self._check_version(s, self.anchors[s], self.anchor_versions[s])
            return self.anchors[s]
        if s in self.xs:
            self.offloader.ready_x(s)
            self._check_version(s, self.xs[s], self.versions[s])
            return self.xs[s]
        if s - 1 in self.xbars:
            f = self._ready_xbar(s - 1, index, kind)
            self._check_version(s, f.out, f.out_version)
            return f.out
        moving = self.offloader.readable(s) if kind in ("F_ck", "F_all") else None
        if moving is not None:  # read while its copy out runs, or the caller's input
            return moving
        where = " (it is offloaded: prefetch it first)" if self.offloader.offloaded(s) else ""
        raise InvalidPlanError(f"op {index} ({kind} {s}): the input of stage {s} is not in "
                               f"memory{where}", index)

    # A prefetched value's bytes may still be in flight on a side stream: every read of one
    # waits for its copy first (``Offloader.ready_x``/``wait_xbar``)
    def _ready_input(self, s: int) -> None:
        """Wait for block ``s``'s input, wherever it was prefetched: as x[s], or with what
        F_all s-1 kept (its output; block s's graph may have saved it)."""
        self.offloader.ready_x(s)
        f = self.xbars.get(s - 1)
        if f is not None:
            self.offloader.wait_xbar(f)

    def _ready_xbar(self, t: int, index: int, kind: str) -> Frame:
        f = self.xbars[t]
        if f.released:
            raise InvalidPlanError(f"op {index} ({kind}): xbar[{t}] is offloaded; prefetch "
                                   f"{t + 1} first", index)
        self.offloader.wait_xbar(f)
        return f

    def _held_tensors(self) -> List[torch.Tensor]:
        """Every tensor the step holds for the plan (values, F_all results)."""
        ts: List[torch.Tensor] = []
        for comps in list(self.xs.values()) + list(self.anchors.values()) + \
                self.offloader.held():
            ts.extend(comps)
        for f in self.xbars.values():
            ts.extend(f.out)
            ts.extend(f.saved())
        return ts

    def _live(self) -> None:
        if not self.track:
            return
        b = accounting.tensors_bytes(self._held_tensors(), self.offloader.state_keys())
        if self.stats.peak_bytes is None or b > self.stats.peak_bytes:
            self.stats.peak_bytes = b

    # -------------------------------------------------------------------------- forward
    def forward_block(self, s: int, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                      run_first: Callable[..., Any], all_inputs: bool = False) -> Any:
        """Block ``s`` as the loop calls it: the plan's ops up to its forward, then its run."""
        if s != self.next:
            raise RuntimeError(
                f"{self.name}: block {s} was called but block {self.next} was expected: the "
                f"model must call each of its {self.L} blocks once, in order, per forward "
                f"(name the list its loop walks with blocks=; {LAYERDROP})")
        if s == 0:
            self.autograd_alone = self._autograd_alone()
        if self.autograd_alone and s < self.L - 1:
            self._forward_ops_until(s)
            out = run_first(args, kwargs)
            self.next = s + 1
            self._signal_backward(s, out)
            return out
        call = BlockCall(args, kwargs, self._previous(), all_inputs=all_inputs)
        self.failed_call = call  # until it ran: abandon() lets go of its arguments too
        if s == 0:
            # (each block's first parameter: walking all of them cost 10 us a block a step)
            params = [p for p in (next(b.parameters(), None) for b in self.blocks)
                      if p is not None]
            self.devices = rng.cuda_devices_of(list(call.x) + call.shared_tensors() + params)
            self._hold(0, _detached(call.x))
        elif call.anchored:
            self.anchors[s] = _detached(call.x)
            self.anchor_versions[s] = tuple(t._version for t in self.anchors[s])
        index, kind = self._forward_ops_until(s)
        self._ready_input(s)  # the loop's arguments may share a storage just prefetched
        frame = Frame(self, s, call)
        self.frames[s] = frame
        block = self.blocks[s]
        recomputed = s in self.cplan.recomputed or self.collector is not None
        if recomputed:
            frame.state = rng.capture(self.devices)
        if self.collector is not None and kind == "F_ck":
            # (Mimose's measurement: not the model's outputs)
            with self.offloader.not_activations(s) as weights, outputs_not_captured():
                self.collector.measure(s, block, lambda xs: run_first(*call.bind(xs)), call.x,
                                       call.rg, frame.state, weights, call.shared_tensors())
        pack = frame.pack_keep if kind == "F_all" else frame.pack_drop
        before = self.in_place.before(s, block) if recomputed else None
        with torch.autograd.graph.saved_tensors_hooks(pack, Frame.unpack):
            out = run_first(args, kwargs)
        if before is not None:  # as the run left them: a cache it grew or built is the one it
            # used; buffers it changed in place are recomputed from their values before it
            frame.first = first_run.capture(block, self.in_place.moved(s, self.name, block,
                                                                       before))
        outs = tensor_leaves(out)
        held = _detached(outs)
        self.prev_out = (tuple(weakref.ref(t) for t in outs), held)
        self.loop_outs[s] = self.prev_out[0]
        self.offloader.note_passed(outs, call)
        if kind == "F_all":
            frame.out = held
            frame.out_version = tuple(t._version for t in frame.out)
            self.xbars[s] = frame
        else:
            self._hold(s + 1, held)
            if kind == "F_none":
                self.xs.pop(s, None)
        self.failed_call = None
        if s > 0 and not call.anchored:
            call.x = ()  # x[s] is held (or not) as the plan says: the call must not pin it
        # the graph's holders reach this step: what the step keeps of the call must not reach
        # the graph (a cycle through C++ that gc cannot free if the graph is dropped unrun)
        call.unlink()
        self.next = s + 1
        self._live()
        self.offloader.after(index)
        if s == self.L - 1:
            self._forward_ops_until(None)
            self.prev_out = None
            loop_outs, self.loop_outs = self.loop_outs, {}
            self.offloader.restore_escaped(loop_outs)
        return out

    def _autograd_alone(self) -> bool:
        """Whether blocks 0..L-2 are left to autograd, run as the loop calls them with no
        saved-tensor hooks, frames or held values (``_signal_backward`` tells the step where
        their backward begins): the plan keeps every activation and moves none (a budget that
        fits the step, a small Mimose input), the step measures nothing (no profiling, no
        Mimose collection, no memory tracking), and no other saved-tensor hooks are on (a
        ``save_on_cpu`` around the model, the swap runtime: they would then get those blocks'
        saved tensors, which the chain's hooks keep from them) or refused. What the hooks
        cost, a few us per saved tensor (bench/hook_overhead.py), then buys nothing. The last
        block keeps them: its backward is the plan's (``backward_reaches``)."""
        return (self.cplan.keeps_everything and not self.track and self.collector is None
                and self.profile_key is None and not _saved_tensor_hooks_on())

    def _signal_backward(self, s: int, out: Any) -> None:
        """What a block left to autograd still owes the step: a sign when its backward begins
        (one pre-hook on its first output's node, not one per saved tensor), which is where a
        backward may enter the graph (a loss on an earlier block's output: CLIP's skip, or a
        forward that stopped before the last block), so the runner knows the backward began
        (stacked forwards) and a forward that skipped blocks is refused there as before. The
        hook holds the step while the graph lives, as holders do."""
        node = next((t.grad_fn for t in tensor_leaves(out) if t.grad_fn is not None), None)
        if node is not None:
            node.register_prehook(functools.partial(_backward_entered, self, s))

    @property
    def backward_began(self) -> bool:
        """Whether autograd ran any of this step's backward (a block's, or its plan's ops)."""
        return self.bptr > 0 or self.b_reached is not None or self.entered

    def _check_all_called(self, target: int) -> None:
        if self.next != self.L:
            raise RuntimeError(
                f"{self.name}: backward reached block {target} but the forward called only "
                f"blocks 0..{self.next - 1} of {self.L}: every block must run in each forward "
                f"({LAYERDROP})")

    def _previous(self) -> Optional[Tensors]:
        """The last block's outputs for the next call's ``BlockCall``: those the loop still
        holds, the very objects (it may pass them on: matched by identity); the step's detached
        copy of the others (the same value; the loop cannot pass what it let go). Held strongly,
        the outputs would reach their graph, whose holders reach this step: a cycle through
        autograd's C++ nodes, never freed if the forward stops between blocks and the model is
        deleted before another forward."""
        if self.prev_out is None:
            return None
        refs, held = self.prev_out
        return tuple(o if o is not None and _same_view(o, h) else h
                     for o, h in ((r(), h) for r, h in zip(refs, held)))

    def _forward_ops_until(self, s: Optional[int]) -> Tuple[int, str]:
        """Run the forward phase's ops up to the forward of stage ``s`` (its index and kind
        are returned) or, for ``None``, to the end of the forward phase."""
        ops = self.cplan.forward_ops
        while self.fptr < len(ops):
            index, kind, st = ops[self.fptr]
            self.fptr += 1
            self.offloader.sync_before(index)
            if kind in FORWARD_KINDS:
                if st == s:
                    return index, kind
                # F L: the chain's output goes to the caller (held by the loop, not by us)
                self.xs.pop(self.L, None)
            else:
                self.offloader.transfer(index, kind, st)
            self.offloader.after(index)
        return -1, ""

    # -------------------------------------------------------------------------- backward
    def backward_reaches(self, target: int) -> None:
        """Autograd is about to run block ``target``'s backward: run the plan's ops up to
        ``B target`` (recomputations fill its holders)."""
        self._check_all_called(target)
        if self.b_reached is not None:  # autograd ran that B since: what it read may go
            self.offloader.after(self.b_reached)
            self.b_reached = None
        ops = self.cplan.backward_ops
        while self.bptr < len(ops):
            index, kind, st = ops[self.bptr]
            self.bptr += 1
            self.offloader.sync_before(index)
            if kind == "B":
                if st == self.L:
                    self.xs.pop(self.L, None)
                elif st == target:
                    self._ready_for_b(index, st)
                    # B target runs once this returns: what it reads goes at the next call
                    self.offloader.after(index - 1)
                    self.b_reached = index
                    return
                elif st > target:
                    self._drop_b(st)  # a block whose graph saved nothing: autograd ran it
                else:
                    raise InvalidPlanError(
                        f"op {index}: autograd runs the backward of block {target} but the plan "
                        f"runs B {st} first", index)
            elif kind in FORWARD_KINDS:
                self._recompute(index, kind, st)
            else:
                self.offloader.transfer(index, kind, st)
            self.offloader.after(index)
        raise InvalidPlanError(f"the plan has no B {target} after op {len(self.cplan.plan.ops)}",
                               len(self.cplan.plan.ops))

    def _ready_for_b(self, index: int, s: int) -> None:
        if s not in self.xbars:
            raise InvalidPlanError(f"op {index} (B {s}): needs xbar[{s}]; run F_all {s} first",
                                   index)
        self._ready_xbar(s, index, "B")
        self._ready_input(s)  # the graph may have saved the input
        self._live()
        self._drop_b(s)

    def _drop_b(self, s: int) -> None:
        """What ``B s`` frees: our references (autograd frees the saved tensors it used)."""
        f = self.xbars.pop(s, None)
        if f is not None:
            f.out = ()
        self.xs.pop(s, None)
        self.anchors.pop(s, None)
        self.anchor_versions.pop(s, None)
        self.frames[s] = None

    def _recompute(self, index: int, kind: str, s: int) -> None:
        if s == self.L:
            return
        inp = self._input(s, index, kind)
        frame = self.frames[s]
        if frame is None:
            raise InvalidPlanError(f"op {index} ({kind} {s}): block {s} already went "
                                   "through its backward", index)
        call = frame.call
        changed = call.changed_arguments()
        if changed:
            # plain autograd raises here too (a saved tensor's version moved); recomputing
            # with the new values would give wrong gradients without a word
            raise RuntimeError(
                f"{self.name}: block {s}: {len(changed)} of its tensor arguments (flattened "
                f"argument position(s) {changed}) were modified in place after the block ran "
                "and before the backward recomputed it; do not change a block's arguments "
                "(masks, position tables) in place until the backward is done")
        leaves = tuple(t.detach().requires_grad_(rg and differentiable(t))
                       for t, rg in zip(inp, call.rg))
        args, kwargs = call.bind(leaves)
        block = self.blocks[s]
        self.stats.recomputed_forwards += 1
        ctx = rng.replay(frame.state) if frame.state is not None else contextlib.nullcontext()
        with ctx, first_run.as_first_run(block, frame.first), buffers.frozen_buffers(block):
            if kind == "F_all":
                refill = frame.refill()
                with torch.enable_grad(), \
                        torch.autograd.graph.saved_tensors_hooks(refill.pack, refill.unpack):
                    out = self.run_again(s, args, kwargs)
                refill.check()
                frame.out = _detached(tensor_leaves(out))
                frame.out_version = tuple(t._version for t in frame.out)
                frame.host, frame.released = None, False
                self.xbars[s] = frame
            else:
                with torch.no_grad():
                    out = self.run_again(s, args, kwargs)
                self._hold(s + 1, _detached(tensor_leaves(out)))
        del out
        if kind == "F_none":
            self.xs.pop(s, None)
        self._live()
