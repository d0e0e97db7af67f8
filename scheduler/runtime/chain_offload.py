"""The offloads and prefetches of one chain step (``chain_exec.ChainStep``): which storages of
a stored value may move to the host, the copies out and back on each device's transfer engine
(``chain_transfers``), when a moved value's device memory goes (the plan's release points), and
what must never move (the blocks' weights and buffers, the loop's own arguments, values blocks
pass through unchanged).

The step owns one ``Offloader`` and calls it: ``transfer`` (an ``offload``/``prefetch`` op),
``sync_before`` and ``after`` (around every op), ``ready_x``/``wait_xbar`` (before reading a
value that may have been prefetched), ``readable``/``offloaded``/``held`` (x[s] while it is
moved), ``not_activations``/``state_keys``/``note_passed``/``passed_through`` (which storages
are not the plan's), ``restore_escaped`` (the forward's end) and ``abandon`` (a forward stopped
half way).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Sequence, Set,
                    Tuple)

import torch

from vmalloc import user_warning
from ..errors import InvalidPlanError
from . import accounting, fsdp
from .block_calls import BlockCall
from .chain_transfers import StorageCopy, ChainTransfers
from .frames import Frame, Tensors

if TYPE_CHECKING:  # the step owns its offloader; the offloader reads the step's values
    from .chain_exec import ChainStep


@dataclass
class Offloaded:
    """x[s] while it is on the host: the same tensor objects, their storages emptied."""
    comps: Tensors
    copies: List[StorageCopy]
    released: bool = False


class Offloader:
    """The host side of one step: offloaded x[s] (``host``), prefetched x[s] whose copy may be
    in flight (``pending``), offloaded values still read until a later op (``leaving``,
    ``leaving_xbar``) and the offload ops' copy events (``offload_events``).

    ``transfers``: the transfer engine of a storage's device (``None``: the plan moves
    nothing). ``state_tensors``: what the blocks held as the step began (weights, buffers):
    never activations (``state_keys``)."""

    def __init__(self, step: "ChainStep",
                 transfers: Optional[Callable[[torch.device], ChainTransfers]],
                 state_tensors: Sequence[torch.Tensor]):
        # weakly, as a ``Frame`` links back: a strong link would be a cycle that only
        # Python's collector frees, keeping a dropped step's checkpoints until a collection
        self._step = weakref.ref(step)
        self.transfers = transfers
        self.state_tensors = list(state_tensors)
        self.host: Dict[int, Offloaded] = {}                # offloaded x[s]
        self.pending: Dict[int, List[StorageCopy]] = {}     # prefetched x[s], copy maybe in flight
        self.leaving: Dict[int, Tuple[Tensors, int]] = {}   # offloaded, still read until op k
        self.leaving_xbar: Dict[int, int] = {}              # xbar[t] offloaded, read until op k
        self.offload_events: Dict[int, List[object]] = {}   # offload op index -> copy events
        # storages blocks return unchanged, by key, each weakly (``passed_through``)
        self._passed: Dict[int, weakref.ReferenceType] = {}

    @property
    def step(self) -> "ChainStep":
        """The step this offloader belongs to (alive while anything calls it)."""
        step = self._step()
        assert step is not None, "an offloader outlived its step (the step owns it)"
        return step

    def clear(self) -> None:
        """Let go of every value held on the host side (``abandon`` first restores what is
        still read outside the step)."""
        for d in (self.host, self.pending, self.leaving):
            d.clear()

    def abandon(self, loop_outs: Dict[int, Tuple[weakref.ReferenceType, ...]]) -> None:
        """The forward stopped half way (an exception, a Ctrl-C in a block): no backward will
        come, so the step lets go of its values. An offloaded value still used outside the step
        (``loop_outs``, the blocks' outputs as the loop got them, weakly: a forward hook's list,
        the model's locals in the traceback a debugger reads, a detached alias) has an empty
        storage (released): its memory comes back first, as at the forward's end
        (``restore_escaped``), or reading it would crash the process. The rest is let go. The
        step's own references to the calls must be dropped before (they would count as uses
        from outside)."""
        try:
            for copies in self.pending.values():  # a prefetch in flight lands before any read
                for sc in copies:
                    ChainTransfers.wait(sc)
            if self._released_copies():
                mine, ids = self._own_uses()
                kept: Set[int] = set()
                for refs in loop_outs.values():
                    kept |= self._kept(refs, ids)
                self._restore_used(self._released_copies(), kept, mine)
        finally:
            self.clear()

    # ------------------------------------------------------------------- values held
    def readable(self, s: int) -> Optional[Tensors]:
        """x[s] where a forward may still read it though the plan offloaded it: while its
        copy out runs (``leaving``), or the caller's input (offloaded but never moved)."""
        if s in self.leaving:
            return self.leaving[s][0]
        off = self.host.get(s)
        return off.comps if off is not None and not off.copies else None

    def offloaded(self, s: int) -> bool:
        """Whether x[s] is on the host (a prefetch brings it back)."""
        return s in self.host

    def held(self) -> List[Tensors]:
        """The values this side still holds on the device: those leaving and the caller's
        input (released storages count 0 bytes; the caller's input counts)."""
        return [c for c, _ in self.leaving.values()] + \
            [h.comps for h in self.host.values() if not h.copies]

    # On a GPU a prefetch's bytes arrive on a side stream: whatever reads them (a block's
    # forward, a recomputation, autograd's backward of a block) must first make the compute
    # stream wait for the copy. Every read of a value that may have been prefetched goes
    # through one of these (tests/test_transfer_waits.py checks it on the CPU).
    def ready_x(self, s: int) -> None:
        """Wait for the prefetch of x[s], if one is in flight."""
        for sc in self.pending.pop(s, ()):
            ChainTransfers.wait(sc)

    def wait_xbar(self, f: Frame) -> None:
        """Wait for the prefetch of what F_all ``f.s`` kept, if one is in flight."""
        if f.host is not None and not f.released and f.s not in self.leaving_xbar:
            for sc in f.host:
                ChainTransfers.wait(sc)

    # ------------------------------------------------------------- storages not ours
    @contextlib.contextmanager
    def not_activations(self, *stages: int) -> Iterator[Set[int]]:
        """Storages that are never activations, for the body: what the blocks' weights and
        buffers hold now (the step's start's tensors, which FSDP1 may have given new
        ``.data``) and what blocks ``stages`` hold now (FSDP1 gives a block new views of its
        unit's gathered flat parameter at each of the unit's forwards)."""
        step = self.step
        now = [t for s in stages if 0 <= s < step.L for t in fsdp.block_tensors(step.blocks[s])]
        # the storages are held for the body (not the tensors: ``keys_held``), not for
        # longer: FSDP2 frees some shards by dropping them
        with accounting.keys_held(itertools.chain(self.state_tensors, now)) as keys:
            yield keys

    def state_keys(self) -> Set[int]:
        """The keys of the storages the step's weights and buffers hold now, for a use right
        away: not kept from the step's start, whose storages may since be freed and their
        addresses taken by activations (``not_activations``)."""
        return {accounting.storage_key(t) for t in self.state_tensors}

    def note_passed(self, outs: Sequence[torch.Tensor], call: BlockCall) -> None:
        """Note the outputs that are the call's own arguments (passed through unchanged)."""
        ins = {id(t) for t in call.x} | {id(t) for t in call.shared_tensors()}
        self._passed.update((accounting.storage_key(t), weakref.ref(t.untyped_storage()))
                            for t in outs if id(t) in ins)

    def passed_through(self) -> Set[int]:
        """The storages blocks returned unchanged (T5's position bias) that still live: a key
        is an address, and a dead one may be a new activation's since."""
        return {k for k, ref in self._passed.items() if ref() is not None}

    def _protected(self) -> Set[int]:
        """Storages the plan must not move: the loop's own arguments (masks, rotary tables
        passed to every block) and values blocks pass through unchanged (T5's position bias):
        later blocks read them whatever the plan says about the stage they came from."""
        keys = self.passed_through()
        for f in self.step.frames:
            if f is not None:
                keys |= {accounting.storage_key(t) for t in f.call.shared_tensors()}
        return keys

    def _movable(self, mine: Sequence[torch.Tensor], consumer: Optional[Frame],
                 skip: Set[int]) -> List[torch.UntypedStorage]:
        """The storages of ``mine`` (one stored item) that may move to the host: not in
        ``skip`` and shared with no other held item, the tensors that ``consumer`` (the
        F_all that read this very value) saved of it aside."""
        keys = {accounting.storage_key(t) for t in accounting.tensors_of(mine)}
        skip = skip | self._protected()
        ours = {id(t) for t in mine}
        if consumer is not None:
            ours |= {id(t) for t in consumer.saved() if accounting.storage_key(t) in keys}
        others = {accounting.storage_key(t)
                  for t in accounting.tensors_of(self.step._held_tensors()) if id(t) not in ours}
        storages = {}
        for t in accounting.tensors_of(mine):
            k = accounting.storage_key(t)
            if k not in skip and k not in others and t.untyped_storage().nbytes() > 0:
                storages[k] = t.untyped_storage()
        return list(storages.values())

    # -------------------------------------------------------------------- the ops
    def transfer(self, index: int, kind: str, s: int) -> None:
        """Run op ``index``: ``offload s`` or ``prefetch s``."""
        if kind == "offload":
            self._offload(index, s)
        else:
            self._prefetch(index, s)

    def sync_before(self, index: int) -> None:
        """Op ``index`` is next: wait for the offloads whose memory the plan reuses from here
        on (the compiled plan's ``sync_before``)."""
        for o in self.step.cplan.sync_before.get(index, ()):
            for ev in self.offload_events.pop(o, ()):
                ev.synchronize()  # the simulator reuses this memory from here on

    def after(self, index: int) -> None:
        """Op ``index`` ran: drop the device copies of offloaded values nobody reads any more."""
        if self.leaving:
            for t in [t for t, (_, last) in self.leaving.items() if last <= index]:
                del self.leaving[t]
                self._release_x(t)
        if self.leaving_xbar:
            for t in [t for t, last in self.leaving_xbar.items() if last <= index]:
                del self.leaving_xbar[t]
                self._release_xbar(t)

    def _offload(self, index: int, s: int) -> None:
        step = self.step
        if self.transfers is None:
            raise InvalidPlanError(f"op {index} (offload {s}): no transfer engine", index)
        prev = step.xbars.get(s - 1)
        if s not in step.xs and prev is not None and not prev.released and \
                s - 1 not in self.leaving_xbar:  # on the device: never moved, or back
            self.wait_xbar(prev)  # a prefetch still in flight lands before it is copied out
            self._offload_xbar(index, s - 1)
            return
        if s not in step.xs:
            raise InvalidPlanError(f"op {index} (offload {s}): the input of stage {s} is not "
                                   "in memory", index)
        self.ready_x(s)
        comps = step.xs.pop(s)
        step.versions.pop(s, None)
        step.stats.offloaded += 1
        if s == 0:
            # the caller's input: the caller still holds it, so moving it would free nothing
            self.host[0] = Offloaded(comps, [], released=True)
            step.stats.input_offloads_skipped += 1
            return
        with self.not_activations(s - 1, s) as weights:
            storages = self._movable(comps, step.xbars.get(s), weights)
        self.host[s] = Offloaded(comps, self._copy_out(index, storages))
        release = step.cplan.release.get(index, index)
        if release > index:
            self.leaving[s] = (comps, release)
        else:
            self._release_x(s)

    def _offload_xbar(self, index: int, t: int) -> None:
        """Move what F_all t keeps (saved tensors and output, not its input) to the host."""
        step = self.step
        f = step.xbars[t]
        inp = step.xs.get(t) or step.anchors.get(t) or \
            (step.xbars[t - 1].out if t - 1 in step.xbars else ())
        with self.not_activations(t) as weights:
            skip = weights | {accounting.storage_key(c) for c in accounting.tensors_of(inp)}
            storages = self._movable(list(f.saved()) + list(f.out), step.xbars.get(t + 1), skip)
        f.host = self._copy_out(index, storages)
        release = step.cplan.release.get(index, index)
        if release > index:
            self.leaving_xbar[t] = release
        else:
            self._release_xbar(t)
        step.stats.offloaded += 1

    def _prefetch(self, index: int, s: int) -> None:
        # a value still leaving (its copy out may run yet) never lost its memory: it stays,
        # and prefetch_storage copies only what was released (it hands the buffers back)
        step = self.step
        f = step.xbars.get(s - 1)
        if s not in self.host and f is not None and f.host is not None and \
                (f.released or s - 1 in self.leaving_xbar):
            self.leaving_xbar.pop(s - 1, None)
            self._copy_in(f.host)
            f.released = False
        elif s in self.host:
            off = self.host.pop(s)
            self.leaving.pop(s, None)
            self._copy_in(off.copies)
            if off.released:
                self.pending[s] = off.copies
            step._hold(s, off.comps)
        else:
            raise InvalidPlanError(f"op {index} (prefetch {s}): x[{s}] was never offloaded",
                                   index)
        step.stats.prefetched += 1
        step._live()

    def _copy_out(self, index: int, storages: Sequence[torch.UntypedStorage]
                  ) -> List[StorageCopy]:
        """Start copying ``storages`` to the host, each on its device's transfer engine;
        offload op ``index`` keeps the copies' events (``sync_before``)."""
        assert self.transfers is not None  # (``_offload`` checked)
        copies = [self.transfers(st.device).offload_storage(st) for st in storages]
        self.offload_events[index] = [sc.host.event for sc in copies if sc.host.event is not None]
        return copies

    def _copy_in(self, copies: Sequence[StorageCopy]) -> None:
        """Prefetch ``copies`` (each copies back only if its memory was released)."""
        assert self.transfers is not None  # (only what ``_copy_out`` made comes back)
        for sc in copies:
            self.transfers(sc.storage.device).prefetch_storage(sc)

    def _release_copies(self, copies: Sequence[StorageCopy]) -> None:
        protected = self._protected()  # blocks run since the offload may read it
        for sc in copies:
            if sc.storage._cdata not in protected:
                ChainTransfers.release(sc)

    def _release_x(self, s: int) -> None:
        off = self.host.get(s)
        if off is not None and not off.released:
            self._release_copies(off.copies)
            off.released = True

    def _release_xbar(self, t: int) -> None:
        f = self.step.xbars.get(t)
        if f is None:
            return
        self._release_copies(f.host or ())
        f.released = True

    # ------------------------------------------------------------- the forward's end
    def restore_escaped(self, loop_outs: Dict[int, Tuple[weakref.ReferenceType, ...]]) -> None:
        """The forward's last block ran: the loop holds none of the earlier blocks' outputs
        (``loop_outs``, weakly) any more, unless the model keeps them (HF's
        ``output_hidden_states``, deep supervision, a hook) or autograd outside the blocks
        saved them. An offload released their memory (resized to 0: reading them would crash
        or read garbage): bring it back now; the plan's memory saving is lost for them, and a
        warning says so. The last block's input cannot be judged here (the loop passes it to
        the running block)."""
        step = self.step
        if not self._released_copies():
            return  # nothing offloaded is off the device (rotor's plans: never)
        mine, ids = self._own_uses()
        back = []
        for s, refs in loop_outs.items():
            if s >= step.L - 2:  # the last block's input and output are the loop's own now
                continue
            f = step.xbars.get(s)
            copies = list(f.host or ()) if f is not None else []
            off = self.host.get(s + 1)
            copies += off.copies if off is not None else []
            if self._restore_used(copies, self._kept(refs, ids), mine):
                back.append(s)
        if back:  # (Python's default filter shows it once per message)
            user_warning.warn(
                f"{step.name}: the outputs of blocks {back} are held outside the blocks (the "
                "model returns or keeps them, or autograd saved them outside the blocks): the "
                "plan offloaded them, so their memory came back at the end of the forward and "
                "the budget may be exceeded; plan without offloading (planner='rotor'), or do "
                "not keep them", RuntimeWarning)

    def _released_copies(self) -> List[StorageCopy]:
        """The copies whose device memory is released now (F_all results and x[s])."""
        return [sc for sc in itertools.chain(
            (sc for f in self.step.xbars.values() for sc in (f.host or ())),
            (sc for off in self.host.values() for sc in off.copies)) if sc.released]

    @staticmethod
    def _kept(refs: Tuple[weakref.ReferenceType, ...], ids: Set[int]) -> Set[int]:
        """The storages of a block's outputs as the loop got them (``refs``, weakly) that are
        still alive, unless the step holds the very objects (``ids``: a frozen block's input
        is saved as itself): someone outside the step kept them."""
        return {accounting.storage_key(t) for t in (r() for r in refs)
                if t is not None and id(t) not in ids}

    def _restore_used(self, copies: Sequence[StorageCopy], kept: Set[int],
                      mine: Dict[int, int]) -> bool:
        """Bring back the released storages among ``copies`` that are used outside the step:
        in ``kept``, or by more tensors than the step's own (``mine``, ``_own_uses``) and the
        StorageCopy's storage object (a detached alias, autograd outside the blocks). Whether
        any came back."""
        used = [sc for sc in copies if sc.released and (
            sc.storage._cdata in kept or
            torch._C._storage_Use_Count(sc.storage._cdata) > mine.get(sc.storage._cdata, 0) + 1)]
        for sc in used:
            assert self.transfers is not None  # (a released copy was offloaded by one)
            self.transfers(sc.storage.device).restore(sc)
        return bool(used)

    def _own_uses(self) -> Tuple[Dict[int, int], Set[int]]:
        """The step's own tensors on each storage (distinct objects: distinct TensorImpls) and
        the bases of its views (a view keeps its base, which holds the storage too): uses by
        storage key, and the objects' ids."""
        mine: Dict[int, int] = {}
        ids: Set[int] = set()
        for t in accounting.tensors_of(self.step._held_tensors() + [
                t for off in self.host.values() for t in off.comps]):
            for u in (t, t._base):
                if u is not None and id(u) not in ids:
                    ids.add(id(u))
                    key = accounting.storage_key(u)
                    mine[key] = mine.get(key, 0) + 1
        return mine, ids
