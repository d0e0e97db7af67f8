"""One call of a block as the model's own loop made it, kept so the block can run again.

A recomputation must call block ``s`` exactly as the loop did: the same positional and
keyword arguments (attention masks, rotary embeddings, ``cache_position``, flags), but with
the chain's value ``x[s]`` (the previous block's outputs) coming from the plan rather than
from the loop. ``BlockCall`` flattens the arguments (``torch.utils._pytree``), marks the
tensors that ARE outputs of the previous block (by identity: the loop passed them on) as
slots, and keeps every other argument by reference (shared tensors cost nothing extra: the
loop holds them for every block anyway).

For block 0 (and a block whose loop changed the value between blocks, e.g. ``h = h * 2``),
no argument is a previous output: the first tensor argument is the chain's value. Such a
value is *anchored*: held as it was passed, never taken from a recomputed output.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

Tensors = Tuple[torch.Tensor, ...]
Comps = Tuple[Any, ...]  # the components of a value passed between blocks


def tensor_leaves(value: Any) -> Tensors:
    """The tensors in a block's output (tuples, lists, dicts, ModelOutputs), in order."""
    return tuple(v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor))


class BlockCall:
    """The arguments of one block call with the chain's value taken out (see module doc)."""

    def __init__(self, args: Sequence[Any], kwargs: Dict[str, Any],
                 prev_out: Optional[Tensors], all_inputs: bool = False):
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            # tensors only (a bare chain, most blocks): what tree_flatten would give, without
            # its cost (about 10 us a call, a call per block a step)
            leaves, self.spec = list(args), None
        else:
            leaves, self.spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        self.slots: List[Tuple[int, int]] = []      # (leaf position, index in x)
        self.anchored = True
        x: Tensors = ()
        if prev_out:
            where = {id(t): i for i, t in enumerate(prev_out)}
            self.slots = [(j, where[id(v)]) for j, v in enumerate(leaves)
                          if isinstance(v, torch.Tensor) and id(v) in where]
            if self.slots:
                x, self.anchored = prev_out, False
        if not self.slots:
            n_args = len(leaves) if self.spec is None else len(pytree.tree_leaves(tuple(args)))
            tensors = [j for j, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
            if all_inputs:  # a bare chain: every tensor input is the chain's value
                picked = [j for j in tensors if j < n_args] or tensors
            else:
                picked = [j for j in tensors if j < n_args][:1] or tensors[:1]
            self.slots = [(j, i) for i, j in enumerate(picked)]
            x = tuple(leaves[j] for j in picked)
        self.kept = list(leaves)
        for j, _ in self.slots:
            self.kept[j] = None  # the value: held (or not) as the plan says, not here
        self.x = x  # the value at the call (the step drops it once the block has run)
        self.rg = tuple(t.requires_grad for t in x)
        # versions of the other tensor arguments at the call: a recomputation reads them again
        self.kept_versions = tuple((j, v._version) for j, v in enumerate(self.kept)
                                   if isinstance(v, torch.Tensor))

    def bind(self, x: Sequence[torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """``(args, kwargs)`` of the call with ``x`` as the chain's value."""
        leaves = list(self.kept)
        for j, i in self.slots:
            leaves[j] = x[i]
        if self.spec is None:
            return tuple(leaves), {}
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs

    def unlink(self) -> None:
        """After the block's first run: keep the call's tensors without their autograd
        history (the same storages, version counters and grad flags). A recomputation never
        backpropagates through them (``chain_exec`` refills the first run's holders), and kept
        with their history they could reach the step's own graph (the loop changed the value
        between blocks, or passes a later block an earlier block's output), whose holders reach
        the step that keeps this call: a cycle through C++ that gc cannot free."""
        self.x = tuple(t.detach() for t in self.x)  # (``rg`` keeps the grad flags)
        self.kept = [v.detach().requires_grad_(v.requires_grad)
                     if isinstance(v, torch.Tensor) and v.grad_fn is not None else v
                     for v in self.kept]

    def shared_tensors(self) -> List[torch.Tensor]:
        return [v for v in self.kept if isinstance(v, torch.Tensor)]

    def changed_arguments(self) -> List[int]:
        """Leaf positions of tensor arguments modified in place since the call (a
        recomputation would read values the first run never saw)."""
        return [j for j, v in self.kept_versions if self.kept[j]._version != v]


def as_components(value: Any, stage: int) -> Tuple[Comps, bool]:
    """A block's return value as components (a bare chain passes them to the next block as
    its positional arguments), and whether it was a tuple."""
    if isinstance(value, torch.Tensor):
        return (value,), False
    if isinstance(value, tuple):
        return tuple(value), True
    raise TypeError(
        f"scheduler.wrap: block {stage} returned {type(value).__name__}; blocks must return a "
        "tensor or a tuple of tensors (and constants), which is passed to the next block as "
        "positional arguments")


def signature(args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None) -> Any:
    """What makes two calls need different plans: shapes, dtypes, devices and grad flags of
    the tensors, the types (and small constant values) of everything else."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    sig = []
    for v in leaves:
        if isinstance(v, torch.Tensor):
            sig.append((tuple(v.shape), str(v.dtype), str(v.device), v.requires_grad))
        elif isinstance(v, (bool, int, float, str, type(None))):
            sig.append(("const", v))
        else:
            sig.append(("const", type(v).__name__))
    return (str(spec), tuple(sig))


def weights_dtype(blocks: Sequence[nn.Module]) -> Optional[str]:
    """The dtype of the blocks' first floating-point parameter, or None: what ``model.float()``
    or ``.half()`` changes where block 0's arguments show no dtype (integer token ids into an
    embedding block), so that plans and Mimose samples learnt before are not reused after."""
    for block in blocks:
        for p in block.parameters():
            if p.is_floating_point():
                return str(p.dtype).replace("torch.", "")
    return None


def describe_arguments(args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None
                       ) -> Dict[str, str]:
    """``signature`` per argument, in words, by name (``args[i]``, keyword names): what an
    error says when two calls' signatures differ."""
    def words(v: Any) -> str:
        leaves = pytree.tree_leaves(v)
        if isinstance(v, torch.Tensor):
            return (f"a tensor {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
                    f"{' requiring grad' if v.requires_grad else ''}")
        if len(leaves) != 1 or leaves[0] is not v:
            return f"{type(v).__name__} of [{', '.join(words(x) for x in leaves)}]"
        return repr(v) if isinstance(v, (bool, int, float, str, type(None))) else \
            type(v).__name__
    out = {f"args[{i}]": words(v) for i, v in enumerate(args)}
    out.update((k, words(v)) for k, v in (kwargs or {}).items())
    return out


def block_list(blocks: Any, where: str) -> List[nn.Module]:
    """The blocks of a bare chain as a list: an ``nn.Sequential``, an ``nn.ModuleList`` or a
    non-empty list or tuple of modules (``where`` names the caller in the error)."""
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        blocks = list(blocks)
    if not isinstance(blocks, (list, tuple)) or not blocks or \
            not all(isinstance(b, nn.Module) for b in blocks):
        raise TypeError(f"{where}: blocks must be an nn.Sequential, an nn.ModuleList or a "
                        f"non-empty list of nn.Module, got {type(blocks).__name__}")
    return list(blocks)
