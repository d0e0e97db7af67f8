"""Environment for tests that start a fresh Python: it must import the same vmalloc and
scheduler as this test process (the installed package in CI, a checkout with a dev build
otherwise), never the unbuilt sources of the working directory. Run such subprocesses with a
``cwd`` outside the checkout: ``python -c`` puts the working directory first on ``sys.path``."""
import os
from typing import Any, Dict

import vmalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = os.path.dirname(os.path.dirname(os.path.abspath(vmalloc.__file__)))


def python_env(*extra_path: str, base: Dict[str, str] = None, **variables: str) -> Dict[str, str]:
    """``base`` (default ``os.environ``) plus ``variables``, with ``PYTHONPATH`` = ``extra_path``,
    then where this process found vmalloc, then the checkout (for ``bench/`` only)."""
    env = dict(os.environ if base is None else base)
    env.update(variables)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*extra_path, PACKAGES, ROOT]))
    return env


PTH = os.path.join(ROOT, "vmalloc", "vmalloc_autoload.pth")


def autoload_env(tmp_path, *extra_path: str, **variables: str) -> Dict[str, str]:
    """``python_env`` (without the caller's ``VMALLOC*`` variables) for a fresh interpreter
    that runs the ``VMALLOC*`` autoload: its user site-packages (``tmp_path/userbase``) holds
    the ``.pth`` file, exactly as pip installs it into site-packages."""
    import subprocess
    import sys
    base = os.path.join(str(tmp_path), "userbase")
    sp = subprocess.run([sys.executable, "-c", "import site; print(site.getusersitepackages())"],
                        env={**os.environ, "PYTHONUSERBASE": base}, capture_output=True,
                        text=True, check=True).stdout.strip()
    os.makedirs(sp, exist_ok=True)
    with open(PTH) as src, open(os.path.join(sp, "vmalloc_autoload.pth"), "w") as dst:
        dst.write(src.read())
    return python_env(*extra_path, base={k: v for k, v in os.environ.items()
                                         if not k.startswith("VMALLOC")},
                      PYTHONUSERBASE=base, **variables)


# The start of a fresh interpreter that uses vmalloc's per-device registry without a GPU: it
# configured as enable() would, on the host backend (64 KiB chunks, no budget).
HOST_REGISTRY = r"""
import vmalloc
from vmalloc import torch_allocator as ta
core = ta.core()
core._torch_configure("host", 64 << 10, 0, -1)     # what enable() does, on the host backend
reg = ta.registry()
reg.mode, reg.config = "global", {"chunk_size": 64 << 10, "budget": 0, "device": None}
"""

# ... that also drives PyTorch's C entry points of vmalloc._core by hand: `malloc`/`free` bound
# with ctypes as PyTorch's pluggable allocator calls them.
TORCH_ENTRY_POINTS = HOST_REGISTRY + r"""
import ctypes, types
lib = ctypes.CDLL(core.__file__)
malloc = lib.vmalloc_torch_malloc
malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
free = lib.vmalloc_torch_free
free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
"""


def torchrun_two_ranks(script: str, cwd: str, *args: str, timeout: float = 240,
                       **variables: str) -> Any:
    """``script args`` under torchrun with 2 ranks on localhost (``python_env``, one thread
    each); the whole process group is killed after ``timeout`` seconds and the test fails
    saying the ranks hung, with the end of their output. A ``subprocess.CompletedProcess``."""
    import signal
    import subprocess
    import sys

    import pytest
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", "2", script, *args]
    proc = subprocess.Popen(cmd, env=python_env(OMP_NUM_THREADS="1", **variables), cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the ranks hung ({timeout:g} s):\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
