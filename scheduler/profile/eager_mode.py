"""A dispatch mode that leaves ``torch.compile``'d code as it found it.

Dynamo does not run compiled code under a (non-infra) ``TorchDispatchMode``: it skips the
frame, and the skip is recorded on the frame's code object for good (torch 2.13), so every
later call of that function runs eagerly, in every instance of the class. One measurement
of a compiled block under the op tracer would leave the model's blocks uncompiled for the
rest of training (and a block whose first run was compiled then saves other tensors when it
is recomputed). Under the ``force_eager`` stance Dynamo is never asked: the traced code runs
eagerly and nothing is marked.

The stance is the process's, not a stack: it is set while at least one such mode is on
(a count), so modes that leave in another order than they came (the tail's tracer is popped
when it is on top, maybe later) never leave it set, or unset it under another.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_lock = threading.Lock()
_on = 0                         # modes entered and not yet left
_restore: Optional[Any] = None  # what gives the stance back (set_stance's context)


def _enter_eager() -> None:
    global _on, _restore
    with _lock:
        _on += 1
        set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
        if _on == 1 and _restore is None and set_stance is not None:
            try:
                _restore = set_stance("force_eager")
            except RuntimeError:  # entered inside a compiled region: Dynamo runs there anyway
                _restore = None


def _leave_eager() -> None:
    global _on, _restore
    with _lock:
        _on -= 1
        if _on == 0 and _restore is not None:
            try:
                _restore.__exit__(None, None, None)
                _restore = None
            except RuntimeError:  # left inside a compiled region: given back at the next leave
                pass


class EagerDispatchMode(TorchDispatchMode):
    """``TorchDispatchMode`` under which compiled code runs eagerly (see module doc)."""

    def __enter__(self) -> Any:
        _enter_eager()
        try:
            return super().__enter__()
        except BaseException:
            _leave_eager()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            _leave_eager()
