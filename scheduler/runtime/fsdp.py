"""What FSDP does to a block list, as far as the runner must know it.

- FSDP2 (``fully_shard``) hooks the blocks themselves: calling a block gathers its
  parameters, which are DTensors outside its forward.
- FSDP1 (the ``FullyShardedDataParallel`` wrapper; accelerate's default FSDP, and
  transformers 4's Trainer's) either makes each block a unit that replaces it in the list the
  model loops over (the transformer-layer wrap policy), its parameters gathered only inside
  the unit's forward, or flattens a larger unit's parameters into one ``FlatParameter`` that
  the blocks see through views; with ``use_orig_params=False`` those views are plain tensor
  attributes, not parameters, and a block has no parameter at all. Its marks
  (``_fsdp_flattened``, ``_is_flat_param``) tell it from FSDP2, which shares the others.

So a block is run again through its unit when one replaced it (``unit_of``); the chain is
measured forward-only during a step under either (``sharded``: a measurement's own backward
would fire FSDP's backward hooks, a reduce-scatter outside the step), and a bare chain under
FSDP1 is never measured before its step (``fsdp1``: outside a unit's forward its blocks have
no gathered parameters); whether the blocks train is read from every tensor they hold,
flattened views included (``trains``). Torch's activation-checkpoint wrapper, which FSDP
setups put around blocks, is refused (``refuse_checkpoint_wrapper``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from .accounting import module_tensors


# what FSDP1 units and torch's activation-checkpoint wrapper call their wrapped module
_INNER = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def wrappers(entries: Optional[Sequence[nn.Module]], s: int, block: nn.Module
             ) -> List[nn.Module]:
    """The modules that replaced ``block`` at position ``s`` of ``entries`` (the list the
    model's loop calls the blocks through), outermost first: FSDP1 units and torch's
    ``checkpoint_wrapper``s; empty when the entry is the block."""
    if entries is None or s >= len(entries):
        return []
    held: Optional[nn.Module] = entries[s]
    out: List[nn.Module] = []
    while held is not block:
        if held is None or len(out) > 8:
            return []  # not a wrapper of this block
        out.append(held)
        held = next((getattr(held, a) for a in _INNER
                     if isinstance(getattr(held, a, None), nn.Module)), None)
    return out


def unit_of(entries: Optional[Sequence[nn.Module]], s: int, block: nn.Module
            ) -> Optional[nn.Module]:
    """The FSDP1 unit that replaced ``block`` in ``entries`` (what to call to run it with
    its parameters gathered), or None."""
    found = wrappers(entries, s, block)
    return found[0] if found and _is_unit(found[0]) else None


def _is_unit(m: nn.Module) -> bool:
    return isinstance(getattr(m, "_fsdp_wrapped_module", None), nn.Module)


def refuse_checkpoint_wrapper(blocks: Sequence[nn.Module],
                              entries: Optional[Sequence[nn.Module]], name: str,
                              only: Optional[int] = None) -> None:
    """Raise when torch's activation checkpointing wraps a block (``apply_activation_
    checkpointing``; accelerate's FSDP ``activation_checkpointing``): the block would be
    checkpointed twice, the wrapper's own recomputation inside the plan's. ``only``: check
    that block alone (at a step: ``RuntimeError``), else every block (at the call:
    ``ValueError``)."""
    error = RuntimeError if only is not None else ValueError
    for s in ([only] if only is not None else range(len(blocks))):
        for m in [blocks[s], *wrappers(entries, s, blocks[s])]:
            if isinstance(getattr(m, "_checkpoint_wrapped_module", None), nn.Module):
                raise error(
                    f"{name}: block {s} is wrapped by {type(m).__name__} (torch's activation "
                    "checkpointing: apply_activation_checkpointing, or accelerate's FSDP "
                    "activation_checkpointing), so it would be checkpointed twice; turn that "
                    "off and let the plan decide what to recompute")


def units(blocks: Sequence[nn.Module], entries: Optional[Sequence[nn.Module]]) -> bool:
    """Whether FSDP1 units replaced the blocks in the list the model loops over."""
    return any(_is_unit(w) for s, b in enumerate(blocks) for w in wrappers(entries, s, b))


def _flat(t: torch.Tensor) -> bool:
    """FSDP1's marks: a tensor it flattened (an original parameter), its ``FlatParameter``,
    or a view of one (the blocks' parameters while the unit runs)."""
    return bool(getattr(t, "_fsdp_flattened", False) or getattr(t, "_is_flat_param", False) or
                getattr(getattr(t, "_base", None), "_is_flat_param", False))


def fsdp1(blocks: Sequence[nn.Module], entries: Optional[Sequence[nn.Module]]) -> bool:
    """Whether FSDP1 manages the blocks (in units of their own or inside a larger one)."""
    return units(blocks, entries) or \
        any(type(b).__name__ == "FullyShardedDataParallel" for b in blocks) or \
        any(_flat(t) for b in blocks for t in module_tensors(b))


def sharded(blocks: Sequence[nn.Module], entries: Optional[Sequence[nn.Module]]) -> bool:
    """Whether FSDP (1 or 2) manages the blocks' parameters."""
    return any("FSDP" in type(b).__name__ or
               any(type(p).__name__ == "DTensor" for p in b.parameters())
               for b in blocks) or fsdp1(blocks, entries)


def trains(blocks: Sequence[nn.Module]) -> bool:
    """Whether a tensor of the blocks requires a gradient: a parameter, or FSDP1's view of a
    flat parameter (while the unit holding the blocks runs its forward)."""
    if any(p.requires_grad for b in blocks for p in b.parameters()):
        return True
    return any(t.requires_grad for b in blocks for t in module_tensors(b))
