"""The swap runtime on CUDA (``pytest -m gpu``; skipped where no CUDA device is present).

Unverified without a GPU: written from the PyTorch stream/event documentation."""
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from torch import nn

import scheduler
from scheduler.planners.swap_schedule import replay

from _subproc import python_env

# deterministic kernels (tests/conftest.py, which also fixes cuBLAS's workspace) for every test
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic_kernels")]


def _train_cuda(name, ctx=None, steps=3):
    """The CPU tests' loop (tests/test_swap_runtime.py, on sys.path under pytest) on CUDA."""
    from test_swap_runtime import MODELS, train
    build, batch = MODELS[name]
    return train(build, batch, ctx, steps=steps, device="cuda")


def _sequence_cuda(name):
    ctx = scheduler.swap(window="1GiB", device="cuda", min_bytes=0)
    _train_cuda(name, ctx, steps=1)
    return ctx.last_recorded


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("setting", ["smallest window", "budget", "wide window"])
def test_cuda_bit_identical(name, setting):
    # Windows and budgets come from the sequence recorded on this device, as in the CPU test:
    # fixed byte counts were below the largest saved tensor of the cnn and the transformer
    # (a window smaller than a tensor is refused with a ValueError).
    seq = _sequence_cuda(name)
    largest = seq.largest_tensor()[0]
    total = sum(seq.sizes[s[0]] for s in seq.steps)
    window, budget = {"smallest window": (largest, None),
                      "budget": (max(largest, total // 3), seq.min_budget()[0]),
                      "wide window": (total + 1, None)}[setting]
    ref = _train_cuda(name)
    ctx = scheduler.swap(window=window, budget=budget, device="cuda", min_bytes=0)
    got = _train_cuda(name, ctx)
    torch.cuda.synchronize()
    st = ctx.stats()
    differ = [f"loss {i}" for i, (a, b) in enumerate(zip(ref[0], got[0])) if not torch.equal(a, b)]
    differ += [f"step {i} grad {j}: max |diff| {(a - b).abs().max().item():.3e}"
               for i, (ga, gb) in enumerate(zip(ref[1], got[1]))
               for j, (a, b) in enumerate(zip(ga, gb)) if not torch.equal(a, b)]
    assert not differ, (f"{name}, window={window}, budget={budget}: "
                        + "; ".join(differ[:10]) + f"; runtime stats {st}")
    if budget is not None:
        e = ctx.last_entry
        assert st["last_iteration_peak_resident_bytes"] <= budget, (budget, st)
        simulated = replay(e.sequence, e.schedule).peak
        assert simulated <= budget, (simulated, budget)
    assert st["resident_bytes"] == 0 and st["host_in_use_bytes"] == 0, st


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_cuda_bit_identical_in_place(name):
    """A budget the step fits: from the fourth step the iterations are kept in place (saved
    tensors only counted); losses and gradients equal plain training's bit for bit, and the
    in-place peak equals the tracked one (a training step holds its saved tensors until its
    backward)."""
    ref = _train_cuda(name, steps=6)
    ctx = scheduler.swap(window="1GiB", budget="1GiB", device="cuda", min_bytes=0)
    peaks = []
    from test_swap_runtime import MODELS, train
    build, batch = MODELS[name]
    got = train(build, batch, ctx, steps=6, device="cuda",
                check=lambda i: peaks.append(ctx.stats()["last_iteration_peak_resident_bytes"]))
    torch.cuda.synchronize()
    st = ctx.stats()
    assert st["iterations_in_place"] == 3 and st["swapped_out_bytes"] == 0, st
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert all(torch.equal(a, b) for ga, gb in zip(ref[1], got[1]) for a, b in zip(ga, gb))
    assert peaks[3:] == [peaks[2]] * 3, peaks


def test_copies_overlap_compute():
    """Heavy matmuls between saved tensors: with a window of a few tensors the swap-ins are
    issued ahead of their use (none on demand), and swap-outs are never waited for (no budget:
    releases do not block). How many copies were still running at their use is not asserted:
    the host runs ahead of the device, so most events are incomplete when the unpack hook
    queries them even when the copy finishes long before the kernel that reads it (a timing
    figure; bench/ measures overlap)."""
    width, batch = 8192, 1024
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                            for _ in range(8)]).cuda()
    x = torch.randn(batch, width, device="cuda")
    ctx = scheduler.swap(window=4 * batch * width * 4, device="cuda")
    with ctx:
        for _ in range(4):
            model(x).square().mean().backward()
    torch.cuda.synchronize()
    st = ctx.stats()
    swap_ins = st["swapped_in_bytes"] // (batch * width * 4)
    assert st["swapped_out_bytes"] > 0 and swap_ins > 0, st
    assert st["on_demand_swap_ins"] == 0, st


def test_swap_runtime_bounds_the_peak_and_answers_vmalloc_pressure():
    """What shows the runtime worked, not only that nothing ran out of memory:

    A. vmalloc without a budget, the runtime with a 256 MiB saved-tensor budget: it swaps out
       at least what does not fit (1.5 GiB saved per step, 256 MiB kept), keeps its resident
       saved bytes within the budget, and vmalloc's requested peak is the fixed memory
       (parameters, gradients, input) + the saved-tensor budget + a margin for temporaries,
       cuBLAS workspaces and the window's swap-ins (384 MiB), far below plain training's peak.
    B. A vmalloc budget of the fixed memory + 512 MiB under a 1 GiB saved-tensor budget: the
       runtime's own budget would overrun vmalloc's, so training completes only through vmalloc's
       pressure callback (pressure calls > 0) and stays within vmalloc's budget."""
    pytest.importorskip("vmalloc._core")
    script = textwrap.dedent("""
        import faulthandler; faulthandler.dump_traceback_later(120, exit=True)  # a hang: stacks
        import torch, vmalloc, scheduler
        from vmalloc import torch_allocator as ta
        MiB = 1 << 20
        vmalloc.enable()
        from torch import nn
        # 24 x (Linear 2048x2048 + GELU): 384 MiB of parameters; a 4096 x 2048 batch saves
        # 48 tensors of 32 MiB (1.5 GiB) per step
        model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.GELU())
                                for _ in range(24)]).cuda()
        x = torch.randn(4096, 2048, device="cuda")
        alloc = ta.device_allocator(0, create=True)

        def step():
            model(x).square().mean().backward()

        step()                                   # plain: gradients exist from here on
        torch.cuda.synchronize()
        fixed = vmalloc.stats()["requested_current"]
        alloc.reset_peak()
        step()
        torch.cuda.synchronize()
        plain_peak = vmalloc.stats()["requested_peak"]
        assert plain_peak >= fixed + 1400 * MiB, (plain_peak, fixed)

        # A: the runtime's saved-tensor budget alone
        alloc.reset_peak()
        with scheduler.swap(window="128MiB", budget="256MiB") as ctx:
            for _ in range(3):
                step()
        torch.cuda.synchronize()
        st, s = ctx.stats(), vmalloc.stats()
        assert st["swapped_out_bytes"] >= 3 * (1536 - 256) * MiB, st
        assert st["last_iteration_peak_resident_bytes"] <= 256 * MiB, st
        assert s["requested_peak"] <= fixed + (256 + 384) * MiB, (s["requested_peak"], fixed)
        assert s["requested_peak"] <= plain_peak - 512 * MiB, (s["requested_peak"], plain_peak)
        print("A", fixed, plain_peak, s["requested_peak"], st["swapped_out_bytes"])

        # B: vmalloc's budget below what the runtime's budget allows: pressure calls do the rest
        torch.cuda.empty_cache()
        budget = (fixed + 512 * MiB) // (2 * MiB) * (2 * MiB)
        vmalloc._core._torch_set_budget(0, budget)
        alloc.reset_peak()
        with scheduler.swap(window="128MiB", budget="1GiB") as ctx:
            for _ in range(3):
                step()
        torch.cuda.synchronize()
        st, s = ctx.stats(), vmalloc.stats()
        assert st["pressure_calls"] > 0 and st["pressure_freed_bytes"] > 0, st
        assert s["num_pressure_calls"] >= st["pressure_calls"], (s, st)
        assert st["swapped_out_bytes"] > 0
        assert s["physical_peak"] <= budget, (s["physical_peak"], budget)
        print("B", budget, s["physical_peak"], st["pressure_calls"], st["pressure_freed_bytes"])
        print("ok")
    """)
    _run_vmalloc_script(script)


def _run_vmalloc_script(script: str, timeout: int = 135) -> None:
    """Run a vmalloc script in a fresh process (vmalloc is enabled before CUDA starts); it
    prints "ok" last. Bounded: a deadlock between the pressure callback (called inside vmalloc's
    malloc, from the autograd thread too) and the runtime's lock must fail the test, not hang
    the session."""
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              cwd=tempfile.gettempdir(), env=python_env(), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
               for x in (e.stdout, e.stderr)]
        pytest.fail(f"did not finish in {timeout} s (killed; a deadlock?)\n--- stdout ---\n"
                    f"{out[0][-2000:]}\n--- stderr ---\n{out[1][-4000:]}")
    assert proc.returncode == 0, (f"exit status {proc.returncode}\n--- stdout ---\n"
                                  f"{proc.stdout[-2000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")
    assert proc.stdout.rstrip().endswith("ok"), proc.stdout[-2000:]


def test_in_place_under_vmalloc_and_its_rescue():
    """Under vmalloc (its pressure callback) a step that fits is kept in place from the fourth
    on. Then a 768 MiB allocation in the middle of a forward finds vmalloc's budget full: the
    callback evicts the kept tensors only the graph holds to the host (``resize_(0)``), the
    allocation succeeds, the backward brings them back; gradients equal plain training's bit
    for bit and vmalloc's physical peak stays within its budget."""
    pytest.importorskip("vmalloc._core")
    script = textwrap.dedent("""
        import faulthandler; faulthandler.dump_traceback_later(100, exit=True)  # a hang: stacks
        import os; os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import torch, vmalloc, scheduler
        from vmalloc import torch_allocator as ta
        MiB = 1 << 20
        vmalloc.enable()
        from torch import nn
        torch.use_deterministic_algorithms(True)
        # 8 x (Linear 2048x2048 + GELU): 128 MiB of parameters; a 4096 x 2048 batch saves
        # 16 tensors of 32 MiB (512 MiB) per step
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.GELU())
                                for _ in range(8)]).cuda()
        xs = [torch.randn(4096, 2048, device="cuda") for _ in range(6)]
        squeeze = {"on": False}

        def hook(module, args, out):   # the allocation that finds the budget full
            if squeeze["on"]:
                squeeze["got"] = torch.empty(768 * MiB, dtype=torch.uint8, device="cuda")
                del squeeze["got"]
        model[6].register_forward_hook(hook)

        def run():
            grads = []
            for i, x in enumerate(xs):
                squeeze["on"] = ctx is not None and i == 4
                model(x).square().mean().backward()
                grads.append([p.grad.cpu() for p in model.parameters()])   # (not on the device)
                model.zero_grad(set_to_none=True)
            return grads

        ctx = None
        ref = run()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        fixed = vmalloc.stats()["requested_current"]
        # a step needs about 640 MiB over the fixed memory (512 saved, 128 of gradients); at
        # the hook about 450 are in use: 768 more do not fit without evicting about 200
        budget = (fixed + 1024 * MiB) // (2 * MiB) * (2 * MiB)
        vmalloc._core._torch_set_budget(0, budget)
        ta.device_allocator(0, create=True).reset_peak()
        with scheduler.swap(window="128MiB", budget="2GiB") as ctx:
            got = run()
        torch.cuda.synchronize()
        st, s = ctx.stats(), vmalloc.stats()
        assert st["iterations_in_place"] >= 1 and st["swapped_out_bytes"] == 0, st
        assert st["pressure_calls"] >= 1 and st["in_place_evicted_bytes"] > 0, st
        assert st["resident_bytes"] == 0, st
        assert s["physical_peak"] <= budget, (s["physical_peak"], budget)
        bad = [(i, j) for i, (a, b) in enumerate(zip(ref, got))
               for j, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
        assert not bad, bad
        print(budget, s["physical_peak"], st["in_place_evicted_bytes"])
        print("ok")
    """)
    _run_vmalloc_script(script)
