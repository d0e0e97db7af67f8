"""One block's run in a chain step (``Frame``) and the saved-tensor hooks that keep, drop
and refill what its graph saves (``Holder``, ``Frame.pack_keep``/``pack_drop``/``unpack``,
``_Refill``): the first unpack in a block's backward hands control to the step
(``ChainStep.backward_reaches``), which recomputes or prefetches what the plan says."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch

from ..profile import _trace
from . import rng
from .accounting import check_unchanged
from .block_calls import BlockCall
from .first_run import FirstRun
from .not_compiled import eager_hook
from .chain_transfers import StorageCopy

if TYPE_CHECKING:  # the step owns its frames; a frame calls back into it
    from .chain_exec import ChainStep

Tensors = Tuple[torch.Tensor, ...]

_unlinked = _trace.unlinked  # a pack hook keeps saved tensors without history


class Holder:
    """What a block's graph keeps for one saved tensor: the tensor (``F_all``), or nothing
    until the recomputation of the block fills it (``F_ck``/``F_none``)."""
    __slots__ = ("frame", "step", "value", "meta", "version", "__weakref__")

    def __init__(self, frame: "Frame", value: Optional[torch.Tensor], meta: Any = None):
        self.frame = frame
        self.step = frame.step  # the graph keeps the step alive through its holders (``Frame``)
        self.value = value
        self.meta = meta  # (shape, dtype, device) of what the recomputation must give back
        # autograd skips its check that a saved tensor was not modified in place when saved
        # tensor hooks pack it: ``unpack`` makes the same check (the value shares the
        # tensor's version counter)
        self.version = value._version if value is not None else 0


def _meta(t: torch.Tensor) -> Tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.device)


class Frame:
    """One block's run in a step: the loop's call, the holders of what its graph saved, the
    random state of its first run, and (while it is xbar) its output."""

    def __init__(self, step: "ChainStep", s: int, call: BlockCall):
        # weakly: the step holds its frames, and a strong link back would be a cycle that
        # only Python's collector frees, so a step whose backward never runs (the loop skips
        # a bad loss) would keep its checkpoints until a collection. The graph's holders keep
        # the step alive while a backward can reach it
        self._step = weakref.ref(step)
        self.s = s
        self.call = call
        self.holders: List[weakref.ReferenceType] = []
        self.state: Optional[rng.RngState] = None
        self.triggered = False
        self.out: Tensors = ()
        self.out_version: Tuple[int, ...] = ()
        self.host: Optional[List[StorageCopy]] = None  # its storages while offloaded
        self.released = False
        self.first: Optional[FirstRun] = None  # its modules' modes and tensors at the first run

    @property
    def step(self) -> "ChainStep":
        step = self._step()
        assert step is not None, "a frame outlived its step (its holders keep the step)"
        return step

    # hooks of the first run ----------------------------------------------------------
    # (all the hooks run eagerly: a compiled block would otherwise trace them, and inside a
    # compiled frame a saved parameter's version reads 0, which the unpack check refuses)
    @eager_hook
    def pack_keep(self, t: torch.Tensor) -> Holder:
        h = Holder(self, _unlinked(t))
        self.holders.append(weakref.ref(h))
        return h

    @eager_hook
    def pack_drop(self, t: torch.Tensor) -> Holder:
        h = Holder(self, None, _meta(t))
        self.holders.append(weakref.ref(h))
        return h

    # > 0 while ``runtime.outside`` reads what a graph saved: an unpack then must not run
    # the plan (recomputations, transfers); it raises, and the reader skips the tensor
    inspecting = 0

    @staticmethod
    @eager_hook
    def unpack(h: Holder) -> torch.Tensor:
        """Autograd reads a saved tensor of a block: its first read in the block's backward
        runs the plan up to ``B s`` (``ChainStep.backward_reaches``: recomputations fill the
        holders, prefetches land), then the value, checked unchanged since it was saved."""
        if Frame.inspecting:
            raise LookupError("a chain's saved tensor: not read while inspecting a graph")
        f, step = h.frame, h.step  # (the holder's own link: no weak reference to follow)
        if step.replaying:  # runtime.tail replays the tail's backward: it must stop above us
            raise RuntimeError(f"{step.name}: the replay of the model's tail reached block "
                               f"{f.s}'s backward")
        if not f.triggered:
            f.triggered = True
            step.backward_reaches(f.s)
        if h.value is None:
            raise RuntimeError(f"{step.name}: block {f.s}: a saved tensor was not "
                               "recomputed (the plan has no F_all of this block before its B)")
        if h.value._version != h.version:  # (the message is built only then)
            check_unchanged(h.value, h.version, f"{step.name}: block {f.s}")
        return h.value

    # hooks of the recomputation ------------------------------------------------------
    def refill(self) -> "_Refill":
        return _Refill(self)

    def saved(self) -> List[torch.Tensor]:
        out = []
        for r in self.holders:
            h = r()
            if h is not None and h.value is not None:
                out.append(h.value)
        return out


class _Refill:
    """Pack hooks of ``F_all s`` in the backward phase: the i-th tensor the recomputation
    saves fills the i-th holder of the first run (as ``torch.utils.checkpoint`` matches them)."""

    def __init__(self, frame: Frame):
        self.frame = frame
        self.n = 0
        self.mismatch: Optional[Tuple[int, Any, Any]] = None

    @eager_hook
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        i = self.n
        self.n += 1
        v = _unlinked(t)
        if i < len(self.frame.holders):
            h = self.frame.holders[i]()
            if h is not None:  # None: autograd already freed that node
                if h.meta is not None and _meta(t) != h.meta:
                    # handing it to the first run's backward would read out of bounds
                    if self.mismatch is None:
                        self.mismatch = (i, h.meta, _meta(t))
                    return v
                h.value, h.version = v, v._version
        # not ``t``: this graph is never run backward, so nothing would break the cycle
        # node -> saved ``t`` -> t.grad_fn (the node) and the step it reaches would leak
        return v

    @staticmethod
    @eager_hook
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def check(self) -> None:
        f = self.frame
        if self.mismatch is not None:
            i, first, again = self.mismatch
            raise RuntimeError(
                f"{f.step.name}: block {f.s}: saved tensor {i} had shape/dtype/device {first} "
                f"on its first run but {again} when recomputed: its forward must do the same "
                "work when run again (same train/eval mode, inputs, random state and autocast; "
                "do not call model.eval() between the forward and the backward)")
        if self.n != len(f.holders):
            raise RuntimeError(
                f"{f.step.name}: block {f.s} saved {len(f.holders)} tensors for backward on its "
                f"first run but {self.n} when recomputed: its forward must do the same work when "
                "run again with the same inputs, random state and autocast (it cannot depend on "
                "global state that changed in between)")
