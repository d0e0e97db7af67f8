"""A dispatch mode that leaves ``torch.compile``'d code as it found it.

Dynamo does not run compiled code under a (non-infra) ``TorchDispatchMode``: it skips the
frame, and the skip is recorded on the frame's code object for good (torch 2.13), so every
later call of that function runs eagerly, in every instance of the class. One measurement
of a compiled block under the op tracer would leave the model's blocks uncompiled for the
rest of training (and a block whose first run was compiled then saves other tensors when it
is recomputed). Under the ``force_eager`` stance, compiled functions *called* while the mode
is on run their own code eagerly without asking Dynamo: nothing is marked.

What the stance cannot reach: frames of a compiled function that was already running when
the mode came on (``torch.compile(model)`` resuming after a graph break under the tail's
tracer, on the CPU) are handed to Dynamo by the callback that function installed, which
skips and marks them (README, "Compiled blocks").

The stance is the process's, not the thread's (dispatch modes are per thread): while a mode
is on, compiled code in other threads runs eagerly too. It is set while at least one such
mode is on (a count), so modes that leave in another order than they came (the tail's
tracer is popped when it is on top, maybe later) never leave it set or unset it under
another; and given back only if it is still ours (a stance the program set meanwhile stays).
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_lock = threading.Lock()
_on = 0                         # modes entered and not yet left
_ours: Optional[Any] = None     # set_stance's context while the stance is ours


def _current_stance() -> Any:
    from torch._dynamo import eval_frame  # (imported by torch.compiler.set_stance anyway)
    return getattr(eval_frame, "_stance", None)


def _enter_eager() -> None:
    global _on, _ours
    with _lock:
        _on += 1
        set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
        if _on == 1 and set_stance is not None:
            try:
                _ours = set_stance("force_eager")
            except RuntimeError:
                # entered from inside a compiled region (torch refuses a stance there):
                # what runs under the mode then is that region's own business
                _ours = None


def _leave_eager() -> None:
    global _on, _ours
    with _lock:
        _on -= 1
        if _on > 0 or _ours is None:
            return
        ours, _ours = _ours, None
        current = _current_stance()
        if current is not None and current is not ours.stance:
            return  # the program set a stance of its own meanwhile: it stays
        try:
            ours.__exit__(None, None, None)
        except RuntimeError:
            # left inside a compiled region: torch refuses a stance there, so force_eager
            # would stay for good; set it back as set_stance's exit would
            from torch._dynamo import eval_frame
            eval_frame._stance = ours.prev


class EagerDispatchMode(TorchDispatchMode):
    """``TorchDispatchMode`` under which compiled code runs eagerly (see module doc)."""

    _eager_depth = 0  # this mode's entries not yet left (a class default: no __init__ needed)

    def __enter__(self) -> Any:
        _enter_eager()
        try:
            out = super().__enter__()
        except BaseException:
            _leave_eager()
            raise
        self._eager_depth += 1
        return out

    def __exit__(self, *exc: Any) -> Any:
        if self._eager_depth <= 0:  # never entered: the count is not this exit's to lower
            return super().__exit__(*exc)
        self._eager_depth -= 1
        try:
            return super().__exit__(*exc)
        finally:
            _leave_eager()
