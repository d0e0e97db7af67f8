"""Questions about the autograd graph of the model's tail, asked before its backward is
replayed (``tail._replay``): which of the last block's outputs the tail reads
(``read_by_tail``), which weights its backward reaches and whether it runs a custom autograd
Function (``tail_graph``), and whether the model has module backward hooks a replay would call
(``has_backward_hooks``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Set, Tuple

import torch
from torch import nn

from ..profile.autograd_graph import graph_nodes


def has_backward_hooks(model: nn.Module) -> bool:
    """Module backward hooks (global, or on ``model``'s modules) that a replay of its
    backward would call once more."""
    from torch.nn.modules import module as M
    if M._global_backward_hooks or M._global_backward_pre_hooks:
        return True
    return any(m._backward_hooks or m._backward_pre_hooks for m in model.modules())


def read_by_tail(roots: Sequence[torch.Tensor], lasts: Sequence[torch.Tensor]
                  ) -> List[torch.Tensor]:
    """The last block's outputs whose gradients the replay asks for: those the tail reads
    itself, less those another output is computed from by ops that saved tensors (BLOOM's
    attention probabilities, transformers 4's MoE router logits, which the tail's
    load-balancing loss reads too): asking for their gradient would run the block's own
    backward. An output that is only a view of another is kept (a view's backward reads
    nothing saved), as is a leaf output (no graph to enter). If that leaves nothing, every
    output the tail reads: the replay then says why it cannot measure."""
    stops = [t.grad_fn for t in lasts]  # held: their ids are theirs for the whole walk
    edge = {(id(fn), t.output_nr): k for k, (fn, t) in enumerate(zip(stops, lasts))
            if fn is not None}
    read = {k for k, t in enumerate(lasts) if t.grad_fn is None or any(r is t for r in roots)}
    for node in graph_nodes([t.grad_fn for t in roots], stops):
        read.update(k for k in (edge.get((id(fn), nr)) for fn, nr in node.next_functions)
                    if k is not None)
    inner = _computed_from(stops, edge)
    kept = [t for k, t in enumerate(lasts) if k in read and k not in inner]
    return kept or [t for k, t in enumerate(lasts) if k in read]


def _computed_from(stops: Sequence[Any], edge: Dict[Tuple[int, int], int]) -> Set[int]:
    """The outputs (``edge`` keys: node id, output number) that another output's graph reaches
    through a node that saved tensors (its backward would unpack them)."""
    found: Set[int] = set()
    held = list(stops)  # nodes seen stay alive: their ids stay theirs (see graph_nodes)
    saves: Dict[int, bool] = {}
    seen: Set[Tuple[int, bool]] = set()
    todo = [(fn, False) for fn in stops if fn is not None]
    while todo:
        node, saving = todo.pop()
        if id(node) not in saves:
            saves[id(node)] = _saves(node)
            held.append(node)
        saving = saving or saves[id(node)]
        if (id(node), saving) in seen:
            continue
        seen.add((id(node), saving))
        for fn, nr in node.next_functions:
            if fn is None:
                continue
            k = edge.get((id(fn), nr))
            if k is not None and saving:
                found.add(k)
            todo.append((fn, saving))
    return found


def _saves(node: Any) -> bool:
    """Whether an autograd node's backward reads tensors saved in the forward."""
    return any(name.startswith("_raw_saved_") for name in dir(node))


def tail_graph(roots: Sequence[torch.Tensor], lasts: Sequence[torch.Tensor]
                ) -> Tuple[List[torch.Tensor], bool]:
    """The parameters the tail's backward reaches (``AccumulateGrad`` nodes) from ``roots``
    without going past the last block's outputs, and whether it runs a custom autograd
    Function (its backward could have side effects a replay would repeat)."""
    params: List[torch.Tensor] = []
    custom = False
    for node in graph_nodes([t.grad_fn for t in roots], [t.grad_fn for t in lasts]):
        if type(node).__name__ == "AccumulateGrad":
            params.append(node.variable)
        else:
            custom |= isinstance(node, torch.autograd.function.BackwardCFunction)
    return params, custom
