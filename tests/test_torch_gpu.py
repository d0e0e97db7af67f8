"""vmalloc as PyTorch's CUDA allocator (needs a GPU; skipped without one).

Every case runs in a fresh interpreter: PyTorch accepts a new allocator only before CUDA is
initialised, and the registration lasts for the process.
"""
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from _subproc import python_env

pytestmark = pytest.mark.gpu
TMP = tempfile.gettempdir()   # any working directory outside the checkout (see _subproc)


def run(code, env=None):
    full = python_env(base={k: v for k, v in os.environ.items() if not k.startswith("VMALLOC")},
                      **(env or {}))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, cwd=TMP,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


TRAIN = """
    import sys, torch
    if sys.argv[-1] == "vmalloc":
        import vmalloc; vmalloc.enable(budget="8GiB")
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.Flatten(),
                            torch.nn.Linear(16 * 32 * 32, 10)).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(32, 3, 32, 32, device="cuda")
        loss = torch.nn.functional.cross_entropy(m(x), torch.randint(0, 10, (32,), device="cuda"))
        opt.zero_grad(); loss.backward(); opt.step()
    torch.save([p.detach().cpu() for p in m.parameters()] + [loss.detach().cpu()], sys.argv[-2])
"""


def test_training_step_matches_plain_pytorch_bit_for_bit(tmp_path):
    for mode in ("plain", "vmalloc"):
        subprocess.run([sys.executable, "-c", textwrap.dedent(TRAIN), str(tmp_path / mode), mode],
                       check=True, env=python_env(), cwd=str(tmp_path), timeout=300)
    import torch
    a, b = torch.load(tmp_path / "plain"), torch.load(tmp_path / "vmalloc")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_env_var_enables_and_stats_shims_answer():
    out = run("""
        import vmalloc._autoload as a; a.install()
        import torch, vmalloc
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        assert vmalloc.is_enabled()
        assert torch.cuda.memory_allocated() == 3 << 20
        assert torch.cuda.memory_reserved() >= 4 << 20
        assert torch.cuda.max_memory_allocated() >= 3 << 20
        assert torch.cuda.memory_stats()["num_device_alloc"] >= 2
        del x
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 0
        print("OK")
    """, env={"VMALLOC": "1", "VMALLOC_CHUNK_SIZE": "2MiB"})
    assert "OK" in out


def test_side_stream_tensors_survive():
    out = run("""
        import torch, vmalloc
        vmalloc.enable()
        side = torch.cuda.Stream()
        for i in range(50):
            x = torch.full((1 << 20,), float(i), device="cuda")
            side.wait_stream(torch.cuda.current_stream())   # x is filled before side reads it
            with torch.cuda.stream(side):
                torch.cuda._sleep(200000)           # keep the side stream busy
                y = x * 2
            x.record_stream(side)
            del x                                   # freed while the side stream still reads it
            z = torch.full((1 << 20,), -1.0, device="cuda")   # must not reuse x's memory yet
            side.synchronize()
            assert torch.all(y == 2 * i), i
        print("OK")
    """)
    assert "OK" in out


def test_oom_past_budget_raises_torch_oom_and_training_continues():
    out = run("""
        import torch, vmalloc
        vmalloc.enable(budget="64MiB")
        keep = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            assert "vmalloc" in str(e)
        else:
            raise AssertionError("no OOM")
        del keep
        again = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.set_per_process_memory_fraction(0.5)
        assert vmalloc.stats()["budget"] > 64 << 20
        print("OK")
    """)
    assert "OK" in out


def test_snapshot_history_renders_with_memory_viz(tmp_path):
    out = run(f"""
        import torch, vmalloc, pickle
        vmalloc.enable()
        torch.cuda.memory._record_memory_history()
        a = torch.randn(1 << 20, device="cuda"); b = a * 2; del a
        torch.cuda.memory._dump_snapshot({str(tmp_path / 's.pickle')!r})
        from torch.cuda import _memory_viz
        snap = pickle.load(open({str(tmp_path / 's.pickle')!r}, "rb"))
        assert _memory_viz.trace_plot(snap)
        from vmalloc.replay import load
        assert len(load({str(tmp_path / 's.pickle')!r})) >= 3
        print("OK")
    """)
    assert "OK" in out


def test_cupy_and_torch_share_the_pool():
    pytest.importorskip("cupy")
    out = run("""
        import torch, cupy, vmalloc, vmalloc.cupy
        vmalloc.enable()
        vmalloc.cupy.enable()
        t = torch.ones(1 << 20, device="cuda")
        before = vmalloc.stats()["num_malloc"]
        c = cupy.ones(1 << 20, dtype=cupy.float32)
        assert vmalloc.stats()["num_malloc"] == before + 1
        assert float((torch.as_tensor(c, device="cuda") + t).sum()) == 2 * (1 << 20)
        del c
        print("OK")
    """)
    assert "OK" in out


def test_enable_after_cuda_init_says_why():
    out = run("""
        import torch, vmalloc
        torch.zeros(1, device="cuda")
        try:
            vmalloc.enable()
        except RuntimeError as e:
            assert "already initialised" in str(e) and "VMALLOC=1" in str(e)
            print("OK")
        with vmalloc.pool():                       # the scoped form still works
            x = torch.empty(8 << 20, device="cuda")
        print("POOL")
    """)
    assert "OK" in out and "POOL" in out


def test_pool_mode_oom_is_pytorchs_own_after_its_retry():
    """In pool mode vmalloc returns null past its budget (no throw, no pressure callback):
    PyTorch frees its cached segments, retries, then raises torch.OutOfMemoryError itself."""
    out = run("""
        import torch, vmalloc
        torch.zeros(1, device="cuda")
        with vmalloc.pool(budget="64MiB"):
            keep = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
            try:
                torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError:
                print("OOM")
            del keep
            again = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        print("OK")
    """)
    assert "OOM" in out and "OK" in out


def test_memory_api_with_vmalloc_on():
    """get_per_process_memory_fraction, torch.accelerator's memory functions, UntypedStorage on
    cuda, and cudnn.benchmark (kept off with a warning) with vmalloc as the allocator."""
    out = run("""
        import warnings, torch, vmalloc
        vmalloc.enable()
        torch.cuda.set_per_process_memory_fraction(0.5)
        assert abs(torch.cuda.get_per_process_memory_fraction() - 0.5) < 1e-3
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        n = vmalloc.stats()["num_malloc"]
        s = torch.UntypedStorage(8 << 20, device="cuda")
        assert vmalloc.stats()["num_malloc"] == n + 1, "UntypedStorage bypassed vmalloc"
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "memory_allocated"):
            assert torch.accelerator.memory_allocated() == torch.cuda.memory_allocated() > 0
            assert torch.accelerator.memory_stats()["allocated_bytes.all.current"] > 0
            del x, s
            torch.accelerator.empty_cache()
            assert vmalloc.stats()["cached_bytes"] == 0
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.backends.cudnn.benchmark = True
        assert torch.backends.cudnn.benchmark is False and w
        conv = torch.nn.Conv2d(3, 8, 3).cuda()
        conv(torch.randn(4, 3, 32, 32, device="cuda")).sum().backward()
        print("OK")
    """)
    assert "OK" in out
