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
# Seconds per interpreter (each snippet takes seconds; the GPU session's whole pytest step has
# 420): a hang fails the test with the Python stacks of every thread (faulthandler, just before)
TIMEOUT = 120


def run(code, env=None, args=(), cwd=TMP):
    """Run ``code`` in a fresh interpreter (without the caller's VMALLOC* variables); its stdout.
    A non-zero exit, a signal (a crash at exit included) or a hang fails with all it printed."""
    full = python_env(base={k: v for k, v in os.environ.items() if not k.startswith("VMALLOC")},
                      **(env or {}))
    code = (f"import faulthandler; faulthandler.dump_traceback_later({TIMEOUT - 15}, exit=True)\n"
            + textwrap.dedent(code))
    cmd = [sys.executable, "-c", code, *args]
    try:
        r = subprocess.run(cmd, env=full, cwd=cwd, capture_output=True, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:   # its partial output comes as bytes on POSIX
        pytest.fail(f"the interpreter did not finish in {TIMEOUT} s (killed)\n"
                    f"--- stdout ---\n{_text(e.stdout)[-4000:]}\n"
                    f"--- stderr ---\n{_text(e.stderr)[-4000:]}")
    assert r.returncode == 0, (
        f"exit status {r.returncode}{exit_signal(r.returncode)}"
        f"{' after it printed OK (a crash at teardown)' if 'OK' in r.stdout else ''}\n"
        f"--- stdout ---\n{r.stdout[-4000:]}\n--- stderr ---\n{r.stderr[-6000:]}")
    return r.stdout


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def exit_signal(code: int) -> str:
    if code >= 0:
        return ""
    import signal
    try:
        return f" (killed by {signal.Signals(-code).name})"
    except ValueError:
        return f" (signal {-code})"


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
    if sys.argv[-1] == "vmalloc":   # else the comparison would be plain against plain
        n = vmalloc.stats()["num_malloc"]
        assert n > 0, f"vmalloc served no allocation: {vmalloc.stats()}"
"""


def test_training_step_matches_plain_pytorch_bit_for_bit(tmp_path):
    for mode in ("plain", "vmalloc"):
        run(TRAIN, args=(str(tmp_path / mode), mode), cwd=str(tmp_path))
    import torch
    a, b = torch.load(tmp_path / "plain"), torch.load(tmp_path / "vmalloc")
    names = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "linear.weight",
             "linear.bias", "loss"]   # what TRAIN saves: the parameters, then the last loss
    assert len(a) == len(b) == len(names), (len(a), len(b))
    differ = [f"{n}: max |diff| {(x.double() - y.double()).abs().max().item():.3e}"
              for n, x, y in zip(names, a, b) if not torch.equal(x, y)]
    assert not differ, "plain PyTorch and vmalloc trained differently: " + "; ".join(differ)


def test_torch_compile_default_mode_trains_on_vmalloc():
    """torch.compile's default mode (Inductor, no CUDA graphs) allocates through the current
    allocator like eager code: a tiny MLP, compiled, trains on vmalloc as eager does on it."""
    out = run("""
        import torch, vmalloc
        vmalloc.enable()
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 8)).cuda()
        c = torch.compile(m)
        x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")
        n = vmalloc.stats()["num_malloc"]
        for f in (m, c):
            m.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(f(x), y).backward()
            if f is m:
                want = [p.grad.clone() for p in m.parameters()]
        got = [p.grad for p in m.parameters()]
        diff = max((a - b).abs().max().item() for a, b in zip(want, got))
        assert diff < 1e-4, f"compiled gradients differ from eager by {diff:.3e}"
        assert vmalloc.stats()["num_malloc"] > n, vmalloc.stats()
        print("OK")
    """)
    assert "OK" in out, out


def test_env_var_enables_and_stats_shims_answer():
    out = run("""
        import vmalloc._autoload as a; a.install()
        import torch, vmalloc
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        assert vmalloc.is_enabled()
        s = torch.cuda.memory_stats()
        why = f"torch.cuda.memory_stats()={dict(s)} vmalloc.stats()={vmalloc.stats()}"
        assert torch.cuda.memory_allocated() == 3 << 20, why
        assert torch.cuda.memory_reserved() >= 4 << 20, why     # two 2 MiB chunks
        assert torch.cuda.max_memory_allocated() >= 3 << 20, why
        assert s["num_device_alloc"] >= 2, why                 # one map per chunk
        del x
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 0, vmalloc.stats()
        print("OK")
    """, env={"VMALLOC": "1", "VMALLOC_CHUNK_SIZE": "2MiB"})
    assert "OK" in out, out


def test_side_stream_tensors_survive():
    out = run("""
        import torch, vmalloc
        vmalloc.enable()
        side = torch.cuda.Stream()
        for i in range(50):
            x = torch.full((1 << 20,), float(i), device="cuda")
            side.wait_stream(torch.cuda.current_stream())   # x is filled before side reads it
            with torch.cuda.stream(side):
                # keep the side stream busy (~10 ms at H100 clocks) so that a wrongly reused
                # x would be overwritten by z's fill before y reads it (200k cycles, 0.1 ms,
                # left the host too little time to get there first)
                torch.cuda._sleep(20_000_000)
                y = x * 2
            x.record_stream(side)
            del x                                   # freed while the side stream still reads it
            z = torch.full((1 << 20,), -1.0, device="cuda")   # must not reuse x's memory yet
            side.synchronize()
            bad = int((y != 2 * i).sum())
            assert bad == 0, (f"iteration {i}: {bad} of {y.numel()} elements of y are wrong "
                              f"(e.g. {y[(y != 2 * i)][:4].tolist()}): x's memory was reused "
                              "while the side stream still read it (record_stream not honoured)")
        print("OK")
    """)
    assert "OK" in out, out


def test_oom_past_budget_raises_torch_oom_and_training_continues():
    out = run("""
        import torch, vmalloc
        vmalloc.enable(budget="64MiB")
        keep = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            assert "vmalloc" in str(e), str(e)
        except BaseException as e:   # the C++ exception type decides what Python sees
            raise AssertionError(
                f"expected torch.OutOfMemoryError, got {type(e).__module__}.{type(e).__name__}: "
                f"{e}; vmalloc raises {vmalloc._core._torch_oom_kind()!r} "
                f"(vtable route: {vmalloc._core._torch_oom_kind(2)!r})") from e
        else:
            raise AssertionError(f"no OOM past the 64 MiB budget: {vmalloc.stats()}")
        del keep
        again = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.set_per_process_memory_fraction(0.5)
        total = torch.cuda.get_device_properties(0).total_memory
        b = vmalloc.stats()["budget"]
        assert abs(b - total / 2) <= 0.01 * total, (b, total)   # the fraction took effect
        print("OK")
    """)
    assert "OK" in out, out


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
        events = load({str(tmp_path / 's.pickle')!r})
        # alloc a, alloc b, free a (at least: PyTorch may allocate more on its own)
        assert len(events) >= 3, (events, snap["device_traces"])
        print("OK")
    """)
    assert "OK" in out, out


def test_cupy_and_torch_share_the_pool():
    pytest.importorskip("cupy")
    out = run("""
        import torch, cupy, vmalloc, vmalloc.cupy
        vmalloc.enable()
        vmalloc.cupy.enable()
        t = torch.ones(1 << 20, device="cuda")
        before = vmalloc.stats()["num_malloc"]
        c = cupy.ones(1 << 20, dtype=cupy.float32)
        after = vmalloc.stats()["num_malloc"]
        assert after == before + 1, (f"cupy.ones made {after - before} vmalloc allocations "
                                     f"(expected 1; cupy {cupy.__version__})")
        total = float((torch.as_tensor(c, device="cuda") + t).sum())
        assert total == 2 * (1 << 20), total
        del c
        print("OK")
    """)
    assert "OK" in out, out


def test_enable_after_cuda_init_says_why():
    out = run("""
        import torch, vmalloc
        torch.zeros(1, device="cuda")
        try:
            vmalloc.enable()
        except RuntimeError as e:
            assert "already initialised" in str(e) and "VMALLOC=1" in str(e), str(e)
            print("OK")
        else:
            raise AssertionError("vmalloc.enable() after CUDA started did not raise")
        with vmalloc.pool():                       # the scoped form still works
            x = torch.empty(8 << 20, device="cuda")
        print("POOL")
        # x outlives the block: its segment goes back through the pool's allocator here (it
        # was destroyed with the block once: a use after free)
        del x
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        from vmalloc import torch_allocator as ta   # the registry's allocators (pool mode too)
        print("FREED", ta.device_allocator(0).stats()["requested_current"])
    """)
    assert "OK" in out and "POOL" in out and "FREED" in out, out


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
            else:
                raise AssertionError(f"no OOM past the pool's 64 MiB budget: "
                                     f"{vmalloc.torch_allocator.device_allocator(0).stats()}")
            del keep
            again = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        print("OK")
    """)
    assert "OOM" in out and "OK" in out, out


def test_memory_api_with_vmalloc_on():
    """get_per_process_memory_fraction, torch.accelerator's memory functions, UntypedStorage on
    cuda, caching_allocator_alloc/delete (PyTorch's pluggable allocator passes them to vmalloc's
    malloc and free), and cudnn.benchmark (cuDNN's autotuner asks vmalloc's cacheInfo: no warning, no OOM from
    the workspaces it tries) with vmalloc as the allocator."""
    out = run("""
        import warnings, torch, vmalloc
        vmalloc.enable()
        torch.cuda.set_per_process_memory_fraction(0.5)
        f = torch.cuda.get_per_process_memory_fraction()
        assert abs(f - 0.5) < 1e-3, (f, vmalloc.stats()["budget"])
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        n = vmalloc.stats()["num_malloc"]
        s = torch.UntypedStorage(8 << 20, device="cuda")
        m = vmalloc.stats()["num_malloc"]
        assert m == n + 1, f"UntypedStorage made {m - n} vmalloc allocations (expected 1)"
        raw = torch.cuda.caching_allocator_alloc(4 << 20)   # raw_alloc_with_stream -> malloc
        assert vmalloc.stats()["num_malloc"] == m + 1, vmalloc.stats()
        freed = vmalloc.stats()["num_free"]
        torch.cuda.caching_allocator_delete(raw)            # raw_delete -> free
        assert vmalloc.stats()["num_free"] == freed + 1, vmalloc.stats()
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "memory_allocated"):
            acc, cud = torch.accelerator.memory_allocated(), torch.cuda.memory_allocated()
            assert acc == cud > 0, (acc, cud)
            st = torch.accelerator.memory_stats()
            assert st.get("allocated_bytes.all.current", 0) > 0, dict(st)
            del x, s
            torch.accelerator.empty_cache()
            assert vmalloc.stats()["cached_bytes"] == 0, vmalloc.stats()
        from vmalloc.torch_allocator import registry
        assert registry().cache_info_missing == "", registry().cache_info_missing
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.backends.cudnn.benchmark = True
        assert torch.backends.cudnn.benchmark is True and not w, (
            torch.backends.cudnn.benchmark, [str(x.message) for x in w])
        from vmalloc import _core as core
        held = vmalloc.stats()["physical_current"]
        answer = core._torch_largest_block(0)      # what cacheInfo tells cuDNN: half the GPU less
        budget = vmalloc.stats()["budget"]         # what is held, give or take a chunk
        assert 0 < answer <= budget and answer >= budget - held - (64 << 20), (answer, budget, held)
        before = vmalloc.stats()
        torch.backends.cudnn.allow_tf32 = False    # float32 arithmetic: the 1e-3 check below
        conv = torch.nn.Conv2d(3, 64, 3, padding=1).cuda()
        x = torch.randn(32, 3, 64, 64, device="cuda", requires_grad=True)
        conv(x).sum().backward()                  # autotuned: cacheInfo answered, workspaces tried
        torch.cuda.synchronize()
        after = vmalloc.stats()
        for key in ("num_oom", "num_pressure_calls"):   # no workspace tried past the answer
            assert after[key] == before[key], (key, before[key], after[key])
        ref = torch.nn.functional.conv2d(x.detach().double(), conv.weight.double(),
                                         conv.bias.double(), padding=1)
        assert torch.allclose(conv(x).double(), ref, atol=1e-3), "autotuned conv is wrong"
        print("OK")
    """)
    assert "OK" in out, out
