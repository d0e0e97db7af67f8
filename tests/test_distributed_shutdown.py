"""``scheduler.runtime.distributed.shutdown`` without torchrun: a one-rank gloo group in a
fresh interpreter (its gloo threads must not outlive the test process). The race it closes
(a gloo thread dropping the last collective while the interpreter finalizes) is exercised by
``tests/test_distributed.py``'s launches, which assert every rank exits 0."""
import subprocess
import sys

import pytest

from _subproc import python_env

SCRIPT = r"""
import datetime, socket, torch, torch.distributed as dist
from scheduler.runtime import distributed as D
from scheduler.runtime.swap import global_context, install_global

D.shutdown()                                   # no process group: nothing to do
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
install_global("64KiB")                        # what VMALLOC_WINDOW does at import torch
with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
    try:
        D.shutdown()
        print("no error inside saved_tensors_hooks")
    except RuntimeError as exc:
        assert "saved-tensor hooks" in str(exc), exc
assert dist.is_initialized()                   # refused before touching the group
x = torch.ones(3, requires_grad=True)
(x * x).sum().backward()                       # a backward: PyTorch stashes its context
D.shutdown(timeout=60)
assert global_context() is None, "the global swap context is still installed"
assert not dist.is_initialized()
assert not torch._C._is_key_in_tls(D._EXIT_MARK)
print("OK")
"""


def test_shutdown_uninstalls_the_window_waits_and_destroys_the_group(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=python_env(OMP_NUM_THREADS="1"),
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-3000:]
    assert "no error inside" not in r.stdout


def test_shutdown_names_a_bad_timeout():
    from scheduler.runtime.distributed import shutdown
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match="timeout"):
            shutdown(timeout=bad)
