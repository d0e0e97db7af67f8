"""Memory a profiling step holds outside the chain while the blocks run (counted so the measured
chain predicts the real peak): masks and rotary embeddings the blocks are called with (the
runner keeps them for recomputation), what the model's head saved for its backward (an embedding
dropout's mask, the input of the embedding's norm), the runner's random states, and the
gradients of tail weights tied to the head's. The chain has no item for it: it is added to every
op's transient (``fw_tmp``, ``fck_tmp``, ``bw_tmp``: the simulator and the planners count a
stage's transient while, and only while, one of its ops runs, and some op always runs), recorded
in ``meta["outside"]``.

Not seen: the model's local variables that live only during its forward (GPT-2's token and
position embeddings before their sum), and the head's own backward after ``B 0``.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence, Set

import torch

from ..chain import Chain, add_outside
from ..profile.autograd_graph import graph_nodes
from ..profile.storage import storage_bytes, storage_key
from .block_calls import tensor_leaves
from .frames import Frame


class Outside:
    """What a step holds outside the chain from block 0's call to the end of B 0: ``bytes``,
    the distinct storages the model made before the blocks (not parameters, buffers or the
    caller's tensors) that block 0's extra arguments hold (masks, rotary embeddings, kept by
    the runner for recomputation) or the head's autograd graph saved (an embedding dropout's
    mask), the chain's value ``x[0]`` aside; ``params``: the weights the head's backward
    reaches, by identity (``id`` to a weak reference: nothing kept alive, and a freed weight's
    reused ``id`` matches nothing): a tail weight tied to one of them keeps its gradient until
    then. Not seen: the model's local variables that live only during its forward."""

    def __init__(self, nbytes: int, params: Dict[int, "weakref.ref[torch.Tensor]"]):
        self.bytes = nbytes
        self.params = params

    def ties(self, p: torch.Tensor) -> bool:
        """Whether the head's backward reaches the weight ``p`` too: the same autograd leaf
        (one ``AccumulateGrad``, which holds the tail's gradient until the head's joins it),
        not merely one in the same storage (parameters that are views of one flat buffer,
        as ZeRO-1/2 and Megatron's contiguous buffers make them, are distinct leaves)."""
        ref = self.params.get(id(p))
        return ref is not None and ref() is p


def _saved_by(node: Any) -> List[torch.Tensor]:
    """The tensors an autograd node saved (its ``_saved_*`` attributes)."""
    out: List[torch.Tensor] = []
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            v = getattr(node, name)
        except Exception:  # freed, or not a tensor field on this build
            continue
        out.extend(t for t in (v if isinstance(v, (tuple, list)) else (v,))
                   if isinstance(t, torch.Tensor))
    return out


def head_census(args: Sequence[Any], kwargs: Dict[str, Any], not_ours: Set[int]) -> Outside:
    """``Outside`` at block 0's call on ``(args, kwargs)``; ``not_ours``: storages that are
    not the step's (parameters, buffers, the caller's tensors). The chain's value is the
    first tensor argument (what ``BlockCall`` takes as ``x[0]``)."""
    leaves = list(tensor_leaves((tuple(args), kwargs)))
    firsts = list(tensor_leaves(tuple(args)))[:1] or leaves[:1]
    x0 = {storage_key(t) for t in firsts}
    held: List[torch.Tensor] = [t for t in leaves if storage_key(t) not in x0]
    params: Dict[int, "weakref.ref[torch.Tensor]"] = {}
    Frame.inspecting += 1  # another chain's saved tensors (T5's encoder, seen from its
    try:                   # decoder) are that chain's: never unpacked (recomputed) here
        for node in graph_nodes([t.grad_fn for t in leaves]):
            if type(node).__name__ == "AccumulateGrad":
                p = node.variable
                params[id(p)] = weakref.ref(p)
            else:
                held.extend(_saved_by(node))
    finally:
        Frame.inspecting -= 1
    return Outside(storage_bytes(held, exclude=not_ours | x0), params)


def with_outside(chain: Chain, outside: Optional[Outside]) -> Chain:
    """``chain`` with what a profiling or collection step held outside it (``Outside``,
    measured at block 0 where the model's tail is known; None: not measured)."""
    return chain if outside is None else add_outside(chain, outside.bytes)
