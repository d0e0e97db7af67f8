"""Execute a Plan on real blocks: forward and backward of a chain following the ops exactly.

Stages ``s = 0 .. L-1`` are the blocks, stage ``L`` is the loss, which lives outside the
chain: its forward is the moment the chain's output is handed to the caller, its backward
the moment the gradient of that output arrives. The ops mean what seed 002 Table 1 and
DESIGN.md say (the simulator is the reference):

``F_none s``  run block s without keeping anything for backward; its input, if held as x[s],
              is dropped; the output is held as x[s+1].
``F_ck s``    the same, but the input is kept (a checkpoint).
``F_all s``   run block s with autograd on: what autograd saves (xbar[s], output included)
              is kept until ``B s``.
``B s``       backward of block s from xbar[s] and delta[s+1]: produces delta[s] and the
              block's parameter gradients, then drops xbar[s], delta[s+1] and x[s].
``offload s`` / ``prefetch s``  move the value held as x[s] to the host and back.

Ops before the first ``B`` (which must be ``B L``) form the forward phase: each stage runs
exactly once, in order, as in plain training, so the generators advance exactly as they
would. Any forward op after it is a recomputation and runs with the random state and
autocast settings recorded at the stage's first run, and with the block's buffers
(batch-norm statistics) put back afterwards: the values, dropout masks included, are those
of plain training, so gradients are bit-identical.

Values between blocks are a tensor or a tuple (of tensors and constants); a tuple output is
passed to the next block as positional arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..errors import InvalidPlanError
from ..plan import FORWARD_KINDS, Plan
from . import accounting, buffers, rng
from .offload import StorageCopy, Transfers

Comps = Tuple[Any, ...]  # the components of a value passed between blocks


def _is_diff(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def as_components(value: Any, stage: int) -> Tuple[Comps, bool]:
    """A block's return value as components, and whether it was a tuple."""
    if isinstance(value, torch.Tensor):
        return (value,), False
    if isinstance(value, tuple):
        return tuple(value), True
    raise TypeError(
        f"scheduler.wrap: block {stage} returned {type(value).__name__}; blocks must return a "
        "tensor or a tuple of tensors (and constants), which is passed to the next block as "
        "positional arguments")


# ------------------------------------------------------------------------------------ plan
@dataclass
class CompiledPlan:
    """A Plan checked for the runtime and split into its forward and backward phases."""

    plan: Plan
    L: int
    forward_ops: List[Tuple[int, str, int]]   # (index in plan.ops, kind, stage)
    backward_ops: List[Tuple[int, str, int]]
    recomputed: Set[int]                      # stages run more than once
    # offload op index -> the last op that still reads the offloaded value before it is
    # prefetched (the simulator lets forwards read an item while its offload is in flight)
    release: Dict[int, int] = field(default_factory=dict)
    # compute op index -> offload ops whose copy must be complete before it starts (host wait)
    sync_before: Dict[int, List[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: Plan, L: int) -> "CompiledPlan":
        ops = [(i, op.kind, op.stage) for i, op in enumerate(plan.ops)]
        timing = plan.meta.get("transfer_timing") or {}
        issue_after = {int(i): int(j) for i, j in timing.get("issue_after", [])}
        if issue_after:  # prefetches the simulator starts later (waiting for memory) move there
            moved = [op for op in ops if op[0] not in issue_after]
            for i, j in sorted(issue_after.items(), key=lambda p: (p[1], p[0])):
                k = next(n for n, op in enumerate(moved) if op[0] == j)
                while k + 1 < len(moved) and moved[k + 1][0] in issue_after and \
                        issue_after[moved[k + 1][0]] == j:
                    k += 1
                moved.insert(k + 1, next(op for op in ops if op[0] == i))
            ops = moved
        sync_before = {int(c): [int(o) for o in offs] for c, offs in timing.get("sync_before", [])}
        for i, kind, s in ops:
            if s > L:
                raise InvalidPlanError(f"op {i} ({kind} {s}): stage out of range for a chain of "
                                       f"{L} blocks plus the loss", i)
        first_b = next((k for k, (_, kind, _) in enumerate(ops) if kind == "B"), None)
        if first_b is None:
            raise InvalidPlanError("plan has no backward op", None)
        i_b, _, s_b = ops[first_b]
        if s_b != L:
            raise InvalidPlanError(f"op {i_b}: the first backward must be B {L} (the loss), "
                                   f"got B {s_b}", i_b)
        fwd, bwd = ops[:first_b], ops[first_b:]
        expect = 0
        for i, kind, s in fwd:
            if kind in FORWARD_KINDS:
                if s != expect:
                    raise InvalidPlanError(
                        f"op {i} ({kind} {s}): before the loss's backward each stage must run "
                        f"once, in order; expected a forward of stage {expect}", i)
                expect += 1
        if expect != L + 1:
            raise InvalidPlanError(f"the forward phase runs stages 0..{expect - 1}, "
                                   f"not 0..{L}", first_b)
        counts: Dict[int, int] = {}
        for _, kind, s in ops:
            if kind in FORWARD_KINDS:
                counts[s] = counts.get(s, 0) + 1
        recomputed = {s for s, c in counts.items() if c > 1 and s < L}
        release: Dict[int, int] = {}
        for k, (i, kind, s) in enumerate(ops):
            if kind != "offload":
                continue
            last = i
            for j, kind2, s2 in ops[k + 1:]:
                if s2 == s and kind2 in ("prefetch", "offload", "B"):
                    break
                if s2 == s and kind2 in FORWARD_KINDS:
                    last = j
            release[i] = last
        return cls(plan, L, fwd, bwd, recomputed, release, sync_before)


def transfer_timing(sim: Any) -> Dict[str, List[Any]]:
    """What the runtime must add to follow a memory-limited simulation of a plan with
    transfers (``simulate(..., memory=budget)``, how pofo predicts its peak): prefetches the
    simulator starts only after a later compute op ended (it waited for memory) are issued
    after that op, and a compute op the simulator starts after an offload completed waits
    for that copy (so the memory it frees can really be reused)."""
    steps = sim.steps
    compute = [st for st in steps if st.kind not in ("offload", "prefetch")]
    issue_after, sync_before = [], []
    for st in steps:
        if st.kind != "prefetch":
            continue
        done = [c.index for c in compute if c.end <= st.start * (1 + 1e-12) + 1e-15]
        if done and max(done) > st.index:
            issue_after.append([st.index, max(done)])
    offloads = [st for st in steps if st.kind == "offload"]
    for c in compute:
        offs = [o.index for o in offloads if o.index < c.index and
                o.end <= c.start * (1 + 1e-12) + 1e-15]
        if offs:
            sync_before.append([c.index, offs])
    return {"issue_after": issue_after, "sync_before": sync_before}


# ------------------------------------------------------------------------------------ state
@dataclass
class Saved:
    """What ``F_all s`` keeps: the input leaves, the output (with its graph) and, when memory
    is tracked, the tensors autograd saved."""
    leaves: Comps
    out: Comps
    saved: List[torch.Tensor] = field(default_factory=list)
    host: Optional[List[StorageCopy]] = None  # its storages while offloaded / prefetched
    released: bool = False                    # device memory given back (offload complete)


@dataclass
class Offloaded:
    """x[s] while it is on the host: the same tensor objects, their storages emptied."""
    comps: Comps
    copies: List[StorageCopy]
    released: bool = False


@dataclass
class RunStats:
    peak_bytes: int = 0          # peak of activation bytes held (tracked runs only)
    recomputed_forwards: int = 0
    offloaded: int = 0
    prefetched: int = 0
    input_offloads_skipped: int = 0  # offloads of the caller's input (frees nothing)
    op_seconds: Dict[str, float] = field(default_factory=dict)


class Collector:
    """Interface of the Mimose shuttling collector (``mimose_collector.ShuttlingCollector``):
    the executor hands it the forward-phase run of every ``F_ck`` block."""

    def shuttle(self, s: int, block: nn.Module, run: Any, inp: Comps, rg: Sequence[bool],
                state: Optional["rng.RngState"], exclude: Set[int]) -> Tuple[Comps, bool]:
        raise NotImplementedError  # pragma: no cover - interface


class ChainExecutor:
    """One forward + backward of the blocks following a compiled plan."""

    def __init__(self, blocks: Sequence[nn.Module], cplan: CompiledPlan,
                 params: Sequence[Sequence[nn.Parameter]], *, track_memory: bool = False,
                 transfers: Optional[Transfers] = None, collector: Optional[Collector] = None,
                 param_storages: Optional[Set[int]] = None):
        self.blocks = blocks
        self.cplan = cplan
        self.L = cplan.L
        self.params = params
        self.track = track_memory
        self.transfers = transfers
        self.collector = collector
        self.param_storages = param_storages or set()
        self.xs: Dict[int, Comps] = {}                 # values held as x[s]
        self.xbars: Dict[int, Saved] = {}              # F_all results
        self.deltas: Dict[int, Comps] = {}             # gradients w.r.t. x[s]
        self.host: Dict[int, Offloaded] = {}           # offloaded x[s]
        self.pending: Dict[int, List[StorageCopy]] = {}  # prefetched x[s], copy maybe in flight
        self.leaving: Dict[int, Tuple[Comps, int]] = {}  # offloaded, still read until op k
        self.leaving_xbar: Dict[int, int] = {}           # xbar[t] offloaded, read until op k
        self.offload_events: Dict[int, List[Any]] = {}   # offload op index -> copy events
        self.record_saved = track_memory or bool(cplan.release)  # xbar offload needs storages
        self.rg: Dict[int, Tuple[bool, ...]] = {}      # which components of x[s] need a gradient
        self.is_tuple: Dict[int, bool] = {}
        self.rng_states: Dict[int, rng.RngState] = {}
        self.stats = RunStats()
        self.devices: List[int] = []
        self.x0_is_tuple = False
        self.out_layout: List[int] = []
        self.out_template: Comps = ()
        self.n_out = 0
        self.out_is_tuple = False

    # -------------------------------------------------------------------------- helpers
    def _input(self, s: int, index: int, kind: str) -> Comps:
        if s in self.xs:
            self._ready_x(s)
            return self.xs[s]
        if s - 1 in self.xbars:
            sv = self._ready_xbar(s - 1, index, kind)
            return tuple(c.detach() if isinstance(c, torch.Tensor) else c for c in sv.out)
        if s in self.leaving and kind in ("F_ck", "F_all"):  # read while the copy runs
            return self.leaving[s][0]
        if s in self.host and not self.host[s].copies and kind in ("F_ck", "F_all"):
            return self.host[s].comps  # the caller's input: "offloaded" but never moved
        where = " (it is offloaded: prefetch it first)" if s in self.host else ""
        raise InvalidPlanError(f"op {index} ({kind} {s}): the input of stage {s} is not in "
                               f"memory{where}", index)

    def _ready_x(self, s: int) -> None:
        """Wait for the prefetch of x[s], if one is in flight."""
        for sc in self.pending.pop(s, ()):
            Transfers.wait(sc)

    def _ready_xbar(self, t: int, index: int, kind: str) -> Saved:
        """xbar[t], waiting for its prefetch if one is in flight."""
        sv = self.xbars[t]
        if sv.released:
            raise InvalidPlanError(f"op {index} ({kind}): xbar[{t}] is offloaded; prefetch "
                                   f"{t + 1} first", index)
        if sv.host is not None and t not in self.leaving_xbar:
            for sc in sv.host:
                Transfers.wait(sc)
        return sv

    def _out_rg(self, s: int, inp: Comps, out: Comps) -> Tuple[bool, ...]:
        """Which output components of block s need a gradient (as in plain training)."""
        in_rg = self.rg[s]
        any_rg = bool(self.params[s]) or any(in_rg)
        flags = []
        for o in out:
            same = next((i for i, c in enumerate(inp) if c is o), None)
            if same is not None:
                flags.append(in_rg[same])
            else:
                flags.append(_is_diff(o) and any_rg)
        return tuple(flags)

    def _run_block(self, s: int, args: Comps, index: int, kind: str) -> Tuple[Comps, bool]:
        versions = [c._version if isinstance(c, torch.Tensor) else None for c in args]
        try:
            value = self.blocks[s](*args)
        except RuntimeError as e:
            if "leaf Variable that requires grad" in str(e) or "modified by an inplace" in str(e):
                raise RuntimeError(
                    f"scheduler.wrap: block {s} modifies its input in place ({e}). The runner "
                    "keeps block inputs for recomputation, so a block may not write into its "
                    "input: use the out-of-place op (e.g. relu instead of relu_, inplace=False), "
                    "or make the in-place op the block's second op onwards.") from e
            raise
        for c, v in zip(args, versions):
            if v is not None and c._version != v:
                raise RuntimeError(
                    f"scheduler.wrap: block {s} modified its input in place (op {index}, {kind} "
                    f"{s}); a recomputed block would see the changed value. Use out-of-place "
                    "ops on block inputs (e.g. inplace=False on the block's first activation).")
        return as_components(value, s)

    def _held_tensors(self) -> List[Any]:
        """Every tensor the executor holds for the plan (values, F_all results, gradients)."""
        ts: List[Any] = []
        for comps in list(self.xs.values()) + [c for c, _ in self.leaving.values()] + \
                [h.comps for h in self.host.values() if not h.copies]:
            ts.extend(comps)  # (released storages count 0 bytes; the caller's input counts)
        for sv in self.xbars.values():
            ts.extend(sv.leaves)
            ts.extend(sv.out)
            ts.extend(sv.saved)
        for comps in self.deltas.values():
            if comps is not None:
                ts.extend(comps)
        return ts

    def _movable(self, mine: Sequence[Any], same_value: Sequence[Any],
                 skip: Set[int]) -> List[torch.UntypedStorage]:
        """The storages of ``mine`` (one stored item) that may move to the host: not in
        ``skip`` and shared with no other held item, ``same_value`` aside (the detached
        input leaves of the F_all that consumed this very value)."""
        ours = {id(t) for t in list(mine) + list(same_value)}
        others = {accounting.storage_key(t) for t in accounting.tensors_of(self._held_tensors())
                  if id(t) not in ours}
        storages = {}
        for t in accounting.tensors_of(mine):
            k = accounting.storage_key(t)
            if k not in skip and k not in others and t.untyped_storage().nbytes() > 0:
                storages[k] = t.untyped_storage()
        return list(storages.values())

    def _live(self, extra: Sequence[Any] = ()) -> None:
        if not self.track:
            return
        ts: List[Any] = list(extra) + self._held_tensors()
        b = accounting.tensors_bytes(ts, self.param_storages)
        if b > self.stats.peak_bytes:
            self.stats.peak_bytes = b

    # -------------------------------------------------------------------------- forwards
    def _forward(self, index: int, kind: str, s: int, first: bool) -> None:
        if s == self.L:  # the loss: its input x[L] is the chain's output, handed to the caller
            self._input(s, index, kind)
            return
        inp = self._input(s, index, kind)
        block = self.blocks[s]
        if first and s in self.cplan.recomputed:
            self.rng_states[s] = rng.capture(self.devices)
        ctx_rng = rng.replay(self.rng_states[s]) if not first else _nullcontext()
        ctx_buf = buffers.frozen_buffers(block) if not first else _nullcontext()
        if not first:
            self.stats.recomputed_forwards += 1
        with ctx_rng, ctx_buf:
            if kind == "F_all":
                leaves = tuple(c.detach().requires_grad_(r) if isinstance(c, torch.Tensor) else c
                               for c, r in zip(inp, self.rg[s]))
                saved: List[torch.Tensor] = []
                with torch.enable_grad():
                    if self.record_saved:
                        with accounting.SavedTensors() as rec:
                            out, is_tuple = self._run_block(s, leaves, index, kind)
                        saved = rec.tensors
                    else:
                        out, is_tuple = self._run_block(s, leaves, index, kind)
                if first:
                    self.rg[s + 1] = self._out_rg(s, leaves, out)
                self.xbars[s] = Saved(leaves, out, saved)
            else:
                if first and self.collector is not None and kind == "F_ck":
                    out, is_tuple = self.collector.shuttle(
                        s, block, lambda args: self._run_block(s, args, index, kind), inp,
                        self.rg[s], self.rng_states.get(s), self.param_storages)
                else:
                    with torch.no_grad():
                        out, is_tuple = self._run_block(s, inp, index, kind)
                if first:
                    self.rg[s + 1] = self._out_rg(s, inp, out)
                self.xs[s + 1] = out
        self.is_tuple[s + 1] = is_tuple
        self._live()
        if kind == "F_none" and s in self.xs:
            del self.xs[s]

    # -------------------------------------------------------------------------- backward
    def _backward(self, index: int, s: int, grads: Optional[Comps] = None) -> None:
        if s == self.L:
            self._input(s, index, "B")
            self.deltas[s] = grads
            self._live()
            self.xs.pop(s, None)
            return
        if s not in self.xbars:
            raise InvalidPlanError(f"op {index} (B {s}): needs xbar[{s}]; run F_all {s} first",
                                   index)
        if s + 1 not in self.deltas:
            raise InvalidPlanError(f"op {index} (B {s}): needs delta[{s + 1}]; run B {s + 1} "
                                   "first", index)
        sv = self._ready_xbar(s, index, "B")
        self._ready_x(s)  # the graph may have saved the input
        g = self.deltas[s + 1]
        outs, gouts = [], []
        for o, gi in zip(sv.out, g):
            if isinstance(o, torch.Tensor) and o.requires_grad and gi is not None:
                outs.append(o)
                gouts.append(gi)
        leaf_idx = [i for i, c in enumerate(sv.leaves)
                    if isinstance(c, torch.Tensor) and c.requires_grad]
        wrt = [sv.leaves[i] for i in leaf_idx] + list(self.params[s])
        if outs and wrt:
            # accumulate straight into .grad, as plain training does (parameter gradients are
            # added, and their hooks fire, as soon as this block's backward has run: nothing
            # held until the end of the chain); the input leaves' .grad is delta[s]
            torch.autograd.backward(outs, gouts, inputs=wrt)
        delta: List[Optional[torch.Tensor]] = [None] * len(sv.leaves)
        for i in leaf_idx:
            delta[i] = sv.leaves[i].grad
        self.deltas[s] = tuple(delta)
        self._live()
        del self.xbars[s]
        del self.deltas[s + 1]
        self.xs.pop(s, None)

    # ------------------------------------------------------------------------ transfers
    def _offload(self, index: int, s: int) -> None:
        if self.transfers is None:
            raise InvalidPlanError(f"op {index} (offload {s}): no transfer engine", index)
        if s not in self.xs and s - 1 in self.xbars and self.xbars[s - 1].host is None:
            self._offload_xbar(index, s - 1)
            return
        if s not in self.xs:
            raise InvalidPlanError(f"op {index} (offload {s}): the input of stage {s} is not "
                                   "in memory", index)
        self._ready_x(s)
        comps = self.xs.pop(s)
        self.stats.offloaded += 1
        if s == 0:
            # the caller's input: the caller still holds it, so moving it would free nothing
            self.host[0] = Offloaded(comps, [], released=True)
            self.stats.input_offloads_skipped += 1
            return
        # per storage, as for xbar: graphs that saved x[s] (F_all s) see it leave and return
        same = self.xbars[s].leaves if s in self.xbars else ()
        storages = self._movable(comps, same, set(self.param_storages))
        self.host[s] = Offloaded(comps, [self.transfers.offload_storage(st) for st in storages])
        self.offload_events[index] = [sc.host.event for sc in self.host[s].copies
                                      if sc.host.event is not None]
        release = self.cplan.release.get(index, index)
        if release > index:
            self.leaving[s] = (comps, release)
        else:
            self._release_x(s)

    def _release_x(self, s: int) -> None:
        off = self.host.get(s)
        if off is not None and not off.released:
            for sc in off.copies:
                Transfers.release(sc)
            off.released = True

    def _offload_xbar(self, index: int, t: int) -> None:
        """Move what F_all t keeps (saved tensors and output, not its input) to the host."""
        sv = self.xbars[t]
        skip = set(self.param_storages) | {accounting.storage_key(c) for c in
                                           accounting.tensors_of(sv.leaves)}
        same = self.xbars[t + 1].leaves if t + 1 in self.xbars else ()
        storages = self._movable(list(sv.saved) + list(sv.out), same, skip)
        sv.host = [self.transfers.offload_storage(st) for st in storages]
        self.offload_events[index] = [sc.host.event for sc in sv.host if sc.host.event is not None]
        release = self.cplan.release.get(index, index)
        if release > index:
            self.leaving_xbar[t] = release
        else:
            self._release_xbar(t)
        self.stats.offloaded += 1

    def _release_xbar(self, t: int) -> None:
        sv = self.xbars[t]
        for sc in sv.host or ():
            Transfers.release(sc)
        sv.released = True

    def _prefetch(self, index: int, s: int) -> None:
        if s not in self.host and s - 1 in self.xbars and self.xbars[s - 1].released:
            sv = self.xbars[s - 1]
            for sc in sv.host:
                self.transfers.prefetch_storage(sc)
            sv.released = False
            self.stats.prefetched += 1
            self._live()
            return
        if s not in self.host:
            raise InvalidPlanError(f"op {index} (prefetch {s}): x[{s}] was never offloaded",
                                   index)
        off = self.host.pop(s)
        self.leaving.pop(s, None)
        if off.copies and off.released:
            for sc in off.copies:
                self.transfers.prefetch_storage(sc)
            self.pending[s] = off.copies
        self.xs[s] = off.comps
        self.stats.prefetched += 1
        self._live()

    def _do(self, index: int, kind: str, s: int, first: bool, grads: Optional[Comps] = None):
        for o in self.cplan.sync_before.get(index, ()):
            for ev in self.offload_events.pop(o, ()):
                ev.synchronize()  # the simulator reuses this memory from here on
        if kind in FORWARD_KINDS:
            self._forward(index, kind, s, first)
        elif kind == "B":
            self._backward(index, s, grads)
        elif kind == "offload":
            self._offload(index, s)
        else:
            self._prefetch(index, s)
        if self.leaving:  # drop device copies of offloaded values nobody reads any more
            for t in [t for t, (_, last) in self.leaving.items() if last <= index]:
                del self.leaving[t]
                self._release_x(t)
        if self.leaving_xbar:
            for t in [t for t, last in self.leaving_xbar.items() if last <= index]:
                del self.leaving_xbar[t]
                self._release_xbar(t)

    # ------------------------------------------------------------------------ phases
    def run_forward(self, x0: Comps, x0_is_tuple: bool) -> Tuple[Comps, bool]:
        """The forward phase; returns the chain's output components."""
        self.devices = rng.cuda_devices_of(list(x0) + [p for ps in self.params for p in ps[:1]])
        self.xs[0] = tuple(x0)
        self.is_tuple[0] = x0_is_tuple
        self.rg[0] = tuple(isinstance(c, torch.Tensor) and c.requires_grad for c in x0)
        self._live()
        for index, kind, s in self.cplan.forward_ops:
            self._do(index, kind, s, first=kind in FORWARD_KINDS)
        out = self._input(self.L, len(self.cplan.plan.ops), "output")
        return out, self.is_tuple[self.L]

    def run_backward(self, grads: Comps) -> Comps:
        """The backward phase from the gradient of the output; returns the gradient of the
        chain's input components (parameter gradients are accumulated into ``.grad``)."""
        for k, (index, kind, s) in enumerate(self.cplan.backward_ops):
            self._do(index, kind, s, first=False, grads=grads if k == 0 else None)
        leftover = [f"x[{s}]" for s in self.xs] + [f"xbar[{s}]" for s in self.xbars] + \
                   [f"delta[{s}]" for s in self.deltas if s != 0] + \
                   [f"offloaded x[{s}]" for s in self.host]
        if 0 not in self.deltas:
            raise InvalidPlanError("the plan ends without B 0", len(self.cplan.plan.ops))
        if leftover:
            raise InvalidPlanError("the plan ends with " + ", ".join(leftover) +
                                   " still in memory", len(self.cplan.plan.ops))
        return self.deltas.pop(0)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------------ autograd
class ChainFunction(torch.autograd.Function):
    """Runs the forward phase in ``forward`` and the backward phase in ``backward``.

    Inputs: the executor, the number of input components, the input components, then a
    dummy tensor that requires grad (so the output requires grad even for integer inputs, as
    ``torch.utils.checkpoint`` does). Parameters are not inputs: each block's backward
    accumulates their gradients into ``.grad`` (with their hooks) as soon as it runs, as plain
    training and ``torch.utils.checkpoint(use_reentrant=True)`` do, so they are never held
    twice; hence ``torch.autograd.grad(loss, params)`` does not see them (use ``.backward()``).
    Outputs: the tensor components of the chain's output, detached from the graphs the
    executor keeps.
    """

    @staticmethod
    def forward(ctx, executor: ChainExecutor, n_in: int, *args: Any):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        x0 = args[:n_in]
        ctx.executor = executor
        ctx.n_in = n_in
        ctx.n_params = len(args) - n_in
        out, is_tuple = executor.run_forward(tuple(x0), executor.x0_is_tuple)
        executor.out_layout = [i for i, c in enumerate(out) if isinstance(c, torch.Tensor)]
        executor.out_template = out
        executor.n_out = len(out)
        executor.out_is_tuple = is_tuple
        rg = executor.rg[executor.L]
        tensors = [out[i].detach() for i in executor.out_layout]
        nondiff = [t for t, i in zip(tensors, executor.out_layout) if not rg[i]]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):  # type: ignore[override]
        ex: ChainExecutor = ctx.executor
        full: List[Optional[torch.Tensor]] = [None] * ex.n_out
        for i, g in zip(ex.out_layout, grads):
            full[i] = g
        d0 = ex.run_backward(tuple(full))
        gx = [d0[i] if i < len(d0) else None for i in range(ctx.n_in)]
        gp = [None] * ctx.n_params  # the dummy; parameter gradients are already in .grad
        ctx.executor = None  # free the executor's memory with the graph
        return (None, None, *gx, *gp)

