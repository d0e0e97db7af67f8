"""The op tracer: every ATen op a stage runs, with the storages it reads and writes and the
bytes it moves (``OpTracer``), and from that the peak of the storages live at once; plus the
``F.dropout`` that saves what CUDA's does (``CudaLikeDropout``).

While a trace runs it keeps every tensor it has seen alive, so no storage address (its key,
``storage.storage_key``) is reused.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, Iterable, List, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .autograd_graph import graph_nodes
from .storage import dense_bytes


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
        k = s._cdata  # ``storage_key``, with the size from the same lookup (on every op)
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
