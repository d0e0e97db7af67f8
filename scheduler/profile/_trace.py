"""How the two profilers run one stage: its inputs as the chain runtime gives them
(``fresh_inputs``), its call (``call_block``) and its trace (``trace_stage``: what its forward
saves, which tensors are live when, its FLOPs and bytes, forward and backward).

The toolkit this builds on lives in modules of its own, one job each: ``storage`` (sizes per
storage, ``xbar``), ``losses`` (the loss stage), ``op_tracer`` (the ATen-op tracer) and
``autograd_graph`` (graph walks, saved tensors, hooks, a stage's backward). Their names are
re-exported here, for the code that reads them as ``_trace.x``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from .autograd_graph import (SavedTensors, backward, differentiable, graph_nodes, hooks_silenced,
                             requires_grad_leaves, saved_sizes, unlinked)
from .losses import LOSSES, make_loss
from .op_tracer import (_FACTORIES, CudaLikeDropout, OpTracer, _mark, _mark_nodes, _moves_bytes,
                        _tensors_in)
from .storage import Tensors, dense_bytes, grad_bytes, storage_bytes, storage_key, xbar_bytes

__all__ = [
    # this module's own
    "as_tensors", "fresh_inputs", "call_block", "trace_stage",
    # re-exported: storage
    "Tensors", "storage_key", "storage_bytes", "dense_bytes", "grad_bytes", "xbar_bytes",
    # losses
    "LOSSES", "make_loss",
    # op_tracer
    "CudaLikeDropout", "_FACTORIES", "_tensors_in", "_moves_bytes", "OpTracer", "_mark",
    "_mark_nodes",
    # autograd_graph
    "differentiable", "graph_nodes", "hooks_silenced", "unlinked", "SavedTensors", "saved_sizes",
    "requires_grad_leaves", "backward",
]


def as_tensors(value: Any, where: str) -> Tensors:
    """A block's output as a tuple of tensors; anything else is rejected with a clear message."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    kinds = type(value).__name__ if not isinstance(value, (tuple, list)) else \
        f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    raise TypeError(f"{where}: a block must return a tensor or a non-empty tuple/list of tensors "
                    f"(passed to the next block as positional arguments), got {kinds}")


def fresh_inputs(values: Tensors, requires_grad: bool) -> Tensors:
    """The inputs of a stage as the chain runtime sees them: detached from the previous stage,
    requiring grad where they can carry one (so the block saves what it saves mid-network)."""
    return tuple(v.detach().requires_grad_(requires_grad and differentiable(v)) for v in values)


def _wrong_device(message: str) -> bool:
    """Whether an op refused tensors on two devices (its wording varies with the op)."""
    return "expected device" in message or "same device" in message


def call_block(block: Callable[..., Any], inputs: Tensors, index: int,
               module: Optional[nn.Module] = None) -> Tensors:
    """``block(*inputs)`` as stage ``index``, its output as a tuple of tensors; an error
    names the stage. ``module``: the block, when ``block`` is a function calling it (its
    type names it in the error)."""
    try:
        out = block(*inputs)
    except RuntimeError as e:
        if "in-place" in str(e) or "inplace" in str(e):
            raise RuntimeError(
                f"model_blocks[{index}] modifies its input in place, which a chain cannot profile "
                f"or checkpoint (the input is the previous stage's stored output): {e}") from e
        if _wrong_device(str(e)):
            # most often a tensor the block keeps as a plain attribute (``self.mask =
            # torch.tril(...)``): neither ``.to()`` nor ``meta_chain``'s meta stand-ins move it
            kind = type(module if module is not None else block).__name__
            raise RuntimeError(
                f"model_blocks[{index}] ({kind}): {e} A tensor the block holds as a plain "
                f"attribute (not a parameter or buffer, e.g. self.mask = torch.tril(...)) stays "
                f"on the device it was made on, while meta_chain runs the block on the meta "
                f"device and .to() moves only parameters and buffers: register it with "
                f"self.register_buffer(name, tensor) (persistent=False keeps it out of the "
                f"state dict)") from e
        raise
    return as_tensors(out, f"model_blocks[{index}]")


def trace_stage(fn: Callable[[Tensors], Tensors], inputs: Tensors, params: Sequence[torch.Tensor],
                state_keys: Set[int], cuda_dropout: bool, flops: bool = True
                ) -> Tuple[Tensors, Dict[str, float]]:
    """Sizes, FLOPs and bytes of one stage (a block or the loss) on whatever device ``inputs``
    live on. Returns the stage's outputs and a dict of its numbers. ``flops=False``: no
    ``fw_flops``/``bw_flops`` (the FLOP counter, with its module tracking, is most of the
    trace's own cost; only the cost model reads them)."""
    saved = SavedTensors()
    f_trace = OpTracer()
    f_flops: Any = FlopCounterMode(display=False) if flops else contextlib.nullcontext()
    dropout = CudaLikeDropout() if cuda_dropout else None
    with torch.enable_grad():
        if dropout is not None:
            dropout.__enter__()
        try:
            with saved, f_flops, f_trace:
                outputs = fn(inputs)
        finally:
            if dropout is not None:
                dropout.__exit__(None, None, None)
    in_keys = {storage_key(t) for t in inputs}
    out_keys = {storage_key(t) for t in outputs}
    xbar, dead = saved_sizes(saved, outputs, inputs, state_keys)
    tmp_none = f_trace.peak_live(skip=in_keys | state_keys | out_keys)
    peak_all = f_trace.peak_live(skip=in_keys | state_keys, keep=saved.keys() | out_keys)
    fw_tmp = max(peak_all - xbar, 0)  # F_all: its intermediates are in xbar
    fck_tmp = max(tmp_none, 0)  # F_ck / F_none: nothing saved, the largest freed as it goes

    # the backward frees what the graph saved as a real one does, each once its node ran
    # (held here, the measurement's own peak stood above the chain's, by up to xbar[s]: a
    # first step measuring a chain went past the budget its figure was checked against)
    saved_keys = saved.keys()
    saved.tensors.clear()
    wrt = requires_grad_leaves(inputs, params)
    grads_out = tuple(torch.ones_like(o) for o in outputs)  # made before the trace: external
    b_trace = OpTracer()
    b_flops: Any = FlopCounterMode(display=False) if flops else contextlib.nullcontext()
    _mark_nodes(outputs, b_trace)
    with b_flops, b_trace:
        grads = backward(outputs, grads_out, wrt)
    # bw_tmp[s] means what the simulator adds to xbar[s], the input, delta[s+1] and delta[s]
    # for the whole of B s: the backward's peak, each tensor counted while it is live, less
    # delta[s] (the input gradients). The input gradients are counted from the op that makes
    # them (often the block's last: a peak earlier in the backward does not hold them yet),
    # as the CUDA measurement's ``peak - made`` counts them. The parameter gradients are
    # transient here: each is added into an existing .grad and freed (a first step makes
    # them .grad instead, which lasts: counting them still bounds that step's peak).
    n_in = sum(1 for t in inputs if t.requires_grad)
    made = {storage_key(g) for g in grads[:n_in] if g is not None}
    made_bytes = storage_bytes(g for g in grads[:n_in] if g is not None)
    # autograd frees each saved tensor once its node has run (no retain_graph), and delta[s+1]
    # once the last node that reads it has (unless it becomes delta[s]: a residual passes it
    # through), so the backward peak beyond xbar credits what is already released, as the
    # CUDA measurement sees it; the stage's input, output and the weights stay (held by the
    # chain, the runtime, the model)
    # (the saved storages' keys were taken before the backward freed them, and a storage
    # made since may have one of their addresses, an input gradient too: only what was alive
    # throughout, the stage's input, output and weights, is taken from them)
    stays = in_keys | out_keys | state_keys
    release = (saved_keys - stays) | ({storage_key(g) for g in grads_out} - stays - made)
    peak_b = b_trace.peak_live(skip=set(), keep=made, by_node=True, release=release)
    bw_tmp = max(peak_b - made_bytes - dead, 0)  # (the output B s does not hold: saved_sizes)
    out = dict(xbar=xbar, fw_tmp=fw_tmp, bw_tmp=bw_tmp, fck_tmp=fck_tmp, dead_output=dead,
               fw_bytes=f_trace.traffic, bw_bytes=b_trace.traffic)
    if flops:
        out.update(fw_flops=f_flops.get_total_flops(), bw_flops=b_flops.get_total_flops())
    return outputs, out
