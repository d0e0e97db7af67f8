"""The autograd and dispatch stacks as the tail probe (``tail.TailProbe``) uses them: whether
they are clean (``stacks_clean``), the entries it pushes (``Hooks``: saved-tensor pack hooks;
``TailTracer``: the op tracer), popped only when on top of their stack (``pop_hooks``,
``pop_tracer``), and those that were not, inert until they can be (``_stale``, ``sweep``;
``let_go`` when their probe is gone), and the model call they belong to (``Within``).
"""
from __future__ import annotations

import collections
import gc
import sys
import threading
import weakref
from types import FrameType
from typing import Any, List, Optional, Tuple

import torch
from torch.utils import _python_dispatch as dispatch

from ..profile.autograd_graph import unlinked
from ..profile.op_tracer import OpTracer


def _top_hooks() -> Any:
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def stacks_clean() -> bool:
    """No saved-tensor hooks and no dispatch mode active (ours would shadow them)."""
    return _top_hooks() is None and dispatch._get_current_dispatch_mode() is None


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def module_call_frame() -> Optional[FrameType]:
    """The frame of the innermost ``nn.Module`` call running on this thread (``_call_impl``,
    which runs a module's hooks and its forward), for a module hook to find its own call by."""
    f = sys._getframe(1)
    while f is not None and f.f_code is not _CALL_IMPL:
        f = f.f_back
    return f


def _frame_at(depth: int) -> Optional[FrameType]:
    """The frame ``depth`` calls below the bottom of this thread's stack (0: the outermost),
    if the stack is that deep."""
    stack = []
    f = sys._getframe(1)
    while f is not None:
        stack.append(f)
        f = f.f_back
    return stack[-1 - depth] if depth < len(stack) else None


def _depth(frame: FrameType) -> int:
    """How many calls ``frame`` is above the bottom of its thread's stack (``_frame_at``)."""
    n = 0
    while frame.f_back is not None:
        frame, n = frame.f_back, n + 1
    return n


class Within:
    """The model call a recording belongs to (its ``_call_impl`` frame, on its thread): once
    that call has ended without saying so (an interrupt), the recording's entries (``entries``:
    its tracer and hooks) turn inert and are queued to be popped (``_stale``), instead of
    recording whatever runs next (a Ctrl-C handler saving the model) until the model is called
    again. Found at the entries' next use, or at the model's next call.

    The frame is not held (it holds the caller's locals, the model among them: a cycle through
    the model's hooks that only the garbage collector frees): it is known by its place, the
    frame at its depth on the stack, its id, code and module (``self``); a later call in that
    place (``over(entering=...)``: the model's next call) ends it too."""

    def __init__(self, frame: Optional[FrameType]) -> None:
        self.where: Optional[Tuple[int, int]] = None  # (depth, id); None: not known (no check)
        self.module: Any = None  # the module called there, weakly
        if frame is not None:
            self.where = (_depth(frame), id(frame))
            try:
                self.module = weakref.ref(frame.f_locals["self"])
            except (KeyError, TypeError):  # (no check of the module then)
                pass
        self.thread = threading.get_ident()
        self.ended = False
        self.entries: List[Any] = []

    def _running(self) -> bool:
        """Whether the call's frame is on this thread's stack still."""
        depth, key = self.where  # type: ignore[misc]
        f = _frame_at(depth)
        if f is None or id(f) != key or f.f_code is not _CALL_IMPL:
            return False
        return self.module is None or f.f_locals.get("self") is self.module()

    def over(self, entering: Optional[FrameType] = None) -> bool:
        """The call has ended (judged on its own thread only: autograd's device threads run
        the replayed backward's ops with our entries too, outside that stack). ``entering``:
        the frame of a new call of the module, which is not the same call even where it has
        the old one's place and id."""
        if not self.ended and self.where is not None and \
                threading.get_ident() == self.thread and \
                (not self._running() or (entering is not None and
                                         (_depth(entering), id(entering)) == self.where)):
            self.ended = True
            for entry in self.entries:  # (no one reads the recording of a call that ended so)
                retire(entry, forget=True)
            self.entries = []
        return self.ended


class TailTracer(OpTracer):
    """The op tracer, inert once its recording is over (if it could not be popped at once) or
    once the model call it records in has ended without popping it (``Within``)."""

    active = True
    queued = False  # in ``_stale``

    def __init__(self, within: Optional[Within] = None) -> None:
        super().__init__()
        self.within = within

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.within is not None:
            self.within.over()
        if not self.active:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class Hooks:
    """The pack/unpack pair pushed for the tail. Packs keep what autograd would keep (the
    tensor, unlinked from its history as ``chain_exec`` does: no reference cycle) and, while
    recording (within the model call of ``within``), note it."""

    queued = False  # in ``_stale``

    def __init__(self, within: Optional[Within] = None) -> None:
        self.saved: List[torch.Tensor] = []
        self.recording = True
        self.within = within

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Keep ``t`` for autograd (unlinked) and note it while recording."""
        # noted unlinked too: with its history, a noted tensor would lead back to the nodes
        # that keep this hook (a cycle through the C++ graph) until ``saved`` is cleared
        t = unlinked(t)
        if self.within is not None:
            self.within.over()
        if self.recording:
            self.saved.append(t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def retire(entry: Any, forget: bool = False) -> None:
    """Make a pushed entry inert (the tracer records and keeps nothing, the hooks note
    nothing more) and queue it to be popped at the next safe point (``sweep``, at a model
    call): never popped here, inside an op's dispatch or a garbage collection. What the hooks
    noted stays for the measurement that reads it, unless ``forget``."""
    entry.within = None
    if isinstance(entry, TailTracer):
        entry.active, entry._keep = False, []
    else:
        entry.recording = False
        if forget:
            entry.saved.clear()
    if not entry.queued:
        entry.queued = True
        _stale.append(("tracer" if isinstance(entry, TailTracer) else "hooks", entry))


# pushed entries that were not on top of their stack when their call ended: popped as soon as
# they are (each is inert meanwhile: the hooks pass tensors through, the tracer records nothing)
_stale: List[Tuple[str, Any]] = []


def pop_hooks(h: Hooks) -> bool:
    """Pop ``h`` if it is the top saved-tensor hooks pair; whether it was."""
    top = _top_hooks()
    if top is not None and getattr(top[0], "__self__", None) is h:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        return True
    return False


def pop_tracer(tr: TailTracer) -> bool:
    """Exit ``tr`` if it is the current dispatch mode; whether it was."""
    if dispatch._get_current_dispatch_mode() is tr:
        tr.__exit__(None, None, None)
        return True
    return False


def sweep() -> None:
    """Pop stale entries that are on top of their stacks now. (Called where no op is being
    dispatched: a model call, a probe's removal; ``let_go`` below.)"""
    changed = True
    while changed and _stale:
        changed = False
        for item in list(_stale):
            kind, obj = item
            if (pop_hooks(obj) if kind == "hooks" else pop_tracer(obj)):
                _stale.remove(item)
                changed = True


# whether a garbage collection is under way: each collection's phase moves its name last in
# this dict ("start", then "stop"), by a C function (a Python callback would run bytecode,
# where a Ctrl-C's KeyboardInterrupt raised in it would be lost: CPython only prints it)
_gc_phase: "collections.OrderedDict[str, None]" = collections.OrderedDict(start=None, stop=None)
gc.callbacks.append(_gc_phase.move_to_end)  # (called as move_to_end(phase, info): info is true)


def let_go(entries: List[Any]) -> None:
    """The owner of ``entries`` (a tail probe, with its model) is gone, its recording with it:
    they turn inert, and what is on top of its stack is popped now, unless a garbage collection
    runs this (it may have begun inside an op's dispatch, where popping a dispatch mode would
    break that op): then at the next ``sweep``. Without this, a Ctrl-C in a model's tail left
    its tracer on the dispatch stack for good once the model was gone: ``torch.compile``
    compiled nothing, every op ran through it."""
    for entry in entries:
        retire(entry, forget=True)
    entries.clear()
    if next(reversed(_gc_phase)) != "start":
        sweep()
