"""``vmalloc.user_warning.warn`` names the user's line: the first frame outside scheduler,
PyTorch, transformers (and the other libraries it lists) and Python's own library, however
deep the warning is raised (a hook inside a module's ``__call__``, inside autograd)."""
from __future__ import annotations

import functools
import os
import warnings

import torch
from torch import nn

import scheduler
from vmalloc import user_warning

PACKAGE = os.path.dirname(os.path.abspath(scheduler.__file__))


def library_function(depth: int):
    """A function whose frames look like scheduler's own: ``depth`` calls deep, it warns."""
    code = compile("def f(n):\n    return f(n - 1) if n else warn('deep', UserWarning)\n",
                   os.path.join(PACKAGE, "fake_library.py"), "exec")
    space = {"warn": user_warning.warn}
    exec(code, space)
    return functools.partial(space["f"], depth)   # (no frame of this file in between)


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


def test_points_at_the_import_statement_past_the_import_system(tmp_path, monkeypatch):
    """A library module that warns while it is imported: between it and the user's ``import``
    line lie the import system's frozen frames, which ``warnings.warn``'s stacklevel passes
    over, so a counted stacklevel overshot (the warning named ``sys:1``)."""
    import sys
    (tmp_path / "library_module_warns.py").write_text(
        "from vmalloc import user_warning\nuser_warning.warn('while imported')\n")
    library = user_warning._library_dirs
    monkeypatch.setattr(user_warning, "_library_dirs",
                        lambda: library() + (os.path.join(str(tmp_path), ""),))
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        import library_module_warns  # noqa: F401
    monkeypatch.delitem(sys.modules, "library_module_warns", raising=False)
    assert [(w.filename, w.lineno, str(w.message)) for w in got] == \
        [(__file__, line, "while imported")]


def test_a_warning_under_python_c_is_given_not_raised():
    """``python -c``'s __main__ has a loader that cannot give source lines: asked for the
    warning's line (``warn_explicit(module_globals=...)``), it raised ImportError from inside
    the warning."""
    import subprocess
    import sys
    from _subproc import python_env
    code = "from vmalloc import user_warning; user_warning.warn('said', RuntimeWarning)"
    r = subprocess.run([sys.executable, "-c", code], env=python_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "<string>:1: RuntimeWarning: said" in r.stderr
