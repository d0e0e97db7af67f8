"""The smallest memory any schedule can train a model in: its largest single operator.

Every schedule (swapping, recomputation, offloading, at any granularity) must hold an operator's
inputs and outputs on the device while it runs. ``op_floor`` runs one training step (forward,
loss, backward) on the meta device under a dispatch mode and returns the largest total over the
distinct storages one aten op reads or writes, naming that op. A budget below the floor plus
what lives throughout (weights, gradients, optimizer state) is infeasible for every method: such
a batch size is not worth a GPU run (bench/e2e.py marks it so).

Not counted, so it is a lower bound: library workspaces (cuDNN, cuBLAS), allocator rounding,
other tensors alive at the same time. Sizes are exact (the meta device); nothing is computed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from . import _trace as T
from .eager_mode import EagerDispatchMode
from .meta import Shape, _check_blocks, _check_dtypes, _input_shapes


@dataclass(frozen=True)
class OpFloor:
    """``bytes``: the largest operator's inputs and outputs (distinct storages, parameters and
    buffers left out); ``op``: its aten name, ``shapes``: its tensors' shapes; ``param_bytes``:
    the parameters (their gradients and an optimizer's state are multiples of it)."""
    bytes: int
    op: str
    shapes: Tuple[Tuple[int, ...], ...]
    param_bytes: int


class _LargestOp(EagerDispatchMode):
    def __init__(self, exclude: set) -> None:
        super().__init__()
        self.exclude = exclude
        self.best = (0, "", ())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        n = T.storage_bytes(tensors, self.exclude)
        if n > self.best[0]:
            self.best = (n, str(func.overloadpacket.__name__),
                         tuple(tuple(t.shape) for t in tensors))
        return out


def op_floor(model_blocks: Sequence[nn.Module], input_shape: Union[Shape, Sequence[Shape]], *,
             input_dtype: Union[torch.dtype, Sequence[torch.dtype]] = torch.float32,
             loss: Any = "cross_entropy") -> OpFloor:
    """The largest operator of one training step of ``model_blocks`` (built on the meta device,
    as the zoo builds them with ``device="meta"``) on an input of ``input_shape``; ``input_dtype``
    and ``loss`` as in ``meta_chain``. The network input gets no gradient (images, token ids)."""
    blocks = _check_blocks(model_blocks)
    shapes = _input_shapes(input_shape)
    dtypes = _check_dtypes(input_dtype, len(shapes))
    for i, b in enumerate(blocks):
        for name, p in list(b.named_parameters()) + list(b.named_buffers()):
            if p.device.type != "meta":
                raise ValueError(f"model_blocks[{i}].{name} is on {p.device}, not the meta device: "
                                 "build the model with device='meta' (op_floor computes nothing)")
    state = [t for b in blocks for t in list(b.parameters()) + list(b.buffers())]
    exclude = {T.storage_key(t) for t in state}
    params = T.storage_bytes([p for b in blocks for p in b.parameters()])
    values: T.Tensors = tuple(torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes))
    mode = _LargestOp(exclude)
    with mode:
        for i, block in enumerate(blocks):
            values = T.call_block(block, values, i)
        T.make_loss(loss)(*values).backward()
    n, op, op_shapes = mode.best
    return OpFloor(n, op, op_shapes, params)
