"""Rotor's parameter estimation (seed 002, section 5.1) on a real device.

"Given a chain and a sample input, forward and backward operations of each stage are processed
one after the other. From a_l the forward F_all is processed to obtain a_{l+1}, and the backward
with an arbitrary value delta_{l+1}. The execution time of each operation is measured, and the
memory management interface of PyTorch is used to obtain the memory usage of a_{l+1} and the
peak memory usage of both forward and backward operations."

For each stage s (the blocks, then the loss) with the previous stage's output as input
(detached, requiring grad):

* ``fw[s]``, ``bw[s]``: median over ``repeat`` timed runs (after ``warmup`` untimed ones) of the
  saving forward and of the backward with a random ``delta[s+1]``; CUDA is synchronized around
  each run. The backward uses ``torch.autograd.grad`` on the stage's input and parameters, so
  nothing accumulates into ``.grad``.
* ``x``, ``xbar``, ``delta``: from ``saved_tensors_hooks`` on the real tensors, counted as
  ``meta_chain`` counts them (distinct storages; input, parameters and buffers excluded from
  ``xbar``; output included).
* ``fw_tmp``, ``fck_tmp``, ``bw_tmp``: on CUDA from ``torch.cuda.max_memory_allocated`` (as
  rotor did): the peak of a saving forward beyond ``xbar`` (``fw_tmp``), of a no-grad forward
  beyond its output (``fck_tmp``), and of the backward beyond the input gradients, run as
  training runs it (parameter gradients added into an existing ``.grad``; ``delta[s+1]``
  freed once its last reader ran, not held by the measurement), less the stage's output when
  its graph did not save it (``xbar`` counts it; nothing holds it in ``B s``).
  On CPU they are *estimated* by the op tracer of ``meta_chain`` (liveness of every
  intermediate storage, freed after its last use; in the backward, when the node that last
  used it returns) run on the real tensors. The tracer sees the tensors ATen ops return, not
  memory a kernel allocates for itself and frees before returning: oneDNN's convolutions
  (forward and ``convolution_backward``: reordered weights, weight-gradient buffers,
  scratchpads) and bf16 matmuls' packing buffers, so convolutional networks come out low on
  the CPU (ResNet-18, batch 2, 64 px: 13.6 MB simulated for a store-all step that really
  peaks at 22.5 MB). The profiler's memory events (``torch.profiler``, ``profile_memory=True``,
  as ``bench/hf.py``'s ``cpu_peak`` reads them) would count them but are not used: a session
  started inside the caller's own profiling silently ends it (its events are lost; falling
  back to the tracer then would make the plan depend on whether one profiles), and a
  backward's session must hold its forward too (a free of memory allocated before a session
  is not reported).
* weights several stages share (an LM head tied to the token embedding, one block object
  repeated): their gradients wait in autograd's buffer from the backward of the last stage
  using them down to the first's; ``shared_grads`` adds them to those stages' ``bw_tmp``.

Stage 0 runs on a copy of ``sample_input``: a first block that writes its input in place (a
normalization) leaves the caller's tensor as it was.

A stage module may name tensors it reads that are held outside the chain in an attribute
``held_outside`` (``scheduler.checkpoint``'s blocks: the masks every block is called with,
counted once for the whole step): like its weights, they are not counted as its activations.

Buffers (batch-norm running statistics) and the RNG state are restored after each stage, so
measuring does not change the model or the random stream.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn

from ..chain import FIELDS, Chain
from . import _trace as T
from .meta import _check_blocks
from .shared_grads import with_shared_grads
from .storage import keys_held


def _check_input(sample_input: Any) -> T.Tensors:
    if isinstance(sample_input, torch.Tensor):
        return (sample_input,)
    if isinstance(sample_input, (tuple, list)) and sample_input and \
            all(isinstance(t, torch.Tensor) for t in sample_input):
        return tuple(sample_input)
    raise TypeError(f"sample_input: expected a tensor or a non-empty tuple of tensors, got "
                    f"{type(sample_input).__name__}")


def _check_count(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")
    return value


@contextlib.contextmanager
def _preserved(block: nn.Module, device: torch.device) -> Iterator[None]:
    """Run measurements without a trace on the block's buffers or on the RNG streams, and
    without calling its gradient and backward hooks (``autograd_graph.hooks_silenced``)."""
    saved = [(b, b.detach().clone()) for b in block.buffers()]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), T.hooks_silenced(block):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, old in saved:
                    b.copy_(old)


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; nothing to wait for elsewhere):
    around a timing, and before reading memory counters."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(run: Callable[[], Any], prepare: Callable[[], Any], device: torch.device,
                 repeat: int, warmup: int) -> float:
    times: List[float] = []
    for i in range(warmup + repeat):
        arg = prepare()
        sync(device)
        t0 = time.perf_counter()
        run(arg)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _HandOver(torch.autograd.Function):
    """A scalar root over a stage output whose backward hands autograd the gradient ``box``
    holds and lets go of it: autograd then owns delta[s+1] alone."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, box: List[torch.Tensor]) -> torch.Tensor:
        ctx.box = box
        return out.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return ctx.box.pop(), None


def _cuda_stage(fn: Callable[[T.Tensors], T.Tensors], inputs: T.Tensors,
                params: List[torch.Tensor], state_keys: Set[int], device: torch.device
                ) -> Tuple[T.Tensors, Dict[str, int]]:
    """``stage_memory`` on CUDA: the sizes from what the saving forward saved, the transient
    peaks from the CUDA allocator's statistics (measured, not the op tracer's estimate: the
    allocator also sees the buffers kernels allocate for themselves, cuBLAS's and cuDNN's
    workspaces, which no traced op returns). ``dead_output``: the bytes of the stage's output its
    own graph does not save, held here through the backward but not in a real step's ``B s``
    (``autograd_graph.saved_sizes``)."""
    def peak_of(run: Callable[[], Any]) -> tuple:
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        m0 = torch.cuda.memory_allocated(device)
        out = run()
        sync(device)
        return out, torch.cuda.max_memory_allocated(device) - m0

    with torch.no_grad():  # first use of the stage's kernels: cuBLAS's workspace (kept) is
        fn(inputs)          # made here, not counted as the first stage's transient
    saved = T.SavedTensors()
    with torch.enable_grad(), saved:
        outs, peak_all = peak_of(lambda: fn(inputs))
    xbar, dead_output = T.saved_sizes(saved, outs, inputs, state_keys)
    outputs = tuple(o.detach() for o in outs)
    del outs, saved
    with torch.no_grad():
        outs, peak_none = peak_of(lambda: fn(inputs))
        out_bytes = T.storage_bytes(outs)
    del outs
    with torch.enable_grad():
        outs = fn(inputs)
        # delta[s+1] reaches the stage's graph from autograd alone, as in a real step, whose
        # engine frees it once its last reader has run: a gradient passed from Python
        # (``backward(outs, grads)``) is held by the caller's frames to the end, and the
        # peak counted it through the whole backward (the op tracer credits its release)
        roots = [_HandOver.apply(o, [torch.randn_like(o)]) for o in outs
                 if o.requires_grad and T.differentiable(o)]
        ones = [r.new_ones(()) for r in roots]   # (made before the peak is reset)
    # the backward as training runs it from the second step on: each parameter gradient is
    # added into an existing .grad and freed (autograd.grad would hold them all at once);
    # the inputs' gradients are delta[s], held by the chain, not transient
    ins = [t for t in inputs if t.requires_grad]
    leaves = T.requires_grad_leaves(inputs, params)
    old = [(p, p.grad) for p in params]
    peak_b = made = 0
    # (the parameters' post-accumulate-grad hooks, an optimizer stepping in the backward as
    # torchtune's, are silent here: the callers measure under ``autograd_graph.hooks_silenced``)
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        if roots and leaves:
            _, peak_b = peak_of(lambda: torch.autograd.backward(
                roots, ones, inputs=leaves))
            made = T.storage_bytes([t.grad for t in ins if t.grad is not None])
    finally:
        for p, g in old:
            p.grad = g
        for t in ins:
            t.grad = None
    return outputs, {"xbar": xbar, "dead_output": dead_output,
                     "fw_tmp": max(peak_all - xbar, 0), "fck_tmp": max(peak_none - out_bytes, 0),
                     "bw_tmp": max(peak_b - made - dead_output, 0)}


def stage_memory(fn: Callable[[T.Tensors], T.Tensors], inputs: T.Tensors,
                 params: List[torch.Tensor], state_keys: Set[int], device: torch.device
                 ) -> Tuple[T.Tensors, Dict[str, int]]:
    """One stage's sizes and transients as ``measure_chain`` measures them: ``xbar``,
    ``fw_tmp``, ``bw_tmp``, ``fck_tmp`` (and ``dead_output``): on the CPU from one traced
    saving forward and its backward (``_trace.trace_stage``), on CUDA from the allocator's
    statistics (``_cuda_stage``: four forwards and a backward). ``fn`` runs the
    stage on ``inputs``; ``params``: its weights that want a gradient; ``state_keys``:
    storages that are not its activations (weights, buffers, what is held outside the
    chain). Nothing accumulates into ``.grad``; the caller puts back the random state and the
    buffers. Returns the stage's outputs (detached) and the numbers. Also the one
    measurement of the blocks' transients on Mimose's collection steps
    (``runtime.mimose_collector``)."""
    if device.type == "cuda":
        return _cuda_stage(fn, inputs, params, state_keys, device)
    outputs, r = T.trace_stage(fn, inputs, params, state_keys, cuda_dropout=False, flops=False)
    return tuple(o.detach() for o in outputs), r


def measure_chain(model_blocks: Sequence[nn.Module], sample_input: Union[torch.Tensor, Sequence[torch.Tensor]],
                  *, loss: Any = "cross_entropy", repeat: int = 5, warmup: int = 1,
                  input_grad: bool = True, name: str = "") -> Chain:
    """The chain of ``model_blocks`` measured on the device of ``sample_input`` (CPU or CUDA).

    ``loss``: the loss stage, as in ``meta_chain`` (``"cross_entropy"``, ``"sum"``, ``"mse"`` or
    a callable). ``repeat``: timed runs per operation (the median is kept); ``warmup``: untimed
    runs before them. ``input_grad``: whether the network input gets a gradient (``delta[0]``).
    The blocks must already be on the input's device.
    """
    blocks = _check_blocks(model_blocks)
    values = _check_input(sample_input)
    repeat = _check_count(repeat, "repeat", 1)
    warmup = _check_count(warmup, "warmup", 0)
    loss_fn = T.make_loss(loss)
    device = values[0].device
    for i, b in enumerate(blocks):
        for n, p in list(b.named_parameters()) + list(b.named_buffers()):
            if p.device != device:
                raise ValueError(f"model_blocks[{i}]: {n} is on {p.device} but sample_input is on "
                                 f"{device}; move the blocks to the input's device first")

    cols: Dict[str, List[float]] = {k: [] for k in FIELDS}
    L = len(blocks)
    for s in range(L + 1):
        inputs = T.fresh_inputs(values, requires_grad=input_grad or s > 0)
        # stage 0 runs on a copy: a first block that writes its input in place (a
        # normalization, ``x.sub_(mean)``) must not change the caller's sample_input, which
        # ``fresh_inputs`` shares when it wants no gradient; sizes stay the caller's tensors'
        runs = inputs if s > 0 else T.fresh_inputs(tuple(v.detach().clone() for v in values),
                                                    requires_grad=input_grad)
        if s < L:
            block = blocks[s]
            params = [p for p in block.parameters() if p.requires_grad]
            # weights, buffers, and what the block says is held outside the chain (a
            # module attribute ``held_outside``: tensors counted once, by the caller, such
            # as the masks ``scheduler.checkpoint`` calls every block with) are not activations
            state = list(block.parameters()) + list(block.buffers()) + \
                list(getattr(block, "held_outside", ()))

            def fn(xs: T.Tensors, block: nn.Module = block, s: int = s) -> T.Tensors:
                return T.call_block(block, xs, s)
        else:
            block, params, state = nn.Module(), [], []

            def fn(xs: T.Tensors) -> T.Tensors:
                out = loss_fn(*xs)
                if not isinstance(out, torch.Tensor) or out.numel() != 1:
                    raise ValueError(f"loss: must return a scalar tensor, got {out!r}")
                return (out,)

        with _preserved(block, device), keys_held(state) as state_keys:
            # sizes and transients (CPU: the op tracer's estimates; CUDA: the allocator's)
            outputs, r = stage_memory(fn, runs, params, state_keys, device)

            def forward(_: Any) -> T.Tensors:
                with torch.enable_grad():
                    return fn(runs)

            def prepare_backward() -> tuple:
                with torch.enable_grad():
                    outs = fn(runs)
                return outs, tuple(torch.randn_like(o) if T.differentiable(o) else o for o in outs)

            wrt = T.requires_grad_leaves(runs, params)
            fw = _median_time(forward, lambda: None, device, repeat, warmup)
            bw = _median_time(lambda a: T.backward(a[0], a[1], wrt), prepare_backward, device,
                              repeat, warmup)
        cols["x"].append(T.storage_bytes(inputs))
        cols["delta"].append(T.grad_bytes(inputs))
        for k in ("xbar", "fw_tmp", "bw_tmp", "fck_tmp"):
            cols[k].append(int(r[k]))
        cols["fw"].append(fw)
        cols["bw"].append(bw if wrt else 0.0)
        values = outputs
    meta = {"source": "scheduler.profile.measure_chain", "device": str(device),
            "input_shape": [list(t.shape) for t in _check_input(sample_input)],
            "loss": loss if isinstance(loss, str) else getattr(loss, "__name__", "callable"),
            "repeat": repeat, "warmup": warmup, "input_grad": input_grad,
            "tmp": "cuda allocator statistics" if device.type == "cuda" else "op-tracer estimate",
            "torch": torch.__version__}
    # weights several stages use: their gradients wait between stages (``shared_grads``)
    return with_shared_grads(Chain(**cols, name=name, meta=meta), blocks)
