"""The swap runtime on the CPU: a separate host pool stands in for the device, copies are
synchronous, and everything else is the real logic. Gradients and losses must be bit-identical
to plain training; the runtime's memory must be what the one accounting (replay) predicts."""
import contextlib
import importlib
import weakref

import pytest
import torch
from torch import nn

import scheduler
from scheduler.errors import InfeasibleError
from scheduler.plan import Plan
from scheduler.planners.offload_follow import chain_from_sequence, schedule_from_plan
from scheduler.planners import window as window_mod
from scheduler.planners.swap_schedule import SwapSchedule, replay
from scheduler.runtime import swap as swap_mod
from scheduler.runtime import swap_transfers

STEPS = 3


# ----------------------------------------------------------------------------- models
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


class Block(nn.Module):
    """A residual block: its input is read by the convolution and again by the skip add."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(Block(8), Block(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.blocks(torch.relu(self.stem(x)))
        skip = h  # a long skip: the blocks' output is used again at the end
        h = h * torch.sigmoid(h.mean(dim=(2, 3), keepdim=True)) + skip
        return self.head(h.mean(dim=(2, 3)))


class TinyTransformer(nn.Module):
    def __init__(self, d: int = 32, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, dropout=0.1,
                                       batch_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 50)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class Product(nn.Module):
    """Two branches multiplied: the product's backward node reads both saved operands at once."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)) * torch.sin(self.b(x)))


def batch_mlp(i, n=16):
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def batch_cnn(i, n=4):
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def batch_tokens(i, n=2, t=12):
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 50, (n, t), generator=g)
    return x, torch.randint(0, 50, (n, t), generator=g)


MODELS = {"mlp": (mlp, batch_mlp), "cnn": (SmallCNN, batch_cnn),
          "transformer": (TinyTransformer, batch_tokens), "product": (Product, batch_mlp)}


def train(build, batch, ctx=None, steps=STEPS, sizes=None, check=None, device="cpu"):
    """Losses and gradients of ``steps`` SGD steps (with momentum), inside ``ctx`` if given,
    on ``device`` (the GPU tests run the same loop on "cuda")."""
    torch.manual_seed(0)
    model = build().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], []

    def loop():
        for i in range(steps):
            x, y = (t.to(device) for t in (batch(i) if sizes is None else batch(i, sizes[i])))
            torch.manual_seed(1000 + i)  # dropout masks
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            if check is not None:
                check(i)

    if ctx is None:
        loop()
    else:
        with ctx:
            loop()
    return losses, grads


def assert_bit_identical(a, b):
    assert len(a[0]) == len(b[0])
    for la, lb in zip(a[0], b[0]):
        assert torch.equal(la, lb)
    for ga, gb in zip(a[1], b[1]):
        for x, y in zip(ga, gb):
            assert torch.equal(x, y)


def assert_nothing_left(ctx):
    # no gc.collect(): handles must die by reference counting alone (no cycles through them)
    s = ctx.stats()
    assert s["resident_bytes"] == 0 and s["live_variables"] == 0
    assert s["host_in_use_bytes"] == 0 and s["host_cached_bytes"] == 0


REFERENCE = {}


def reference(name):
    if name not in REFERENCE:
        REFERENCE[name] = train(*MODELS[name])
    return REFERENCE[name]


def sequence_of(name, min_bytes=0):
    ctx = scheduler.swap(window="1GiB", device="cpu", min_bytes=min_bytes)
    train(*MODELS[name], ctx=ctx, steps=1)
    return ctx.last_recorded


# ------------------------------------------------------------------ bit-identical training
@pytest.mark.parametrize("name", sorted(MODELS))
def test_bit_identical_for_many_windows_and_budgets(name):
    seq = sequence_of(name)
    largest = seq.largest_tensor()[0]
    need = seq.min_budget()[0]
    plain = replay(seq, SwapSchedule.empty(len(seq))).peak
    total = sum(seq.sizes[s[0]] for s in seq.steps)
    windows = sorted({largest, max(largest, total // 3), total + 1})
    budgets = [None, need, (need + plain) // 2]
    swapped = 0
    for w in windows:
        for budget in budgets:
            ctx = scheduler.swap(window=w, budget=budget, device="cpu", min_bytes=0)
            peaks = []

            def check(i, ctx=ctx, peaks=peaks):
                if i >= 1:  # following the schedule: memory is exactly what replay says
                    e = ctx.last_entry
                    peaks.append((ctx.stats()["last_iteration_peak_resident_bytes"],
                                  replay(e.sequence, e.schedule).peak))

            got = train(*MODELS[name], ctx=ctx, check=check)
            assert_bit_identical(got, reference(name))
            st = ctx.stats()
            for actual, predicted in peaks:
                assert actual == predicted
                if budget is not None:
                    assert actual <= budget
            if budget is not None:
                assert st["peak_resident_bytes"] <= budget  # the recording iteration too
            assert st["plans_computed"] == 1 and st["plan_cache_hits"] == STEPS - 1
            assert st["plan_mismatches"] == 0
            swapped += st["swapped_out_bytes"]
            assert_nothing_left(ctx)
    assert swapped > 0


def test_mlp_over_a_wide_sweep_of_windows():
    seq = sequence_of("mlp")
    largest, total = seq.largest_tensor()[0], seq.total_bytes()
    for w in sorted({largest + k * (total - largest) // 7 for k in range(8)}):
        ctx = scheduler.swap(window=w, device="cpu", min_bytes=0)
        assert_bit_identical(train(*MODELS["mlp"], ctx=ctx), reference("mlp"))
        assert ctx.stats()["on_demand_swap_ins"] == 0
        assert_nothing_left(ctx)


def test_small_window_swaps_and_still_matches():
    ctx = scheduler.swap(window=4096, device="cpu", min_bytes=0)
    got = train(*MODELS["mlp"], ctx=ctx)
    assert_bit_identical(got, reference("mlp"))
    st = ctx.stats()
    assert st["swapped_out_bytes"] > 0 and st["swapped_in_bytes"] > 0
    assert st["on_demand_swap_ins"] == 0  # every swap-in came ahead of its use
    assert st["last_iteration_peak_resident_bytes"] < replay(
        ctx.last_entry.sequence, SwapSchedule.empty(len(ctx.last_entry.sequence))).peak


@pytest.mark.parametrize("planner", ["lms", "custom-plan"])
def test_other_planners_match_plain_training(planner):
    if planner == "lms":
        ctx = scheduler.swap(planner="lms", device="cpu", min_bytes=0,
                             planner_options={"swapout_threshold": 2, "swapin_ahead": 1})
    else:
        def follow(seq):
            # a hand-written offload plan (what offload.greedy returns): offload the first
            # half of the stages after their forward, prefetch each before its backward
            chain, stage_vars = chain_from_sequence(seq)
            half = chain.L // 2
            ops = []
            for s in range(chain.L + 1):
                ops.append(("F_all", s))
                if s < half:
                    ops.append(("offload", s))
            for s in range(chain.L, -1, -1):
                if s < half:
                    ops.append(("prefetch", s))
                ops.append(("B", s))
            return schedule_from_plan(seq, Plan(ops=ops, planner="hand"), stage_vars)
        ctx = scheduler.swap(planner=follow, device="cpu", min_bytes=0)
    got = train(*MODELS["cnn"], ctx=ctx)
    assert_bit_identical(got, reference("cnn"))
    st = ctx.stats()
    assert st["swapped_out_bytes"] > 0 and st["on_demand_swap_ins"] == 0
    assert_nothing_left(ctx)


def test_offload_planners_need_a_budget_and_the_module():
    with pytest.raises(ValueError, match="needs a budget"):
        scheduler.swap(planner="dynprog", device="cpu")
    try:
        importlib.import_module("scheduler.planners.offload")
    except ImportError:
        with pytest.raises(ValueError, match="scheduler.planners.offload"):
            scheduler.swap(planner="greedy", budget="1MiB", device="cpu")


@pytest.mark.parametrize("planner", ["greedy", "dynprog"])
def test_following_offload_planners_on_the_measured_chain(planner):
    try:
        importlib.import_module("scheduler.planners.offload")
    except ImportError:
        pytest.skip("scheduler.planners.offload (issue 5) not on this branch")
    seq = sequence_of("cnn")
    plain = replay(seq, SwapSchedule.empty(len(seq))).peak
    for frac in (0.9, 0.6):
        budget = int(plain * frac)
        ctx = scheduler.swap(planner=planner, budget=budget, device="cpu", min_bytes=0,
                             planner_options={"bandwidth": 1e9, **(
                                 {"slots": 100} if planner == "dynprog" else {})})
        assert_bit_identical(train(*MODELS["cnn"], ctx=ctx), reference("cnn"))
        st = ctx.stats()
        assert st["swapped_out_bytes"] > 0
        # the chain is an approximation of the DAG: where its plan would pass the budget on the
        # true sequence, the runtime keeps the budget by evicting (synchronously)
        assert st["peak_resident_bytes"] <= budget
        assert planner in ctx.last_entry.schedule.planner  # e.g. "offload.greedy"
        assert_nothing_left(ctx)


# ------------------------------------------------------------------------ plan cache
def test_dynamic_shapes_hit_the_plan_cache():
    sizes = [8, 16, 8, 16, 12, 8, 12]
    ref = train(mlp, batch_mlp, steps=len(sizes), sizes=sizes)
    ctx = scheduler.swap(window=8192, budget=16384, device="cpu", min_bytes=0)
    got = train(mlp, batch_mlp, ctx=ctx, steps=len(sizes), sizes=sizes)
    assert_bit_identical(got, ref)
    st = ctx.stats()
    assert st["plans_computed"] == 3 and st["plan_cache_hits"] == 4  # one plan per shape
    assert st["plan_switches"] >= 3  # a known shape found its own schedule at the first step
    assert st["peak_resident_bytes"] <= 16384
    assert_nothing_left(ctx)


# -------------------------------------------------------------------------- leaks
def test_nothing_leaks_when_the_graph_outlives_the_context():
    model = mlp()
    ctx = scheduler.swap(window=4096, device="cpu", min_bytes=0)
    with ctx:
        for i in range(2):  # the second iteration follows the schedule
            loss = model(batch_mlp(i)[0]).sum()
            loss.backward()
        loss = model(batch_mlp(2)[0]).sum()
    assert ctx.stats()["live_variables"] > 0  # the graph is still alive after exit
    loss.backward()
    del loss
    assert_nothing_left(ctx)


def test_retain_graph_and_a_second_backward():
    model = mlp()
    x = batch_mlp(0)[0]
    torch.manual_seed(0)
    ref_model = mlp()
    ref_model.load_state_dict(model.state_dict())
    ref_loss = ref_model(x).sum()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    ctx = scheduler.swap(window=4096, device="cpu", min_bytes=0)
    with ctx:
        for _ in range(2):
            model.zero_grad()
            loss = model(x).sum()
            loss.backward(retain_graph=True)
            loss.backward()  # reads tensors the first backward already swapped around
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, q.grad)
    del loss
    assert_nothing_left(ctx)


def test_forward_without_backward_starts_a_new_iteration():
    model = mlp()
    ctx = scheduler.swap(window=4096, device="cpu", min_bytes=0)
    with ctx:
        for i in range(3):
            model(batch_mlp(i)[0]).sum()  # graph dropped at once
        loss = model(batch_mlp(0)[0]).sum()
        loss.backward()
        del loss
    assert ctx.stats()["iterations"] >= 3
    assert_nothing_left(ctx)


def test_parameters_and_small_tensors_are_left_alone():
    model = nn.Linear(256, 256)
    ctx = scheduler.swap(window="1MiB", device="cpu")  # default min_bytes=1024
    with ctx:
        x = torch.randn(4, 256)
        (model(x).relu() * torch.ones(1)).sum().backward()
    seq = ctx.last_recorded
    # saved: x (4 KiB) and the relu output (4 KiB); the weight and the 4-byte scalar are not
    assert sorted(seq.sizes) == [4096, 4096]


def test_frozen_weights_are_left_alone_too():
    # F.linear saves weight.t(): a view of the Parameter, which the module holds whether or not
    # it trains; a frozen one must not be moved (it would free nothing and come back as a
    # second copy), as a training one is not
    seen = {}
    for frozen in (False, True):
        model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
        model[0].requires_grad_(not frozen)
        ctx = scheduler.swap(window="1MiB", device="cpu")
        with ctx:
            x = torch.randn(4, 256, requires_grad=True)
            model(x).square().sum().backward()
        seen[frozen] = sorted(ctx.last_recorded.sizes)
    assert seen[True] == seen[False]
    assert 256 * 256 * 4 not in seen[True]


def _held_input_step(ctx, x, change=None):
    """A chain of Linear+Tanh on an input the caller holds all step (its loop's batch)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    with ctx:
        loss = model(x).square().mean()
        if change is not None:
            change(x)
        loss.backward()
    return [p.grad for p in model.parameters()]


def test_a_storage_the_program_still_holds_comes_back_without_a_copy():
    """Swapping out the batch the loop holds freed nothing: swapped back in it is the
    program's own storage again (a copy would be a second one on the device)."""
    x = torch.randn(64, 64)
    want = _held_input_step(contextlib.nullcontext(), x)
    ctx = scheduler.swap(window=16384, budget=16384, device="cpu", min_bytes=0)
    got = _held_input_step(ctx, x)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    s = ctx.stats()
    assert s["reattached_bytes"] == x.nbytes and s["swapped_out_bytes"] > x.nbytes
    assert_nothing_left(ctx)


def test_a_held_storage_changed_through_data_reads_as_plain_autograd_does():
    """A change through ``.data`` moves no version counter: plain autograd reads the new bytes,
    and so does the re-attached storage (a host copy would give the old ones)."""
    def bump(x):
        x.data.mul_(2)
    x = torch.randn(64, 64)
    want = _held_input_step(contextlib.nullcontext(), x.clone(), bump)
    ctx = scheduler.swap(window=16384, budget=16384, device="cpu", min_bytes=0)
    got = _held_input_step(ctx, x.clone(), bump)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert not all(torch.equal(a, b) for a, b in zip(want, _held_input_step(
        contextlib.nullcontext(), x.clone())))  # (the change does change the gradients)
    assert ctx.stats()["reattached_bytes"] == x.nbytes


def test_a_held_storage_changed_in_place_still_raises():
    def bump(x):
        x.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _held_input_step(contextlib.nullcontext(), torch.randn(64, 64), bump)
    ctx = scheduler.swap(window=16384, budget=16384, device="cpu", min_bytes=0)
    with pytest.raises(RuntimeError, match="in ?place"):
        _held_input_step(ctx, torch.randn(64, 64), bump)
    assert ctx.stats()["reattached_bytes"] == 64 * 64 * 4


# ------------------------------------------------------------------------- errors
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_one_byte_window_warns_once_and_trains_bit_identically(name):
    # the window is a look-ahead, not a cap: smaller than every tensor, it still admits each
    # step's next use (issue 13 item 2)
    ctx = scheduler.swap(window=1, device="cpu", min_bytes=0)
    with pytest.warns(window_mod.WindowWarning) as caught:
        got = train(*MODELS[name], ctx=ctx)
    assert_bit_identical(got, reference(name))
    msgs = [str(w.message) for w in caught if issubclass(w.category, window_mod.WindowWarning)]
    largest = ctx.last_recorded.largest_tensor()[0]
    assert len(msgs) == 1
    assert "window=1 bytes" in msgs[0] and f"saved tensor of {largest} bytes" in msgs[0]
    assert ctx.stats()["swapped_out_bytes"] > 0
    assert_nothing_left(ctx)


def test_a_window_below_a_tensor_with_a_budget_still_keeps_the_budget():
    seq = sequence_of("cnn")
    need = seq.min_budget()[0]
    ctx = scheduler.swap(window=1, budget=need, device="cpu", min_bytes=0)
    with pytest.warns(window_mod.WindowWarning):
        got = train(*MODELS["cnn"], ctx=ctx)
    assert_bit_identical(got, reference("cnn"))
    assert ctx.stats()["peak_resident_bytes"] <= need
    assert_nothing_left(ctx)


def test_budget_below_one_step_says_the_numbers():
    with scheduler.swap(window="1MiB", budget=1500, device="cpu", min_bytes=0):
        with pytest.raises(InfeasibleError, match=r"budget=1500 bytes .* below what one step "
                                                  r"needs: a saved tensor of 2048 bytes") as e:
            nn.Linear(32, 32)(torch.randn(16, 32)).relu()
    assert e.value.min_memory == 2048


def test_the_tensors_one_node_reads_are_one_step_and_stay_until_it_runs(monkeypatch):
    # only the 16x64 activations (4 KiB) are managed: nothing the program still holds
    seq = sequence_of("product", min_bytes=4096)
    need, step = seq.min_budget()
    assert seq.phases[step] == "B" and len(seq.steps[step]) == 2 and need == 2 * 4096
    released_while_held = []
    drop = swap_transfers.SwapTransfers._drop_device

    def checked_drop(self, var):  # a device copy let go during the backward must be freed
        storage = var.storage
        ref = weakref.ref(storage) if storage is not None else None
        del storage
        drop(self, var)
        if ref is not None and ref() is not None and torch._C._current_graph_task_id() != -1:
            released_while_held.append(var.vid)
    monkeypatch.setattr(swap_transfers.SwapTransfers, "_drop_device", checked_drop)
    ctx = scheduler.swap(window="1MiB", budget=need, device="cpu", min_bytes=4096)
    assert_bit_identical(train(*MODELS["product"], ctx=ctx), reference("product"))
    st = ctx.stats()
    assert st["swapped_out_bytes"] > 0 and st["peak_resident_bytes"] <= need
    assert released_while_held == []
    assert_nothing_left(ctx)


@pytest.mark.parametrize("planner", ["window", "lms"])
def test_a_budget_below_what_one_node_reads_says_the_numbers(planner):
    ctx = scheduler.swap(window="1MiB", budget=4096, planner=planner, device="cpu",
                         min_bytes=4096)
    with pytest.raises(InfeasibleError, match=r"budget=4096 bytes is below what one step needs: "
                                              r"step \d+ \(backward\) uses 8192 bytes") as e:
        train(*MODELS["product"], ctx=ctx, steps=1)
    assert e.value.min_memory == 8192
    assert_nothing_left(ctx)


@pytest.mark.parametrize("kwargs, match", [
    (dict(window="2 lots"), "window"), (dict(window=-1), "window"),
    (dict(budget="-3"), "budget"), (dict(planner="magic"), "planner"),
    (dict(device="meta"), "device"), (dict(min_bytes=-1), "min_bytes"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scheduler.swap(**kwargs)


# ------------------------------------------------------------------- pressure callback
class FakeAllocator:
    """Stands in for vmalloc.Allocator (issue 2): a budget over the runtime's resident bytes
    plus what the model itself holds; asks the pressure callback before failing."""

    def __init__(self):
        self.callback = None
        self.calls = []

    def set_pressure_callback(self, fn):
        self.callback = fn

    def malloc(self, needed, ctx):
        before = ctx.stats()["resident_bytes"]
        freed = self.callback(needed)
        self.calls.append((needed, before, ctx.stats()["resident_bytes"], freed))
        return freed


def test_pressure_callback_swaps_out_early_and_gradients_still_match():
    fake = FakeAllocator()
    ctx = scheduler.swap(window="1GiB", device="cpu", min_bytes=0, allocator=fake)
    model = mlp()
    torch.manual_seed(0)
    ref_model = mlp()
    ref_model.load_state_dict(model.state_dict())
    x = batch_mlp(0)[0]
    ref_model(x).square().mean().backward()

    # the allocator runs short in the middle of the forward: ask for room (at most the ReLU's
    # output can go: the batch and the Tanh's output, which the Linear reads, are held outside)
    def squeeze(module, args, out):
        fake.malloc(4000, ctx)
    model[4].register_forward_hook(squeeze)
    with ctx:
        assert fake.callback is not None
        model(x).square().mean().backward()
    assert fake.callback is None  # unregistered on exit
    needed, before, after, freed = fake.calls[0]
    assert freed and before - after >= needed
    st = ctx.stats()
    assert st["pressure_calls"] == 1 and st["pressure_freed_bytes"] >= 4000
    assert st["on_demand_swap_ins"] > 0  # evicted tensors came back when the backward read them
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert_nothing_left(ctx)


def test_pressure_never_counts_a_saved_tensor_the_program_holds():
    """Releasing a saved tensor the program holds too (its batch: the oldest saved tensor)
    frees no device memory. The pressure callback neither copies it out nor counts it: it once
    returned True for it, and vmalloc retried in vain and failed naming its budget (seen on an
    H100). Tensors only the graph holds are evicted instead, oldest first."""
    fake = FakeAllocator()
    ctx = scheduler.swap(window="1GiB", device="cpu", min_bytes=0, allocator=fake)
    model = mlp()
    x = batch_mlp(0)[0]                 # held here; the first Linear saves it
    out_bytes = []

    def squeeze(module, args, out):
        before = ctx.stats()["swapped_out_bytes"]
        fake.malloc(1, ctx)
        out_bytes.append(ctx.stats()["swapped_out_bytes"] - before)
    model[0].register_forward_hook(squeeze)   # x is the only saved tensor yet
    model[4].register_forward_hook(squeeze)   # the ReLU's and Tanh's outputs are only saved
    with ctx:
        model(x).square().mean().backward()
    (_, _, _, first), (_, before, after, second) = fake.calls
    assert first is False and out_bytes[0] == 0, (fake.calls, out_bytes)
    assert second is True and out_bytes[1] > 0 and after < before, (fake.calls, out_bytes)
    assert out_bytes[1] != x.untyped_storage().nbytes()
    assert ctx.stats()["pressure_freed_bytes"] == out_bytes[1]
    assert_nothing_left(ctx)


def test_pressure_with_nothing_to_give_returns_false():
    fake = FakeAllocator()
    ctx = scheduler.swap(device="cpu", allocator=fake)
    with ctx:
        assert fake.callback(1 << 20) is False


# ------------------------------------------------------------------- global install
def test_install_global_turns_swapping_on_until_uninstalled():
    assert swap_mod.global_context() is None
    ctx = swap_mod.install_global("4KiB", budget=None)
    try:
        assert swap_mod.install_global(4096) is ctx  # same settings: the installed one
        with pytest.raises(RuntimeError, match="already on"):
            swap_mod.install_global("8KiB")
        ctx.min_bytes = 0
        model = mlp()
        for i in range(2):
            model(batch_mlp(i)[0]).sum().backward()
        assert ctx.stats()["iterations"] == 2 and ctx.stats()["swapped_out_bytes"] > 0
    finally:
        assert swap_mod.uninstall_global() is ctx
    assert swap_mod.global_context() is None
    assert_nothing_left(ctx)
    # the report keeps the run's figures, frozen (distributed.shutdown() uninstalls before the
    # exit report is written): the section holds a copy, not the context
    from vmalloc.pluggable import live_report
    try:
        (provider,) = [p for name, p in live_report.REGISTRY.section_providers(None).items()
                       if name == "swap"]
        assert provider() == ctx.stats()
        assert getattr(provider, "__self__", None) is not ctx
    finally:
        live_report.remove_section("swap")


def test_an_enabled_vmalloc_without_its_allocator_is_an_error(monkeypatch):
    """On a GPU with vmalloc enabled the runtime hooks vmalloc's pressure callback; if the
    allocator cannot be had, that is said at once, not hidden (a budget's OOM would follow)."""
    import vmalloc
    from vmalloc import torch_allocator

    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(vmalloc, "is_enabled", lambda: False)
    assert swap_mod._find_vmalloc_allocator(cuda0) is None
    monkeypatch.setattr(vmalloc, "is_enabled", lambda: True)
    calls = []
    monkeypatch.setattr(torch_allocator, "device_allocator",
                        lambda d, create=False: calls.append((d, create)) or "allocator")
    assert swap_mod._find_vmalloc_allocator(cuda0) == "allocator" and calls == [(0, True)]

    def broken(d, create=False):
        raise RuntimeError("vmalloc is not enabled")
    monkeypatch.setattr(torch_allocator, "device_allocator", broken)
    with pytest.raises(RuntimeError, match="not enabled"):
        swap_mod._find_vmalloc_allocator(cuda0)


def test_a_saved_tensor_read_outside_the_backward():
    """``grad_fn._saved_self`` (torchviz shows saved tensors so) is read outside any backward:
    it is the tensor, and it is not taken for the start of the iteration's backward."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)

    def step(peek):
        x = torch.randn(64, 64) @ w
        y = x.sin()
        z = (y * 3).exp()
        if peek:
            assert torch.equal(y.grad_fn._saved_self, x)
        z.sum().backward()

    with scheduler.swap(window="1KiB", device="cpu", min_bytes=0) as s:
        for i in range(4):
            step(peek=i in (1, 2))
    stats = s.stats()
    assert stats["iterations"] == 4 and stats["plan_mismatches"] == 0
    assert stats["swapped_out_bytes"] > 0


def test_host_pool_caches_at_most_twice_its_peak():
    """A new input shape every step: buffers of past sizes do not pile up (pinned on a GPU)."""
    from scheduler.runtime.host_pool import CACHE_FACTOR, HostPool
    pool = HostPool(pin_memory=False)
    for n in range(1000, 1200):  # every step a new size, two buffers at once
        a, b = pool.acquire(n), pool.acquire(2 * n)
        pool.release(a)
        pool.release(b)
        assert pool.cached_bytes <= CACHE_FACTOR * pool.peak_in_use_bytes
    assert pool.stats()["host_buffers_evicted"] > 0
    again = pool.acquire(2 * 1199)  # the newest sizes are still there
    assert pool.stats()["host_buffers_reused"] >= 1
    pool.release(again)
