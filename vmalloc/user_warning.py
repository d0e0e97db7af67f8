"""Warnings that point at the user's line.

vmalloc's start-up warns while ``import torch`` runs (the import system's frozen frames and
torch's lie in between); the scheduler's runtime warns from inside hooks that autograd, a
module's ``__call__`` or a Hugging Face model's forward call (a fixed ``stacklevel`` lands in
``torch/nn/modules/module.py``); its planners from inside the runtime. ``warn`` names the
first frame of the stack outside the libraries it runs under (vmalloc, scheduler, PyTorch,
transformers, accelerate, peft) and Python's own library: the line of the user's program
that led there. Imports nothing but the standard library (the torch-free planners use it).
"""
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


def _user_frame() -> Optional[FrameType]:
    """The first frame, from ``warn``'s caller out, that is not a library's (None where all
    are: a thread started inside one)."""
    dirs = _library_dirs()
    frame: Optional[FrameType] = sys._getframe(2)   # warn's caller
    while frame is not None and frame.f_code.co_filename.startswith(dirs):
        frame = frame.f_back
    return frame


def warn(message: str, category: Type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the user's line. Given as that frame's own
    (``warn_explicit``: a stacklevel would miscount the import system's frames, which
    ``warnings.warn`` passes over, when the warning comes during an import)."""
    frame = _user_frame()
    if frame is None:
        warnings.warn(message, category, stacklevel=2)   # warn's caller
        return
    # (no module_globals: its loader would be asked for the source line, and __main__'s of
    # ``python -c`` raises ImportError from inside the warning)
    g = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=g.get("__name__"),
                           registry=g.setdefault("__warningregistry__", {}))
