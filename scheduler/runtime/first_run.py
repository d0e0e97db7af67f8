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

FSDP's tensors are left to FSDP: calling a block gathers its parameters (FSDP2 swaps its
DTensors for the unsharded parameters, FSDP1 binds views of its flat parameter), and the
recomputation calls the block.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from .fsdp import managed

_MISSING = object()  # a name the module no longer holds


@dataclass
class FirstRun:
    modes: List[bool]   # per module of the block (``block.modules()`` order)
    bound: List[Tuple[Dict[str, Any], str, torch.Tensor]]  # (a module's dict, name, tensor)


def capture(block: nn.Module) -> FirstRun:
    mods = list(block.modules())
    return FirstRun([m.training for m in mods],
                    [(d, name, t) for m in mods for d in (m._parameters, m._buffers)
                     for name, t in d.items() if t is not None])


@contextlib.contextmanager
def as_first_run(block: nn.Module, first: Optional[FirstRun]) -> Iterator[None]:
    """The block's modules in the modes and with the tensors of its first run, then back."""
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
    try:
        if modes is not None:
            for m, training in zip(mods, modes):
                m.training = training
        for d, name, _, t in swapped:
            d[name] = t
        yield
    finally:
        if modes is not None:
            for m, training in zip(mods, now):
                m.training = training
        for d, name, held, _ in reversed(swapped):
            if held is _MISSING:
                d.pop(name, None)
            else:
                d[name] = held
