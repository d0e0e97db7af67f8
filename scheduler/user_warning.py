"""Warnings that point at the user's line.

The runtime warns from inside hooks that autograd, a module's ``__call__`` or a Hugging Face
model's forward call (a fixed ``stacklevel`` lands in ``torch/nn/modules/module.py``); the
planners from inside the runtime. ``warn`` names the first frame of the stack outside this
package, the libraries it runs under (PyTorch, transformers, accelerate, peft, vmalloc) and
Python's own library: the line of the user's program that led there. Imports nothing but
the standard library (the planners import it)."""
from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import Optional, Tuple, Type

LIBRARIES = ("scheduler", "torch", "transformers", "accelerate", "peft", "vmalloc")


def _library_dirs() -> Tuple[str, ...]:
    # (sys.modules: never imports one; Python's library holds site-packages too, so an
    # installed package that calls into ours is passed over as well)
    dirs = [os.path.dirname(os.__file__)]
    for name in LIBRARIES:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)))
    return tuple(os.path.join(d, "") for d in dirs) + ("<frozen ",)


def _level() -> int:
    """``warnings.warn``'s stacklevel in ``warn`` for the first frame, from ``warn``'s
    caller out, that is not a library's (``warn``'s caller where all are)."""
    dirs = _library_dirs()
    frame: Optional[FrameType] = sys._getframe(2)   # warn's caller: level 2 inside warn
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(dirs):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 2


def warn(message: str, category: Type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the user's line."""
    warnings.warn(message, category, stacklevel=_level())
