"""What a block's modules were at its first run (as the run left them), put back for its
recomputation.

Two things may change between a block's forward and its backward without its arguments
changing, and its recomputation must see neither:

- the modules' train/eval flags (a ``model.eval()`` between the forward and the backward);
- the tensors the modules hold as parameters and buffers: ``torch.func.functional_call`` (and
  ``torch.nn.utils.stateless``) runs a module with other tensors in their place and puts the
  module's own back when the call returns, so a recomputation in the backward would run with
  the module's own tensors: wrong gradients without a word (``torch.utils.checkpoint`` gives
  them). The recomputation runs with the forward's, taken when the first run returned: a
  buffer the run itself built or grew (a lazily made table, HF's dynamic rotary frequencies,
  kept beside a plain attribute that says so) is the one it used.

- the values of buffers the run itself changed in place: spectral norm's power iteration
  (``nn.utils.spectral_norm`` and its parametrization) advances ``u`` and ``v`` at every
  training forward and computes the weight from them, so a recomputation from the advanced
  vectors would iterate once more and compute another weight (``torch.utils.checkpoint``
  does). ``before`` keeps such buffers' values as the run found them, the recomputation runs
  from those, and the values the run left are put back after it.

FSDP's tensors are left to FSDP: calling a block gathers its parameters (FSDP2 swaps its
DTensors for the unsharded parameters, FSDP1 binds views of its flat parameter), and the
recomputation calls the block.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from vmalloc import user_warning
from .buffers import restore
from .fsdp import managed

_MISSING = object()  # a name the module no longer holds

Key = Tuple[int, str]  # a buffer: its module's position in ``block.modules()``, its name


@dataclass
class FirstRun:
    modes: List[bool]   # per module of the block (``block.modules()`` order)
    bound: List[Tuple[Dict[str, Any], str, torch.Tensor]]  # (a module's dict, name, tensor)
    # (buffer, its value before the run) for the buffers the run changed in place
    prior: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class Before:
    """The block's buffers as a first run finds them: (key, tensor, version, copy or None),
    and its modules' train/eval modes."""
    buffers: List[Tuple[Key, torch.Tensor, int, Optional[torch.Tensor]]]
    modes: Tuple[bool, ...] = ()


class InPlaceBuffers:
    """Which buffers of each block its forward changes in place, learned from its completed
    runs, so that only those are copied before a first run. A block not seen yet in its
    current train/eval modes (only the latest modes are kept) has all its buffers copied (a
    spectral norm starts iterating when its module turns to training mode)."""

    def __init__(self) -> None:
        self.known: Dict[int, Tuple[Tuple[bool, ...], Set[Key]]] = {}  # block -> (modes, keys)
        self.said: Set[Tuple[str, str]] = set()  # (module type, buffer name) warned of

    def before(self, s: int, block: nn.Module) -> Before:
        """Block ``s``'s buffers before its first run, with a copy of those it may change in
        place (those learned for its current train/eval modes, all of them if not learned
        yet): ``moved`` compares and learns after the run."""
        mods = list(block.modules())
        modes = tuple(m.training for m in mods)
        learned = self.known.get(s)
        keys = learned[1] if learned is not None and learned[0] == modes else None
        bufs = []
        with torch.no_grad():
            for i, m in enumerate(mods):
                for name, t in m._buffers.items():
                    if t is not None:
                        key = (i, name)
                        copy = t.detach().clone() if keys is None or key in keys else None
                        bufs.append((key, t, t._version, copy))
        return Before(bufs, modes)

    def moved(self, s: int, name: str, block: nn.Module, before: Before
              ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(buffer, value before the run) for each buffer the run changed in place. Called
        after a run completed: a run that raised (an out-of-memory error) teaches nothing."""
        prior = []
        learned = self.known.get(s)
        if learned is None or learned[0] != before.modes:
            learned = self.known[s] = (before.modes, set())
        keys = learned[1]
        for key, t, version, copy in before.buffers:
            if t._version == version:
                continue
            keys.add(key)
            if copy is not None:
                prior.append((t, copy))
            else:  # a buffer that never moved before moved now: said once per kind
                kind = (type(list(block.modules())[key[0]]).__name__, key[1])
                if kind not in self.said:
                    self.said.add(kind)
                    user_warning.warn(
                        f"{name}: block {s}'s buffer {key[1]!r} ({kind[0]}) was changed in "
                        "place by its forward for the first time in these train/eval modes; "
                        "its recomputation in this backward sees the changed value, so this "
                        "step's gradients may differ from plain training's (exact from the "
                        "next step on; said once for all blocks)", RuntimeWarning)
        return prior


def capture(block: nn.Module, prior: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
            ) -> FirstRun:
    mods = list(block.modules())
    return FirstRun([m.training for m in mods],
                    [(d, name, t) for m in mods for d in (m._parameters, m._buffers)
                     for name, t in d.items() if t is not None],
                    prior or [])


@contextlib.contextmanager
def as_first_run(block: nn.Module, first: Optional[FirstRun]) -> Iterator[None]:
    """The block's modules in the modes, with the tensors and the in-place changed buffers'
    values of its first run, then back."""
    if first is None:
        yield
        return
    mods = list(block.modules())
    now = [m.training for m in mods]
    modes = first.modes if now != first.modes and len(mods) == len(first.modes) else None
    swapped = []
    for d, name, t in first.bound:
        held = d.get(name, _MISSING)
        if held is not t and not managed(t) and not managed(held):
            swapped.append((d, name, held, t))
    # the values left now, put back after (``buffers.restore``: through ``.data``, which does
    # not move the version counters autograd checks: a graph may have saved the buffer)
    left = [(t, t.detach().clone()) for t, _ in first.prior]
    try:
        if modes is not None:
            for m, training in zip(mods, modes):
                m.training = training
        for d, name, _, t in swapped:
            d[name] = t
        restore(first.prior)
        yield
    finally:
        restore(left)
        if modes is not None:
            for m, training in zip(mods, now):
                m.training = training
        for d, name, held, _ in reversed(swapped):
            if held is _MISSING:
                d.pop(name, None)
            else:
                d[name] = held
