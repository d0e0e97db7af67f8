"""The swap runtime's iterations kept in place (``swap_sequence`` decides when): what the running
one counted against its room, and what earlier ones still hold.

An iteration kept in place leaves every saved tensor where it is and counts its storage's bytes
once (``keep``). Each tensor it keeps holds the iteration's ``InPlaceToken``: the token dies with
the last of them, and that is how the runtime learns, with no Python code run at the death (a
weak reference whose callback is ``deque.append``, as ``swap_vars.DeathQueue``), that their
bytes are free. Until then they stay counted as resident, outside any var (``unmanaged``): a
graph kept past its iteration (``retain_graph=True``, an output whose branch the backward did
not run), or an iteration that left in place partway (its tensors kept so far cannot move).
Under a pressure callback the running iteration's kept tensors can still be evicted
(``swap_in_place_pressure``): what they hold on the host is not counted.
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Deque, Dict, Optional

import torch

from .swap_in_place_pressure import KeptEvictor
from .swap_stats import Residency


class KeptInPlaceWarning(RuntimeWarning):
    """Saved tensors kept in place by earlier iterations are still alive and cannot be swapped
    out: the saved-tensor budget is passed by them (``peak_resident_bytes`` shows it)."""


class InPlaceToken:
    """Held by every saved tensor an iteration kept in place (in its pack)."""

    __slots__ = ("__weakref__",)


class InPlace:
    """The running iteration's count while it is kept in place, and the bytes earlier ones
    still hold (in ``residency`` as unmanaged)."""

    def __init__(self, residency: Residency):
        self.residency = residency
        # under a pressure callback: the running iteration's kept tensors, to evict
        self.evictor: Optional[KeptEvictor] = None
        self.on = False       # the running iteration is kept in place
        self.room = 0         # what its saved tensors may add to those resident when it began
        self.bytes = 0        # what they added
        self.packs_left = 0   # packs the plan has left: one more is a sequence it does not know
        self.seen: Dict[int, int] = {}  # data pointer -> bytes, counted once
        self.token_ref: Any = None      # weak: the kept tensors own the token
        # the running iteration's token after it left in place: its backward still ends it
        self.left_ref: Any = None
        # tokens of earlier iterations whose tensors are still alive -> their bytes
        self.held: Dict[Any, int] = {}
        self.deaths: Deque[Any] = deque()

    def finish(self) -> bool:
        """The running iteration is over: its tensors still alive, if any, go on counting until
        its token dies (True then); and so stop those of earlier ones whose token died."""
        held = self.leave()  # (not on: no token to hold)
        self.left_ref = None
        if self.evictor is not None:
            self.evictor.new_iteration()
        self.settle(force=True)
        return held

    def under_pressure(self) -> None:
        """A pressure callback may ask for room from now on: kept tensors are watched."""
        if self.evictor is None:
            self.evictor = KeptEvictor()

    def evict(self, needed: int, device: Any = None) -> int:
        """Free ``needed`` bytes of the running iteration's kept tensors (pressure; on
        ``device`` only, if given): freed."""
        freed = self.evictor.evict(needed, device) if self.evictor is not None else 0
        if freed:
            self._count()
        return freed

    def restore(self, t: torch.Tensor) -> None:
        """An unpack reads the kept tensor ``t``: its bytes back on the device if evicted."""
        if self.evictor.restore(t):
            self._count()

    def begin(self, room: int, packs: int) -> None:
        """The next iteration is kept in place: its saved tensors may add ``room`` bytes, in at
        most ``packs`` packs (its plan's)."""
        self.on, self.room, self.packs_left = True, room, packs

    def keep(self, ptr: int, nbytes: int) -> Optional[InPlaceToken]:
        """Count the saved storage (``ptr``, ``nbytes``) and return the token its pack holds, or
        None if it would pass the room or is one pack more than the plan has (a longer sequence
        with the same start: a forward the plan does not know, as in an evaluation loop without
        ``torch.no_grad()``). Counted per data pointer and size: a storage saved by several ops
        counts once, and one that reuses the address of a storage freed since, with the same
        size, is not counted again (the freed one's bytes still are): the count stays above what
        is held. The caller checks first that a kept tensor is alive (``token_ref``)."""
        self.packs_left -= 1
        if self.packs_left < 0:
            return None
        token = self.token_ref() if self.token_ref is not None else None
        if token is None:  # the iteration's first kept tensor
            token = InPlaceToken()
            self.token_ref = weakref.ref(token)
        if self.seen.get(ptr) == nbytes:
            return token
        total = self.bytes + nbytes
        if total > self.room:
            return None
        self.bytes = total
        self.seen[ptr] = nbytes
        return token

    def is_current(self, packed: Any) -> bool:
        """``packed`` (what a pack returned) is a tensor the running iteration kept (also if it
        left in place since)."""
        if len(packed) != 3:
            return False
        ref = self.token_ref if self.token_ref is not None else self.left_ref
        return ref is not None and packed[2] is ref()

    def leave(self) -> bool:
        """The running iteration takes the full path from here; True if it kept something (its
        bytes go on counting until its token dies)."""
        kept = self._hold()
        if self.token_ref is not None:
            self.left_ref = self.token_ref
        self.on, self.room, self.bytes, self.seen, self.token_ref = False, 0, 0, {}, None
        return kept

    def resident(self) -> int:
        """What the running iteration kept and may still hold."""
        return self.bytes if self.on and self.token_ref is not None \
            and self.token_ref() is not None else 0

    def settle(self, force: bool = False) -> None:
        """Stop counting the tensors of earlier iterations whose token died since. ``held`` is
        the truth: ``force`` (an iteration's end, the context's exit) sets the unmanaged bytes
        from it even without a death, should an interrupt have cut an earlier call between its
        pops and its count."""
        if self.deaths or force:
            while self.deaths:
                self.held.pop(self.deaths.popleft(), None)
            if self.evictor is not None:
                self.evictor.prune()
            self._count()

    def _count(self) -> None:
        """The unmanaged bytes from ``held``, less the kept bytes evicted to the host."""
        total = sum(self.held.values())
        if self.evictor is not None and self.evictor.on_host:
            total = max(total - self.evictor.off_device(), 0)
        if total != self.residency.unmanaged:
            self.residency.set_unmanaged(total)

    def _hold(self) -> bool:
        token = self.token_ref() if self.token_ref is not None else None
        if token is None or not self.bytes:
            return False
        self.held[weakref.ref(token, self.deaths.append)] = self.bytes
        self._count()
        return True
