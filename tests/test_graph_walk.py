"""``graph_nodes`` walks an autograd graph once per node, also where the nodes' Python objects
live only while referenced (torch 2.11: a C++ node's wrapper is made on each access and freed
when dropped). Telling nodes apart by ``id`` of dropped wrappers skipped nodes whose new
wrapper reused a freed one's address: their backward hooks were never registered and the
CPU tracer's transients changed from run to run (found running the suite on torch 2.11)."""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch

from scheduler.profile import _trace as T


class _CppNode:
    """A node of the graph as C++ holds it: its inputs' nodes, and a weak link to the one
    Python wrapper alive for it (as torch's ``Node::pyobj``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.next: List[Optional["_CppNode"]] = []
        self.py: Optional["weakref.ref[_Wrapper]"] = None


class _Wrapper:
    """What ``tensor.grad_fn`` / ``next_functions`` hand Python: made on demand, cached only
    while something references it."""

    def __init__(self, cpp: _CppNode) -> None:
        self.cpp = cpp

    @property
    def next_functions(self):
        return tuple((None if c is None else wrap(c), 0) for c in self.cpp.next)


def wrap(cpp: _CppNode) -> _Wrapper:
    w = cpp.py() if cpp.py is not None else None
    if w is None:
        w = _Wrapper(cpp)
        cpp.py = weakref.ref(w)
    return w


def ladder(n: int, reads: int = 2) -> List[_CppNode]:
    """n nodes, each reading the next ``reads`` (2: a graph with many shared inputs, as a
    residual network's), the last reading nothing."""
    nodes = [_CppNode(f"n{i}") for i in range(n)]
    for i, node in enumerate(nodes):
        node.next = [nodes[j] for j in range(i + 1, i + 1 + reads) if j < n] + [None]
    return nodes


def test_every_node_once_when_wrappers_are_transient():
    nodes = ladder(60)
    names = [w.cpp.name for w in T.graph_nodes([wrap(nodes[0])])]
    assert sorted(names) == sorted(n.name for n in nodes)


def test_stop_nodes_are_not_passed():
    nodes = ladder(30, reads=1)
    stop = wrap(nodes[10])
    names = [w.cpp.name for w in T.graph_nodes([wrap(nodes[0])], [stop])]
    assert names == [f"n{i}" for i in range(10)]


def test_real_graph_every_node_once():
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    y = x
    for _ in range(20):
        y = torch.tanh(y @ w) + y
    nodes = list(T.graph_nodes([y.sum().grad_fn]))
    assert len({id(n) for n in nodes}) == len(nodes)
    assert sum(type(n).__name__ == "AccumulateGrad" for n in nodes) == 2
