"""The autograd and dispatch stacks as the tail probe (``tail.TailProbe``) uses them: whether
they are clean (``_stacks_clean``), the entries it pushes (``_Hooks``: saved-tensor pack hooks;
``_TailTracer``: the op tracer), popped only when on top of their stack (``_pop_hooks``,
``_pop_tracer``), and those that were not, inert until they can be (``_stale``, ``_sweep``).
"""
from __future__ import annotations

from typing import Any, List, Tuple

import torch
from torch.utils import _python_dispatch as dispatch

from ..profile.autograd_graph import unlinked
from ..profile.op_tracer import OpTracer


def _top_hooks() -> Any:
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def _stacks_clean() -> bool:
    """No saved-tensor hooks and no dispatch mode active (ours would shadow them)."""
    return _top_hooks() is None and dispatch._get_current_dispatch_mode() is None


class _TailTracer(OpTracer):
    """The op tracer, inert once its recording is over (if it could not be popped at once)."""

    active = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.active:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Hooks:
    """The pack/unpack pair pushed for the tail. Packs keep what autograd would keep (the
    tensor, unlinked from its history as ``chain_exec`` does: no reference cycle) and, while
    recording, note it."""

    def __init__(self) -> None:
        self.saved: List[torch.Tensor] = []
        self.recording = True

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # noted unlinked too: with its history, a noted tensor would lead back to the nodes
        # that keep this hook (a cycle through the C++ graph) until ``saved`` is cleared
        t = unlinked(t)
        if self.recording:
            self.saved.append(t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


# pushed entries that were not on top of their stack when their call ended: popped as soon as
# they are (each is inert meanwhile: the hooks pass tensors through, the tracer records nothing)
_stale: List[Tuple[str, Any]] = []


def _pop_hooks(h: _Hooks) -> bool:
    top = _top_hooks()
    if top is not None and getattr(top[0], "__self__", None) is h:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        return True
    return False


def _pop_tracer(tr: _TailTracer) -> bool:
    if dispatch._get_current_dispatch_mode() is tr:
        tr.__exit__(None, None, None)
        return True
    return False


def _sweep() -> None:
    """Pop stale entries that are on top of their stacks now."""
    changed = True
    while changed and _stale:
        changed = False
        for item in list(_stale):
            kind, obj = item
            if (_pop_hooks(obj) if kind == "hooks" else _pop_tracer(obj)):
                _stale.remove(item)
                changed = True
