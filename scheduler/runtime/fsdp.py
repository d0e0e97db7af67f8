"""What FSDP, and the wrappers FSDP setups put around blocks, do to a block list, as far as
the runner must know it.

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
no gathered parameters); what a block holds (``block_tensors``: never an activation) and
whether the blocks train (``trains``) include the flat parameter's views. Torch's
checkpoint/offload wrapper (``checkpoint_wrapper``, which accelerate's FSDP
``activation_checkpointing`` puts inside each unit) is refused: the block would be handled
twice (``refuse_wrapped``).
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

# what FSDP1 units, torch's checkpoint/offload wrappers and torch.compile call the module
# they wrap
_INNER = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def _inner(m: nn.Module) -> Optional[nn.Module]:
    """The module ``m`` wraps, or None (its submodules are looked up: ``getattr`` on a module
    that has none is slow, and this runs for every block at every step)."""
    mods = m._modules
    return next((mods[a] for a in _INNER if mods.get(a) is not None), None)


def _is_unit(m: nn.Module) -> bool:
    return m._modules.get("_fsdp_wrapped_module") is not None


def wrappers(entries: Optional[Sequence[nn.Module]], s: int, block: nn.Module
             ) -> List[nn.Module]:
    """The modules that replaced ``block`` at position ``s`` of ``entries`` (the list the
    model's loop calls the blocks through), outermost first: FSDP1 units, torch's
    checkpoint/offload wrappers, ``torch.compile``'s; empty when the entry is the block."""
    if entries is None or s >= len(entries):
        return []
    out: List[nn.Module] = []
    for m in _wrapped_inside(entries[s]):
        if m is block:
            return out
        out.append(m)
    return []


def unit_of(entries: Optional[Sequence[nn.Module]], s: int, block: nn.Module
            ) -> Optional[nn.Module]:
    """The FSDP1 unit that replaced ``block`` in ``entries`` (what to call to run it with
    its parameters gathered; a compiled unit included), or None."""
    found = wrappers(entries, s, block)
    return found[0] if any(_is_unit(w) for w in found) else None


def unwrapped(block: nn.Module) -> nn.Module:
    """What an FSDP1 unit wraps (through nested units), else the block: where the runner
    intercepts a block's calls, so that its measuring and recomputing forwards run inside
    the unit's forward or through it, never the unit's forward twice at once."""
    while _is_unit(block):
        block = block._modules["_fsdp_wrapped_module"]
    return block


def refuse_units_in_mixed_precision(blocks: Sequence[nn.Module],
                                    entries: Optional[Sequence[nn.Module]], name: str) -> None:
    """``scheduler.wrap``'s own loop calls the units, and a profiling or collection step
    runs a unit's forward once more to measure it: with FSDP1's mixed precision the unit then
    never reduces its gradient (the optimizer meets an unsharded one). Raise instead."""
    for s, m in _around(blocks, entries):
        mp = getattr(m, "mixed_precision", None) if _is_unit(m) else None
        if mp is not None and getattr(mp, "param_dtype", None) is not None:
            raise RuntimeError(
                f"{name}: block {s} is an FSDP1 unit with mixed precision, which a chain "
                "measured on its step would run twice; use scheduler.checkpoint(model, budget) "
                "on the model that loops over the blocks (before or after FSDP wraps it)")


def _wrapped_inside(block: nn.Module) -> Iterator[nn.Module]:
    """The block and what it wraps, outermost first (a block that is itself a unit)."""
    seen: List[nn.Module] = []
    m: Optional[nn.Module] = block
    while m is not None and all(m is not k for k in seen):
        seen.append(m)
        yield m
        m = _inner(m)


def _around(blocks: Sequence[nn.Module], entries: Optional[Sequence[nn.Module]]
            ) -> Iterator[Tuple[int, nn.Module]]:
    """``(s, module)`` for every module around block ``s`` in its list and every module it
    is or wraps; nothing for a block that is its entry and wraps nothing (the usual case,
    checked at every step: no walk)."""
    held = list(entries) if entries is not None else list(blocks)  # (a ModuleList, once)
    for s, b in enumerate(blocks):
        if (s >= len(held) or held[s] is b) and _inner(b) is None:
            continue
        for m in [*wrappers(entries, s, b), *_wrapped_inside(b)]:
            yield s, m


def refuse_wrapped(blocks: Sequence[nn.Module], entries: Optional[Sequence[nn.Module]],
                   name: str, at_step: bool = False) -> None:
    """Raise when torch's checkpoint or offload wrapper wraps a block, around it in its list
    or inside it (``apply_activation_checkpointing``; accelerate's FSDP
    ``activation_checkpointing``): the block would be recomputed or moved twice, the
    wrapper's own inside the plan's. At the call ``ValueError``, at a step (the wrapper put
    on since) ``RuntimeError``."""
    for s, m in _around(blocks, entries):
        if m._modules.get("_checkpoint_wrapped_module") is not None:
            raise (RuntimeError if at_step else ValueError)(
                f"{name}: block {s} is wrapped by {type(m).__name__} (torch's activation "
                "checkpointing or offloading: apply_activation_checkpointing, or "
                "accelerate's FSDP activation_checkpointing), so it would be recomputed "
                "or moved twice; turn that off and let the plan decide")


def compiled_around(blocks: Sequence[nn.Module], entries: Optional[Sequence[nn.Module]]
                    ) -> List[int]:
    """Blocks whose calls a ``torch.compile`` directive wraps from outside: ``block.compile()``
    (or a wrapper's), or ``torch.compile``'s wrapper put around the block in its list. A
    runner that intercepts the block's own ``forward`` runs it outside the compiled region,
    eagerly: such a directive compiles nothing of the block. (A block compiled *as* its list
    entry before the interception keeps its compiled forward: not listed.)"""
    held = list(entries) if entries is not None else list(blocks)
    found = []
    for s, b in enumerate(blocks):
        outside = wrappers(entries, s, b) if s < len(held) and held[s] is not b else []
        if any(m.__dict__.get("_compiled_call_impl") is not None or
               m._modules.get("_orig_mod") is not None for m in outside) or \
                b.__dict__.get("_compiled_call_impl") is not None:
            found.append(s)
    return found


def units(blocks: Sequence[nn.Module], entries: Optional[Sequence[nn.Module]]) -> bool:
    """Whether the blocks are FSDP1 units, or units replaced them in the list."""
    return any(_is_unit(m) for _, m in _around(blocks, entries))


def _flat(t: torch.Tensor) -> bool:
    """FSDP1's marks: a tensor it flattened (an original parameter), its ``FlatParameter``,
    or a view of one (the blocks' parameters while the unit runs)."""
    return bool(getattr(t, "_fsdp_flattened", False) or getattr(t, "_is_flat_param", False) or
                getattr(getattr(t, "_base", None), "_is_flat_param", False))


def managed(t: Any) -> bool:
    """Whether FSDP owns tensor ``t``: FSDP2's DTensor, or FSDP1's marks (``_flat``)."""
    return isinstance(t, torch.Tensor) and (type(t).__name__ == "DTensor" or _flat(t))


def _flat_views(block: nn.Module) -> Iterator[torch.Tensor]:
    """FSDP1's views of a flat parameter that the block's modules hold as plain attributes
    (``use_orig_params=False``); a tensor attribute of any other kind is not one (a block
    may keep an activation there)."""
    for m in block.modules():
        for v in vars(m).values():
            if isinstance(v, torch.Tensor) and _flat(v):
                yield v


def has_weights(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter, or FSDP1's view of one (it then has none)."""
    return any(True for _ in module.parameters()) or any(True for _ in _flat_views(module))


def block_tensors(block: nn.Module) -> Iterator[torch.Tensor]:
    """What a block holds that is never an activation: parameters, buffers, FSDP1's views."""
    yield from block.parameters()
    yield from (b for b in block.buffers() if b is not None)
    yield from _flat_views(block)


def fsdp1(blocks: Sequence[nn.Module], entries: Optional[Sequence[nn.Module]]) -> bool:
    """Whether FSDP1 manages the blocks (in units of their own or inside a larger one)."""
    return units(blocks, entries) or \
        any(_flat(t) for b in blocks for t in block_tensors(b))


def sharded(blocks: Sequence[nn.Module], entries: Optional[Sequence[nn.Module]]) -> bool:
    """Whether FSDP (1 or 2) manages the blocks' parameters."""
    return any("FSDP" in type(b).__name__ or
               any(managed(p) for p in b.parameters())
               for b in blocks) or fsdp1(blocks, entries)


def trains(blocks: Sequence[nn.Module]) -> bool:
    """Whether a tensor of the blocks requires a gradient: a parameter, or FSDP1's view of a
    flat parameter (while the unit holding the blocks runs its forward)."""
    return any(p.requires_grad for b in blocks for p in b.parameters()) or \
        any(t.requires_grad for b in blocks for t in _flat_views(b))
