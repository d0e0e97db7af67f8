"""``scheduler.user_warning.warn`` names the user's line: the first frame outside scheduler,
PyTorch, transformers (and the other libraries it lists) and Python's own library, however
deep the warning is raised (a hook inside a module's ``__call__``, inside autograd)."""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn

import scheduler
from scheduler import user_warning

PACKAGE = os.path.dirname(os.path.abspath(scheduler.__file__))


def library_function(depth: int):
    """A function whose frames look like scheduler's own: ``depth`` calls deep, it warns."""
    code = compile("def f(n):\n    return f(n - 1) if n else warn('deep', UserWarning)\n",
                   os.path.join(PACKAGE, "fake_library.py"), "exec")
    space = {"warn": user_warning.warn}
    exec(code, space)
    return lambda: space["f"](depth)


def test_points_past_library_frames_at_the_caller():
    for depth in (0, 3):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            library_function(depth)()   # <- this line
        assert [(w.filename, str(w.message)) for w in got] == [(__file__, "deep")]


def test_points_past_torch_module_call():
    class Block(nn.Module):
        def forward(self, x):
            return x

    block = Block()
    block.register_forward_hook(lambda *a: library_function(1)())
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        block(torch.zeros(1))   # the hook runs inside torch's Module.__call__
    assert [w.filename for w in got] == [__file__]
