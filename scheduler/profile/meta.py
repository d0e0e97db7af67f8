"""Derive a chain without a GPU: exact sizes from the ``meta`` device, times from a cost model.

Every block runs on meta tensors (shapes and dtypes, no data, no compute), one stage at a time,
with its input detached and requiring grad as in the middle of a network:

* ``x[s]``      bytes of the distinct storages of the stage's input(s) (``x[0]``: the network input);
* ``xbar[s]``   what autograd saves for the stage's backward (``saved_tensors_hooks``), distinct
                storages, without the input (held as ``x[s]``) and without parameters/buffers,
                plus the output (``xbar[s] >= x[s+1]``);
* ``delta[s]``  bytes of the gradient w.r.t. the input: dense, one per floating input
                (``= x[s]`` for a contiguous floating input; 0 for token ids);
* ``fw_tmp[s]`` transient memory of the saving forward (F_all): its peak beyond the stored
                ``xbar[s]``, so ``stored + xbar[s] + fw_tmp`` bounds the real peak;
* ``fck_tmp[s]`` transient memory of a no-grad forward (F_ck, F_none: nothing saved, each
                intermediate freed after its last use) beyond input and output, so
                ``stored + x[s+1] + fck_tmp`` bounds its real peak. The two differ: a saving
                forward's intermediates are in ``xbar``, a no-grad one's largest (attention
                scores) are transient;
* ``bw_tmp[s]`` peak of the gradients created inside the backward other than ``delta[s]``,
                parameter gradients included (in training each is added into ``.grad`` and
                freed), crediting saved tensors autograd has released as each node finishes;
                plus the gradients of weights several stages share, from the last stage using
                them down to the first (``shared_grads``: autograd holds them in between);
* ``fw[s]``, ``bw[s]``: ``CostModel.seconds(FLOPs, bytes moved)`` of the forward / backward ops.

Stage ``L`` is the loss (``loss=``, default cross entropy over the last dimension).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.func import functional_call

from ..chain import FIELDS, Chain
from . import _trace as T
from .cost import V100_BYTES_PER_S, V100_FLOPS_PER_S, CostModel
from .shared_grads import with_shared_grads

Shape = Sequence[int]


def _check_blocks(model_blocks: Any) -> List[nn.Module]:
    if isinstance(model_blocks, nn.Module) and not isinstance(model_blocks, (nn.Sequential, nn.ModuleList)):
        raise TypeError("model_blocks: expected a sequence of nn.Module blocks (a list, nn.Sequential "
                        f"or nn.ModuleList), got a single {type(model_blocks).__name__}")
    try:
        blocks = list(model_blocks)
    except TypeError:
        raise TypeError("model_blocks: expected a sequence of nn.Module blocks, got "
                        f"{type(model_blocks).__name__}") from None
    if not blocks:
        raise ValueError("model_blocks: empty; a chain needs at least one block")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"model_blocks[{i}]: expected an nn.Module, got {type(b).__name__}")
    return blocks


def _check_shape(shape: Any, name: str) -> Tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (tuple, list)):
        raise ValueError(f"{name}: expected a sequence of non-negative ints, got {shape!r}")
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"{name}: dimensions must be non-negative ints, got {shape!r}")
    return tuple(shape)


def _input_shapes(input_shape: Any) -> List[Tuple[int, ...]]:
    """One shape, or a tuple of shapes for a network that takes several tensors."""
    if isinstance(input_shape, (tuple, list)) and input_shape and \
            all(isinstance(s, (tuple, list, torch.Size)) for s in input_shape):
        return [_check_shape(s, f"input_shape[{i}]") for i, s in enumerate(input_shape)]
    return [_check_shape(input_shape, "input_shape")]


def _check_dtypes(input_dtype: Any, n: int) -> List[torch.dtype]:
    dtypes = list(input_dtype) if isinstance(input_dtype, (tuple, list)) else [input_dtype] * n
    if len(dtypes) != n or not all(isinstance(d, torch.dtype) for d in dtypes):
        raise ValueError(f"input_dtype: expected a torch.dtype (or one per input shape, {n}), "
                         f"got {input_dtype!r}")
    return dtypes


def _meta_state(block: nn.Module) -> Dict[str, torch.Tensor]:
    """Meta stand-ins for a block's parameters and buffers (its real weights are never copied)."""
    state: Dict[str, torch.Tensor] = {}
    for n, p in block.named_parameters():
        m = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta")
        state[n] = nn.Parameter(m, requires_grad=p.requires_grad)
    for n, b in block.named_buffers():
        state[n] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device="meta")
    return state


def meta_chain(model_blocks: Sequence[nn.Module], input_shape: Union[Shape, Sequence[Shape]], *,
               input_dtype: Union[torch.dtype, Sequence[torch.dtype]] = torch.float32,
               loss: Any = "cross_entropy", flops_per_s: Optional[float] = None,
               bytes_per_s: Optional[float] = None, input_grad: bool = True,
               cuda_dropout: bool = True, name: str = "") -> Chain:
    """The chain of ``model_blocks`` for an input of ``input_shape``, derived on the meta device.

    ``input_dtype``: dtype of the network input (``torch.long`` for token ids). ``loss``: the loss
    stage, ``"cross_entropy"`` (default), ``"sum"``, ``"mse"`` or a callable. ``flops_per_s`` /
    ``bytes_per_s``: the cost model (default: a V100, see ``scheduler.profile.cost``).
    ``input_grad``: whether the network input gets a gradient (default True, so ``delta[0] =
    x[0]`` for a floating input; False gives ``delta[0] = 0`` and profiles stage 0 with an input
    that does not require grad). ``cuda_dropout``: count dropout masks as CUDA's fused kernel
    stores them (bool) rather than as the CPU/meta path does (float). Runs in seconds on a CPU
    even for ResNet-1001: the meta device computes nothing.
    """
    blocks = _check_blocks(model_blocks)
    shapes = _input_shapes(input_shape)
    dtypes = _check_dtypes(input_dtype, len(shapes))
    cost = CostModel(V100_FLOPS_PER_S if flops_per_s is None else flops_per_s,
                     V100_BYTES_PER_S if bytes_per_s is None else bytes_per_s)
    loss_fn = T.make_loss(loss)

    values: T.Tensors = tuple(torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes))
    cols: Dict[str, List[float]] = {k: [] for k in FIELDS}
    total_flops = 0.0
    L = len(blocks)
    for s in range(L + 1):
        inputs = T.fresh_inputs(values, requires_grad=input_grad or s > 0)
        if s < L:
            block = blocks[s]
            state = _meta_state(block)
            params = [v for v in state.values() if isinstance(v, nn.Parameter)]
            state_keys = {T.storage_key(v) for v in state.values()}

            def fn(xs: T.Tensors, block: nn.Module = block, state: Dict = state, s: int = s) -> T.Tensors:
                return T.call_block(lambda *a: functional_call(block, state, a), xs, s, block)
        else:
            params, state_keys = [], set()

            def fn(xs: T.Tensors) -> T.Tensors:
                out = loss_fn(*xs)
                if not isinstance(out, torch.Tensor) or out.numel() != 1:
                    raise ValueError(f"loss: must return a scalar tensor, got {out!r}")
                return (out,)
        outputs, r = T.trace_stage(fn, inputs, params, state_keys, cuda_dropout)
        cols["x"].append(T.storage_bytes(inputs))
        cols["delta"].append(T.grad_bytes(inputs))
        cols["xbar"].append(r["xbar"])
        cols["fw_tmp"].append(r["fw_tmp"])
        cols["bw_tmp"].append(r["bw_tmp"])
        cols["fck_tmp"].append(r["fck_tmp"])
        cols["fw"].append(cost.seconds(r["fw_flops"], r["fw_bytes"]))
        cols["bw"].append(cost.seconds(r["bw_flops"], r["bw_bytes"]))
        total_flops += r["fw_flops"] + r["bw_flops"]
        values = outputs
    meta = {"source": "scheduler.profile.meta_chain", "input_shape": [list(s) for s in shapes],
            "input_dtype": [str(d).replace("torch.", "") for d in dtypes],
            "loss": loss if isinstance(loss, str) else getattr(loss, "__name__", "callable"),
            "flops_per_s": cost.flops_per_s, "bytes_per_s": cost.bytes_per_s,
            "total_flops": total_flops, "cuda_dropout": cuda_dropout, "input_grad": input_grad,
            "torch": torch.__version__}
    # weights several stages use: their gradients wait between stages (``shared_grads``)
    return with_shared_grads(Chain(**cols, name=name, meta=meta), blocks)
