"""What the runtimes run eagerly inside compiled code, and how it is said.

``not_compiled``: ``torch.compiler.disable`` with the reason Dynamo's errors quote. The
runtimes run eagerly inside compiled code (they push autograd hooks, read the graph, move
storages): a graph break at each of their entry points. Under ``fullgraph=True`` that break
raises "Skip inlining `torch.compiler.disable()`d function ... (reason: ...)", and the reason
is the one line of that error that can name scheduler and what to do instead.

``eager_hook``: a saved-tensor hook that runs eagerly as ``torch.compiler.disable`` would run
it, without that wrapper's cost (about 2 us a call on the CPU) where no compiled code is
running: autograd calls these hooks once per saved tensor, hundreds of times a step.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar

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


@functools.lru_cache(maxsize=None)
def _frame_api() -> Optional[Any]:
    """Dynamo's per-thread frame callback getter and ``skip_code``, if this torch has them
    (both private: without either, ``eager_hook`` is plain ``torch.compiler.disable``)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return None
    return get_eval_frame_callback, skip_code


def eager_hook(fn: F) -> F:
    """``fn`` run eagerly wherever autograd calls it, as ``torch.compiler.disable(fn)`` runs it.

    A compiled frame installs Dynamo's callback for the frames it calls, and autograd calls a
    saved-tensor hook from inside the compiled block that saves the tensor: Dynamo would trace
    the hook. ``torch.compiler.disable`` unsets that callback around every call, even where
    none is set (no compiled code running: the common case). Here the hook's own frame is
    marked for Dynamo to run as it is (``skip_code``; what it calls would still be seen), and
    it asks for the callback first: none set, ``fn`` runs directly; set, the disabled ``fn``.
    Marked ``_torchdynamo_disable`` too, should Dynamo ever meet the hook while tracing."""
    disabled = torch.compiler.disable(fn)
    api = _frame_api()
    if api is None:
        return disabled  # type: ignore[return-value]
    callback, skip_code = api

    @functools.wraps(fn)
    def hook(*args: Any) -> Any:
        if callback() is None:
            return fn(*args)
        return disabled(*args)

    try:
        skip_code(hook.__code__)  # (every hook made here shares this code object)
    except (AttributeError, RuntimeError, TypeError):  # a private API that changed shape
        return disabled  # type: ignore[return-value]
    hook._torchdynamo_disable = True  # type: ignore[attr-defined]
    return hook  # type: ignore[return-value]
