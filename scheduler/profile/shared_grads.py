"""Weights that several stages of a chain use (GPT-2's LM head tied to its token embedding, one
block object repeated as in ALBERT): their gradients outlive the stage backwards that make them.

Autograd sums a weight's gradient in one node, the weight's ``AccumulateGrad``, which runs once
every use has sent its part. The part made in ``B b`` (``b``: the last stage using the weight)
waits in autograd's input buffer through every backward down to ``B a`` (``a``: the first);
the first part to join it is summed into a new tensor (the waiting part, a transposed matmul
result as a ``Linear`` weight's is, cannot be added into in place), which later parts are added
into; after ``B a`` the sum goes into ``.grad`` and is freed. A stage's measurement (``measure``,
``meta``) runs it alone: its own part counts as a transient of its backward only. On top of it,
``B s`` holds, per weight of ``dense`` gradient bytes ``G`` (autograd's gradient is dense even
when the weight is a view of a larger buffer):

* ``G`` for every ``a <= s <= b``: the waiting part (in ``B b`` from the op that makes it to the
  end of the stage, which the stage's own measurement counts only while that op's node runs:
  an upper bound there);
* ``G`` more in the backward of the second-to-last user (``a`` when two stages share it): the
  first sum's new tensor, beside the waiting part and that stage's own.

Not counted: the waiting part during the recomputation forwards that run between ``B b`` and
``B a`` (the chain has one transient per forward, for the forward phase and recomputation
alike). Sharing is by parameter identity, as autograd's leaves are: distinct parameters that
are views of one flat buffer (ZeRO-1/2, Megatron's contiguous buffers) each have their own
``AccumulateGrad`` and are not shared.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch.nn as nn

from ..chain import Chain
from .storage import dense_bytes


def shared_weights(blocks: Sequence[nn.Module]) -> Dict[Tuple[int, ...], int]:
    """The weights (wanting a gradient) that more than one of ``blocks`` holds: for each set
    of stages sharing some, in increasing order, the bytes of those weights' gradients."""
    users: Dict[int, List[int]] = {}
    sizes: Dict[int, int] = {}
    for s, block in enumerate(blocks):
        for p in block.parameters():  # (each once per block)
            if p.requires_grad:
                users.setdefault(id(p), []).append(s)  # (the blocks hold p: its id is its own)
                sizes[id(p)] = dense_bytes(p)
    groups: Dict[Tuple[int, ...], int] = {}
    for k, stages in users.items():
        if len(stages) > 1:
            groups[tuple(stages)] = groups.get(tuple(stages), 0) + sizes[k]
    return groups


def shared_grad_bytes(blocks: Sequence[nn.Module]) -> List[int]:
    """Per stage ``s = 0 .. L`` (the loss last, always 0): the bytes of shared weights'
    gradients ``B s`` holds beyond the stage's own measurement (module docstring)."""
    return _per_stage(shared_weights(blocks), len(blocks) + 1)


def _per_stage(groups: Dict[Tuple[int, ...], int], n: int) -> List[int]:
    extra = [0] * n
    for stages, grad in groups.items():
        for s in range(stages[0], stages[-1] + 1):
            extra[s] += grad  # the part waiting from B b to B a
        extra[stages[-2]] += grad  # the first sum's new tensor
    return extra


def with_shared_grads(chain: Chain, blocks: Sequence[nn.Module]) -> Chain:
    """``chain`` (of ``blocks`` and a loss) with the gradients of shared weights added to the
    ``bw_tmp`` of the stages that hold them; ``meta["shared_weights"]`` lists each set of
    stages sharing weights and their gradient bytes. ``chain`` itself when nothing is shared."""
    groups = shared_weights(blocks)
    if not groups:
        return chain
    extra = _per_stage(groups, len(chain.bw_tmp))
    bw_tmp = [v + e for v, e in zip(chain.bw_tmp, extra)]
    summary: List[Dict[str, Any]] = [{"stages": list(st), "grad_bytes": g}
                                     for st, g in sorted(groups.items())]
    return chain.replace(bw_tmp=bw_tmp, meta=dict(chain.meta, shared_weights=summary))
