"""The op tracer: every ATen op a stage runs, with the storages it reads and writes and the
bytes it moves (``OpTracer``), and from that the peak of the storages live at once; plus the
``F.dropout`` that saves what CUDA's does (``CudaLikeDropout``).

A trace keeps no tensor alive (it would hold every intermediate and gradient of a stage at
once: several times the stage's own peak). A storage address (its key,
``storage.storage_key``) can then be reused within a trace by a storage made after the one
there was freed: the tracer tells the two apart by the identity of their Python objects
(``UntypedStorage`` objects are preserved while their storage lives and die with it, so a
weak reference to one is alive exactly as long as its storage; ``_generation``).
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, Iterable, List, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .autograd_graph import graph_nodes
from .eager_mode import EagerDispatchMode
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


@functools.lru_cache(maxsize=None)
def _storages_preserved() -> bool:
    """Whether this torch keeps a storage's Python object while the storage lives and frees it
    with the storage (PyObject preservation of ``UntypedStorage``, torch 2.1 on), so that a weak
    reference to it tells whether that storage still lives. Checked once, on a tensor of our own."""
    t = torch.empty(1)
    ref = weakref.ref(t.untyped_storage())  # (the object returned is dropped at once)
    kept = ref() is not None and ref() is t.untyped_storage()
    del t
    return kept and ref() is None


def _alive() -> bool:
    return True  # a generation whose storage the tracer holds (``OpTracer._keep``)


class OpTracer(EagerDispatchMode):
    """Records, for every ATen op, the storages it reads and writes, and the bytes it moves.

    ``traffic`` (bytes) is what the cost model charges against the memory bandwidth: tensor
    inputs plus outputs of every op that is not a pure view (views, ``detach``, factories move
    nothing).

    ``ops`` and ``sizes`` name each storage by its ``storage_key`` while it lives, and by a
    negative key of its own once it is freed (its address may be another storage's by then):
    the key sets given to ``peak_live`` are the keys of storages alive when it is called."""

    def __init__(self) -> None:
        super().__init__()
        # per storage seen, a *generation* (an index): the ops name generations, not
        # addresses, since an address freed during the trace can be taken by a new storage
        self._ops: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
        self._latest: Dict[int, int] = {}  # address -> the last generation seen there
        self._address: List[int] = []  # generation -> its storage_key
        self._size: List[int] = []  # generation -> the largest nbytes seen
        self._ref: List[Callable[[], Any]] = []  # generation -> its storage object, weakly
        # where a weak reference cannot follow a storage (no PyObject preservation), the
        # storages are held instead, so that no address is reused during the trace
        self._weak = _storages_preserved()
        self._keep: List[Any] = []
        self.traffic = 0
        self.marks: List[int] = []  # op counts at which an autograd node finished

    def mark(self) -> None:
        self.marks.append(len(self._ops))

    def _generation(self, t: torch.Tensor) -> int:
        s = t.untyped_storage()
        k = s._cdata  # ``storage_key``, with the size from the same lookup (on every op)
        n = s.nbytes()
        g = self._latest.get(k)
        if g is None or (self._weak and self._ref[g]() is not s):  # a new storage
            g = self._latest[k] = len(self._address)
            self._address.append(k)
            self._size.append(n)
            if self._weak:
                self._ref.append(weakref.ref(s))
            else:
                self._ref.append(_alive)
                self._keep.append(s)
        elif n > self._size[g]:
            self._size[g] = n
        return g

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins: List[torch.Tensor] = []
        _tensors_in(args, ins)
        _tensors_in(kwargs, ins)
        outs: List[torch.Tensor] = []
        _tensors_in(out, outs)
        self._ops.append((tuple(self._generation(t) for t in ins),
                          tuple(self._generation(t) for t in outs)))
        if _moves_bytes(func):
            self.traffic += sum(dense_bytes(t) for t in ins) + sum(dense_bytes(t) for t in outs)
        return out

    def _keys(self) -> List[int]:
        """Each generation's key now: its storage_key while its storage lives, else its own
        negative one (no storage_key is negative)."""
        return [k if ref() is not None else -1 - g
                for g, (k, ref) in enumerate(zip(self._address, self._ref))]

    def _named(self, release: Set[int] = frozenset()
               ) -> Tuple[List[Tuple[Tuple[int, ...], Tuple[int, ...]]], Dict[int, int], Set[int]]:
        """``ops``, ``sizes`` and the keys ``release`` names now, from one reading of which
        storages live: ``release`` holds storage_keys taken while those storages lived, and
        one freed since (its last holder was the graph) has its generation's own key now."""
        keys = self._keys()
        ops = [(tuple(keys[g] for g in reads), tuple(keys[g] for g in writes))
               for reads, writes in self._ops]
        now = {keys[g] for g, first in enumerate(self._address) if first in release}
        return ops, {keys[g]: n for g, n in enumerate(self._size)}, now

    @property
    def ops(self) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        """Per op, the keys of the storages it read and of those it wrote."""
        return self._named()[0]

    @property
    def sizes(self) -> Dict[int, int]:
        """Per storage key, the largest size (bytes) its storage had in the trace."""
        return self._named()[1]

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
        The keys are ``storage_key``s of storages alive now (a storage freed since has a
        negative key of its own, see the class), ``release``'s those taken while its storages
        lived (a release is a storage the trace's own run freed). Never below 0."""
        ops, sizes, release = self._named(release)
        n = len(ops)
        birth: Dict[int, int] = {}
        last: Dict[int, int] = {}
        known: Set[int] = set()
        last_read: Dict[int, int] = {}
        for i, (reads, writes) in enumerate(ops):
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
                diff[min(end, n)] -= sizes[k]
        for k, b in birth.items():
            end = n if k in keep else last[k] + 1
            if by_node and k not in keep:  # held until the node that last used it returned
                end = next((m for m in marks if m > last[k]), end)
            diff[b] += sizes[k]
            diff[min(end, n)] -= sizes[k]
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
    # a weak reference: the hooks live on the graph's C++ nodes, which can outlive the trace
    # (the model's own graph, in the tail's replay) and must not keep the tracer's record
    ref = weakref.ref(tracer)
    return [node.register_hook(functools.partial(_mark, ref))
            for node in graph_nodes([o.grad_fn for o in outputs], stop)
            if type(node).__name__ != "AccumulateGrad"]
