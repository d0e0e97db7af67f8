"""``torch.compiler.disable`` with the reason Dynamo's errors quote.

The runtimes run eagerly inside compiled code (they push autograd hooks, read the graph, move
storages): a graph break at each of their entry points. Under ``fullgraph=True`` that break
raises "Skip inlining `torch.compiler.disable()`d function ... (reason: ...)", and the reason
is the one line of that error that can name scheduler and what to do instead.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def not_compiled(what: str, compile_instead: str) -> Callable[[F], F]:
    """``torch.compiler.disable``, naming the reason where torch takes one (some do not):
    ``what`` runs eagerly, which ``fullgraph=True`` refuses, and the blocks to compile
    instead (``compile_instead``: which, and when)."""
    reason = (f"{what}, a graph break, which fullgraph=True refuses: compile {compile_instead} "
              "(torch.compile(block, fullgraph=True) works) and the model without fullgraph")
    try:
        return torch.compiler.disable(reason=reason)  # type: ignore[call-arg]
    except TypeError:
        return torch.compiler.disable
