"""Where ``vmalloc._core`` comes from when the imported ``vmalloc`` has none of its own.

``pip install .`` puts the native module in site-packages, but ``python -c ...`` or ``python -m
vmalloc`` started in the checkout import the checkout's sources (the current directory comes
first on ``sys.path``), where only ``scripts/dev-build`` puts a ``_core``. Then the ``_core`` of
an installed vmalloc serves, only if that installation was made from these very sources (its
Python files, vmalloc's and scheduler's, are byte for byte the imported ones; csrc/ is not
installed, so a change there alone is not seen: rebuild): a build of other sources (an install
older than a ``git pull``) would fail later with a puzzling ``TypeError`` in a binding. Only the
native module is taken from there; every Python module stays the imported package's. Without
such an installation the ``ImportError`` says which directory was imported, why, and both
remedies.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Dict, Iterator, List, Optional

SUFFIXES = importlib.machinery.EXTENSION_SUFFIXES


def core_file(directory: str) -> Optional[str]:
    """The ``_core`` extension in ``directory`` for this Python, if any."""
    for suffix in SUFFIXES:
        path = os.path.join(directory, "_core" + suffix)
        if os.path.isfile(path):
            return path
    return None


def _installed_dirs(here: str) -> Iterator[str]:
    """Other ``vmalloc`` directories: on ``sys.path``, then among the installed distribution's
    files (importlib.metadata), each once."""
    seen = {os.path.realpath(here)}
    candidates: List[str] = [os.path.join(e or os.getcwd(), "vmalloc") for e in sys.path
                             if isinstance(e, str)]
    try:
        from importlib.metadata import distribution
        candidates += [os.path.dirname(str(f.locate())) for f in distribution("vmalloc").files or ()
                       if len(f.parts) >= 2 and f.parts[-2] == "vmalloc"
                       and f.name.startswith("_core.")]
    except Exception:  # noqa: BLE001 - no distribution, odd metadata: nothing installed
        pass
    for directory in candidates:
        real = os.path.realpath(directory)
        if real not in seen and os.path.isdir(real):
            seen.add(real)
            yield directory


def _sources(directory: str) -> Dict[str, bytes]:
    """The Python files of the package at ``directory`` and of ``scheduler`` beside it (the
    native module's other caller), by path relative to their parent. A change to csrc/ alone
    is not seen: the sources of the native module are not installed."""
    out: Dict[str, bytes] = {}
    parent = os.path.dirname(directory)
    for package in (directory, os.path.join(parent, "scheduler")):
        for root, dirs, files in os.walk(package):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    with open(path, "rb") as f:
                        out[os.path.relpath(path, parent)] = f.read()
    return out


def load(package: str, here: str) -> types.ModuleType:
    """``<package>._core`` from an installation of the sources at ``here``; else ImportError."""
    mine: Optional[Dict[str, bytes]] = None
    differs: List[str] = []
    for directory in _installed_dirs(here):
        path = core_file(directory)
        if path is None:
            continue
        mine = _sources(here) if mine is None else mine
        if _sources(directory) != mine:
            differs.append(directory)
            continue
        name = f"{package}._core"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        setattr(sys.modules[package], "_core", module)   # as an import of the submodule does
        return module
    raise ImportError(missing_message(here, differs), name=f"{package}._core")


def missing_message(here: str, differs: List[str]) -> str:
    """Why ``_core`` cannot be imported: the directory imported, how it came first, what an
    installation lacked, and the two remedies."""
    root = os.path.dirname(here)
    source = os.path.isfile(os.path.join(root, "pyproject.toml"))
    what = f"the source tree at {root}" if source else f"the vmalloc package at {here}"
    cwd = os.path.realpath(os.getcwd())
    first = next((os.path.realpath(e or os.getcwd()) for e in sys.path if isinstance(e, str)
                  and os.path.isdir(os.path.join(e or os.getcwd(), "vmalloc"))), None)
    if first == cwd == os.path.realpath(root):
        why = (f"{what} is imported instead of an installed vmalloc because the current "
               "directory comes first on sys.path")
    else:
        why = f"{what} is imported"
    installed = (f"the installed vmalloc at {differs[0]} was built from other sources (its "
                 "Python files differ from these), so its _core is not used" if differs
                 else "no installed vmalloc has one either")
    build = os.path.join(root, "scripts", "dev-build") if source else "scripts/dev-build"
    return (f"vmalloc._core is not built: {why}, and it has no vmalloc/_core{SUFFIXES[0]} for "
            f"this Python; {installed}. Build it in place with {build}, or install vmalloc "
            f"with `pip install {root if source else '.'}` (an installation of these sources "
            "serves the checkout too)")
