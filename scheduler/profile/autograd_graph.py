"""Autograd's side of a stage: which tensors can carry a gradient, the nodes of its graph
(``graph_nodes``), the model's gradient hooks silenced while measuring (``hooks_silenced``), what
autograd saves for the backward (``SavedTensors``, ``unlinked``; ``saved_sizes``: its bytes),
and the backward of one stage (``backward``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from .storage import Tensors, storage_bytes, storage_key, xbar_bytes


def differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


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
        self._ctx: Optional[torch.autograd.graph.saved_tensors_hooks] = None

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
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        ctx, self._ctx = self._ctx, None
        # (dropped: held, its ``self._pack`` would be a cycle, self -> hooks -> self, keeping
        # every saved tensor until Python's collector runs: each stage of a measured chain
        # on top of the last)
        if ctx is not None:
            ctx.__exit__(*exc)

    def keys(self) -> Set[int]:
        return {storage_key(t) for t in self.tensors}


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
