"""``VMALLOC=1`` with no code change: run by ``vmalloc_autoload.pth`` at interpreter start.

The ``.pth`` line imports this module only when ``VMALLOC`` (not 0/false/no/off),
``VMALLOC_WINDOW`` or ``VMALLOC_REPORT`` is set, so other processes pay nothing. Here we
validate the variables at once (a malformed one stops the program with a message naming it; one
that is set but does nothing without ``VMALLOC=1`` is said on stderr) and wait for ``import
torch``: when torch has finished importing - before any CUDA allocation - we register vmalloc as
its CUDA allocator, turn on the swap runtime for ``VMALLOC_WINDOW`` (issue 6's
``scheduler.runtime.swap.install_global``, imported only then: this is the one place where the
two packages meet) and arrange the ``VMALLOC_REPORT`` exit report, claiming its path then
(``report_process.claim_report``): a process that never imports torch writes no report, so
it leaves the path to the processes it starts.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any, Callable, Mapping, Optional

from .env import EnvConfig, read_env

_installed = False
#: the pid this interpreter started in (:func:`install` runs at start-up): a child of a bare
#: ``os.fork()`` inherits it, and so is told from the process it was forked from
_started_in: Optional[int] = None


def install(environ: Optional[dict] = None) -> None:
    """Validate the environment and hook ``import torch``. Exits with status 2 on a bad value."""
    global _installed, _started_in
    if _started_in is None:
        _started_in = os.getpid()
    try:
        cfg = read_env(environ)
    except ValueError as exc:
        sys.stderr.write(f"vmalloc: bad environment variable: {exc}\n"
                         "vmalloc: fix or unset it (see the README's 'Turn it on').\n")
        sys.stderr.flush()
        os._exit(2)   # SystemExit inside a .pth is a fatal site error with a traceback; this is clean
    env = os.environ if environ is None else environ
    _warn_unused(cfg, env)
    if cfg.report:  # a RANK, WORLD_SIZE, ... that cannot be read is said now, not only at exit
        from .report_process import check_launch_variables
        check_launch_variables(env)
    if _installed or not (cfg.active or cfg.report):
        return
    _installed = True
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda"):
        on_torch_import(torch, cfg)
    else:
        sys.meta_path.insert(0, _TorchImportHook(lambda mod: on_torch_import(mod, cfg)))


_warned_unused = False


def _warn_unused(cfg: EnvConfig, environ: Mapping[str, str]) -> None:
    """Say once, on stderr, which variables are set but do nothing: VMALLOC_CHUNK_SIZE without
    VMALLOC=1, VMALLOC_BUDGET without VMALLOC=1 or VMALLOC_WINDOW (which also uses it)."""
    global _warned_unused
    if _warned_unused or cfg.enabled:
        return
    unused = (["VMALLOC_CHUNK_SIZE"] if cfg.chunk_size is not None else []) \
        + (["VMALLOC_BUDGET"] if cfg.budget is not None and cfg.window is None else [])
    if not unused:
        return
    _warned_unused = True
    needs = {"VMALLOC_CHUNK_SIZE": "VMALLOC=1", "VMALLOC_BUDGET": "VMALLOC=1 or VMALLOC_WINDOW"}
    flag = environ.get("VMALLOC", "").strip()
    sys.stderr.write(f"vmalloc: ignored, since {f'VMALLOC={flag}' if flag else 'VMALLOC is unset'}: "
                     + ", ".join(f"{n}={environ[n].strip()} (takes effect only with {needs[n]})"
                                 for n in unused) + "\n")
    sys.stderr.flush()


def on_torch_import(torch: Any, cfg: EnvConfig) -> None:
    """What the environment asks for, done right after torch is imported."""
    from . import torch_allocator
    if cfg.report:
        # this process writes a report (unless it is a launcher): the processes it starts from
        # now on (a training run by subprocess, a child it forks) name theirs by pid instead of
        # overwriting it; one forked before this import names the process it was forked from
        from .report_process import claim_report
        claim_report(pid=_started_in)
        torch_allocator.start_recording()
        torch_allocator.register_exit_report(cfg.report)
    if cfg.enabled:
        from .pluggable.register import cuda_present  # (no cuInit: forking stays possible)
        if cuda_present(torch):
            torch_allocator.enable(chunk_size=cfg.chunk_size, budget=cfg.budget)
        else:
            from .pluggable.registry import REGISTRY
            REGISTRY.env_not_enabled = "VMALLOC=1 is set, but torch sees no CUDA device"
            from . import user_warning  # at the line that imported torch, the user's
            user_warning.warn("vmalloc: VMALLOC=1 but torch sees no CUDA device; PyTorch's "
                              "allocator stays in place", RuntimeWarning)
    if cfg.window is not None:
        try:
            from scheduler.runtime.swap import install_global  # noqa: PLC0415 - lazy on purpose
        except ImportError as exc:
            raise RuntimeError(
                f"VMALLOC_WINDOW={os.environ.get('VMALLOC_WINDOW')!r} needs the swap runtime "
                f"scheduler.runtime.swap.install_global, which cannot be imported ({exc}); unset "
                "VMALLOC_WINDOW or install the full vmalloc distribution") from None
        install_global(cfg.window, budget=cfg.budget)


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps torch's loader so ``callback(torch)`` runs after torch's
    ``__init__`` completes, then steps out of ``sys.meta_path``."""

    def __init__(self, callback: Callable[[Any], None]):
        self.callback = callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != "torch":
            return None
        self._remove()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _AfterExec(spec.loader, self.callback)
        return spec

    def _remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


class _AfterExec(importlib.abc.Loader):
    def __init__(self, inner: Any, callback: Callable[[Any], None]):
        self.inner = inner
        self.callback = callback

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        # torch sees its real loader (importlib.resources and friends ask it for files)
        module.__loader__ = self.inner
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        self.callback(module)
