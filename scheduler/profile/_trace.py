"""Shared machinery of the two profilers: what a stage saves, and which tensors are live when.

Sizes are counted per *storage* (the memory a tensor actually holds), so views and in-place
results are never counted twice. A storage is identified by its ``StorageImpl`` address
(``untyped_storage()._cdata``), which works on the ``meta`` device too (there every data pointer
is 0). While a trace runs it keeps every tensor it has seen alive, so no address is reused.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

Tensors = Tuple[torch.Tensor, ...]


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: Set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out the keys in ``exclude``."""
    seen: Dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s._cdata not in exclude:
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def dense_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def grad_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Size of the gradient with respect to ``tensors``: dense, one per differentiable tensor."""
    return sum(dense_bytes(t) for t in tensors if t.requires_grad)


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


def differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def fresh_inputs(values: Tensors, requires_grad: bool) -> Tensors:
    """The inputs of a stage as the chain runtime sees them: detached from the previous stage,
    requiring grad where they can carry one (so the block saves what it saves mid-network)."""
    return tuple(v.detach().requires_grad_(requires_grad and differentiable(v)) for v in values)


def call_block(block: Callable[..., Any], inputs: Tensors, index: int) -> Tensors:
    try:
        out = block(*inputs)
    except RuntimeError as e:
        if "in-place" in str(e) or "inplace" in str(e):
            raise RuntimeError(
                f"model_blocks[{index}] modifies its input in place, which a chain cannot profile "
                f"or checkpoint (the input is the previous stage's stored output): {e}") from e
        raise
    return as_tensors(out, f"model_blocks[{index}]")


# ----------------------------------------------------------------------------------- losses
LOSSES = ("cross_entropy", "sum", "mse")


def make_loss(loss: Any) -> Callable[..., torch.Tensor]:
    """The loss stage L. ``"cross_entropy"`` (default): classes along the last dimension of the
    network output, fixed targets (class 0), mean reduction: what classifiers and language models
    train with. ``"sum"``: the sum of every differentiable output. ``"mse"``: mean squared error
    against zeros. Or any callable ``loss(*outputs) -> scalar tensor``."""
    if callable(loss):
        return loss
    if loss in ("sum", "mse"):
        def reduce(*outs: torch.Tensor) -> torch.Tensor:
            total = None
            for o in outs:
                if differentiable(o):
                    term = o.sum() if loss == "sum" else o.square().mean()
                    total = term if total is None else total + term
            if total is None:
                raise ValueError(f"loss={loss!r}: the last block returned no floating tensor")
            return total
        return reduce
    if loss == "cross_entropy":
        def cross_entropy(*outs: torch.Tensor) -> torch.Tensor:
            if len(outs) != 1 or not differentiable(outs[0]) or outs[0].dim() < 1:
                raise ValueError(
                    "loss='cross_entropy' needs the last block to return one floating tensor of "
                    "logits (classes along the last dimension); pass loss='sum' or a callable")
            logits = outs[0].reshape(-1, outs[0].shape[-1])
            target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
            return F.cross_entropy(logits, target)
        return cross_entropy
    raise ValueError(f"loss: expected one of {LOSSES} or a callable, got {loss!r}")


# ------------------------------------------------------------------------- CUDA-like dropout
class CudaLikeDropout(TorchFunctionMode):
    """Routes ``F.dropout`` to ``torch.native_dropout``, the fused kernel CUDA uses, which saves a
    1-byte bool mask. On CPU and meta, ``F.dropout`` saves a float mask (4 bytes per element);
    a chain derived for a GPU should count what the GPU keeps. Same distribution, same shapes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
            if training and 0 < p < 1 and not inplace:
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- the op tracer
_FACTORIES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros",
              "ones", "full", "zeros_like", "ones_like", "full_like", "scalar_tensor"}


def _tensors_in(value: Any, acc: List[torch.Tensor]) -> None:
    """The tensors among an ATen op's arguments or results (tensors, lists and tuples of
    them, keyword dicts), in order: ``pytree.tree_leaves`` for these, at a fraction of its
    cost (it runs on every traced op)."""
    if isinstance(value, torch.Tensor):
        acc.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors_in(v, acc)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, acc)


@functools.lru_cache(maxsize=None)
def _moves_bytes(func: Any) -> bool:
    """Whether an op moves bytes (not a pure view, not a factory): per op overload, once."""
    rets = func._schema.returns
    view = bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write
                              for r in rets)
    name = func.__name__.split(".")[0] if hasattr(func, "__name__") else ""
    return not view and name not in _FACTORIES


class OpTracer(TorchDispatchMode):
    """Records, for every ATen op, the storages it reads and writes, and the bytes it moves.

    ``traffic`` (bytes) is what the cost model charges against the memory bandwidth: tensor
    inputs plus outputs of every op that is not a pure view (views, ``detach``, factories move
    nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
        self.sizes: Dict[int, int] = {}
        self.traffic = 0
        self._keep: List[Any] = []
        self.marks: List[int] = []  # op counts at which an autograd node finished

    def mark(self) -> None:
        self.marks.append(len(self.ops))

    def _key(self, t: torch.Tensor) -> int:
        s = t.untyped_storage()
        k = s._cdata
        n = s.nbytes()
        if n > self.sizes.get(k, -1):
            self.sizes[k] = n
        return k

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins: List[torch.Tensor] = []
        _tensors_in(args, ins)
        _tensors_in(kwargs, ins)
        outs: List[torch.Tensor] = []
        _tensors_in(out, outs)
        self.ops.append((tuple(self._key(t) for t in ins), tuple(self._key(t) for t in outs)))
        if _moves_bytes(func):
            self.traffic += sum(dense_bytes(t) for t in ins) + sum(dense_bytes(t) for t in outs)
        self._keep.append((args, kwargs, out))  # no storage is freed (and its address reused)
        return out

    def peak_live(self, skip: Set[int], keep: Set[int] = frozenset(),
                  release: Set[int] = frozenset(), by_node: bool = False) -> int:
        """Peak bytes of storages created during the trace, each freed right after its last use
        (eager freeing, as PyTorch's caching allocator does when the last reference dies).

        ``skip``: storages not counted (the stage's inputs, parameters, outputs...). ``keep``:
        storages that, once created, stay until the end (what autograd saves). Storages first
        seen as an *input* of an op existed before the trace and are not counted, except those
        in ``release``: pre-existing storages freed once the autograd node that last read them
        has finished (the first of ``marks`` after their last read; autograd releases a node's
        saved tensors after the whole node ran), whose bytes are then credited back.
        ``by_node``: a storage born here is freed when the node that last used it has finished
        (not right after that use): a node's incoming gradients and the values its formula
        holds live until it returns (an upper bound for the formula's shorter temporaries).
        Never below 0."""
        n = len(self.ops)
        birth: Dict[int, int] = {}
        last: Dict[int, int] = {}
        known: Set[int] = set()
        last_read: Dict[int, int] = {}
        for i, (reads, writes) in enumerate(self.ops):
            for k in reads:
                last_read[k] = i
                if k not in known:
                    known.add(k)  # pre-existing storage: never born here
                elif k in birth:
                    last[k] = i
            for k in writes:
                if k not in known:
                    known.add(k)
                    if k not in skip:
                        birth[k] = i
                if k in birth:
                    last[k] = i
        diff = [0] * (n + 1)
        marks = sorted(self.marks)
        for k in release:
            if k in known and k not in birth and k in last_read:
                end = next((m for m in marks if m > last_read[k]), n)
                diff[min(end, n)] -= self.sizes[k]
        for k, b in birth.items():
            end = n if k in keep else last[k] + 1
            if by_node and k not in keep:  # held until the node that last used it returned
                end = next((m for m in marks if m > last[k]), end)
            diff[b] += self.sizes[k]
            diff[min(end, n)] -= self.sizes[k]
        peak = cur = 0
        for i in range(n):
            cur += diff[i]
            peak = max(peak, cur)
        return peak


@contextlib.contextmanager
def hooks_silenced(module: torch.nn.Module) -> Iterator[None]:
    """The gradient hooks of ``module``'s parameters (``register_hook``,
    ``register_post_accumulate_grad_hook``) and the backward hooks of its modules silent for
    the body. A measurement runs the backward on a random gradient, several times; the model's
    hooks (statistics gathered in them, a gradient rewritten by one, an optimizer stepping in
    the backward) must see each real step's gradients once. Autograd reads the hook dicts it
    was given, so emptying them for a while silences them."""
    emptied: List[Tuple[Dict[Any, Any], Dict[Any, Any]]] = []
    holders: List[Tuple[Any, Tuple[str, ...]]] = [
        (p, ("_backward_hooks", "_post_accumulate_grad_hooks")) for p in module.parameters()]
    holders += [(m, ("_backward_hooks", "_backward_pre_hooks")) for m in module.modules()]
    # and those every module calls (``register_module_full_backward_hook``)
    holders.append((torch.nn.modules.module, ("_global_backward_hooks",
                                              "_global_backward_pre_hooks")))
    for holder, attrs in holders:
        for attr in attrs:
            hooks = getattr(holder, attr, None)
            if hooks:
                emptied.append((hooks, dict(hooks)))
                hooks.clear()
    try:
        yield
    finally:
        for hooks, items in emptied:  # (the originals first: hooks added meanwhile after them)
            added = dict(hooks)
            hooks.clear()
            hooks.update(items)
            hooks.update(added)


def unlinked(t: torch.Tensor) -> torch.Tensor:
    """What a pack hook keeps of a saved tensor: without its autograd history. An op's own
    output saved with its ``grad_fn`` would make a cycle through the graph (node -> packed
    value -> node) that Python's collector cannot see: a graph freed without its backward
    (a recomputation's, or a forward whose loss is dropped) would leak with everything it
    reaches. Autograd re-attaches the history on unpack, as ``torch.utils.checkpoint`` relies on."""
    return t.detach() if t.requires_grad else t


class SavedTensors:
    """``saved_tensors_hooks`` that keep a reference to everything autograd saves (for its
    storage and size: the tensors kept have no autograd history)."""

    def __init__(self) -> None:
        self.tensors: List[torch.Tensor] = []
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # Every node that saves ``t`` keeps this hook (so ``self``) until the node is freed.
        # Kept with its history, ``t`` would lead back to those nodes: a cycle through the C++
        # graph (node -> hook -> self.tensors -> t -> grad_fn -> node) that Python's collector
        # cannot see, leaking the graph, its activations and the parameters it saved whenever
        # the graph is dropped without a backward (the Mimose collector's measuring run).
        t = unlinked(t)
        self.tensors.append(t)
        return t

    def __enter__(self) -> "SavedTensors":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)

    def keys(self) -> Set[int]:
        return {storage_key(t) for t in self.tensors}


def xbar_bytes(saved: Sequence[torch.Tensor], outputs: Tensors, inputs: Tensors,
               state_keys: Set[int]) -> int:
    """What the forward of a stage keeps for its backward, output included (DESIGN.md ``xbar``):
    the distinct storages autograd saved plus those of the outputs, less the stage's input
    (stored as ``x[s]``, or inside ``xbar[s-1]``) and less parameters and buffers (weights are not
    activations). The outputs count even when they alias the input, so ``xbar[s] >= x[s+1]``."""
    out_keys = {storage_key(t) for t in outputs}
    exclude = ({storage_key(t) for t in inputs} | state_keys) - out_keys
    return storage_bytes(list(saved) + list(outputs), exclude)


def saved_sizes(saved: "SavedTensors", outputs: Tensors, inputs: Tensors,
                state_keys: Set[int]) -> Tuple[int, int]:
    """A stage's ``xbar`` (``xbar_bytes``) and ``dead_output`` from what its saving forward
    saved: the bytes of its outputs its own graph did not save. ``xbar[s]`` counts them, but
    in ``B s`` nothing holds them (the next stage's backward already ran and freed what it
    saved of them; the runtime keeps no reference): they are not in memory during ``B s``."""
    in_keys = {storage_key(t) for t in inputs}
    return (xbar_bytes(saved.tensors, outputs, inputs, state_keys),
            storage_bytes(outputs, exclude=saved.keys() | in_keys | state_keys))


def requires_grad_leaves(inputs: Tensors, params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [t for t in inputs if t.requires_grad] + [p for p in params if p.requires_grad]


def backward(outputs: Tensors, grads: Tensors, wrt: List[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """Backward of one stage: gradients w.r.t. its inputs and parameters (not accumulated into
    ``.grad``, so profiling leaves the model untouched)."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    if not pairs or not wrt:
        return ()
    return torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                               allow_unused=True)


def _mark(ref: "weakref.ref[OpTracer]", *_: Any) -> None:
    tracer = ref()
    if tracer is not None:
        tracer.mark()  # returns None: a node post-hook's value would replace its gradients


def _mark_nodes(outputs: Sequence[torch.Tensor], tracer: OpTracer,
                stop: Iterable[Any] = ()) -> List[Any]:
    """Post-hooks on the stage's autograd nodes telling ``tracer`` when each one finished
    (``AccumulateGrad`` nodes belong to the parameters: left alone; ``stop``: nodes not to go
    past, as ``graph_nodes``). Returns the hooks' handles (a graph that outlives the trace,
    the model's own, should have them removed)."""
    # a weak reference: the hooks live on the graph's C++ nodes, which the tracer's kept
    # tensors hold; a strong one would be a cycle Python's collector cannot see (a leak of
    # every traced tensor, once per measured stage)
    ref = weakref.ref(tracer)
    return [node.register_hook(functools.partial(_mark, ref))
            for node in graph_nodes([o.grad_fn for o in outputs], stop)
            if type(node).__name__ != "AccumulateGrad"]


def graph_nodes(roots: Iterable[Any], stop: Iterable[Any] = ()) -> Iterator[Any]:
    """Each autograd node reachable from the nodes ``roots`` (``None``s skipped), once,
    without going past the nodes in ``stop``.

    Nodes are told apart by the identity of their Python objects, so every one seen is held
    until the walk ends: a C++ node's Python object lives only while referenced (torch 2.11
    drops it at once), and a freed object's ``id`` is reused by the next one, which would
    then pass for a node already seen (its hook never registered: nondeterministic marks)."""
    held: Dict[int, Any] = {id(n): n for n in stop if n is not None}
    todo = [n for n in roots if n is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in held:
            continue
        held[id(node)] = node
        yield node
        todo.extend(f for f, _ in node.next_functions)


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
    held = in_keys | out_keys | state_keys | made
    peak_b = b_trace.peak_live(skip=set(), keep=made, by_node=True, release=(
        saved.keys() | {storage_key(g) for g in grads_out}) - held)
    bw_tmp = max(peak_b - made_bytes - dead, 0)  # (the output B s does not hold: saved_sizes)
    out = dict(xbar=xbar, fw_tmp=fw_tmp, bw_tmp=bw_tmp, fck_tmp=fck_tmp, dead_output=dead,
               fw_bytes=f_trace.traffic, bw_bytes=b_trace.traffic)
    if flops:
        out.update(fw_flops=f_flops.get_total_flops(), bw_flops=b_flops.get_total_flops())
    return outputs, out
