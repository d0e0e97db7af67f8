"""Ctrl-C under ``scheduler.swap`` (issue 16 item 6): the interrupt stops training wherever it
lands, and nothing is left behind (host buffers, live variables, resident bytes). Faults are
injected deterministically: no signals from timers, no sleeps."""
import _thread
import operator
import warnings
import weakref

import pytest
import torch

import scheduler
from scheduler.runtime import swap_transfers
from scheduler.runtime.swap_vars import Handle, HandleRef
from test_swap_runtime import (MODELS, assert_bit_identical, assert_nothing_left, reference,
                               sequence_of, train)


def interrupt_at(monkeypatch, n, direction):
    """Make the ``n``-th swap copy of ``direction`` ("out": device-to-host, "in") raise."""
    calls = {"out": 0, "in": 0}
    real = swap_transfers.copy_bytes

    def copy(dst, src, non_blocking):
        d = "in" if id(src) in copy.hosts else "out"  # a swap-in reads a host buffer
        if d == "out":
            copy.hosts.add(id(dst))
        calls[d] += 1
        if d == direction and calls[d] == n:
            raise KeyboardInterrupt(f"injected at {direction} copy {n}")
        real(dst, src, non_blocking)

    copy.hosts = set()
    monkeypatch.setattr(swap_transfers, "copy_bytes", copy)
    return calls


@pytest.mark.parametrize("direction, n", [("out", 1), ("out", 5), ("out", 12), ("in", 1),
                                          ("in", 4)])
def test_an_interrupted_copy_stops_training_and_leaves_nothing(monkeypatch, direction, n):
    ctx = scheduler.swap(window=1, device="cpu", min_bytes=0)
    calls = interrupt_at(monkeypatch, n, direction)
    stopped_at = []
    with pytest.warns(UserWarning):
        try:
            train(*MODELS["cnn"], ctx=ctx, check=stopped_at.append)
        except KeyboardInterrupt as exc:
            assert f"{direction} copy {n}" in str(exc)
        else:
            pytest.fail(f"the interrupt was lost ({calls})")
    assert len(stopped_at) < 3  # training did not go on
    # the exception (and the graph its frames held) is gone: every buffer is back
    assert_nothing_left(ctx)
    # the context is usable again, and still bit-identical
    monkeypatch.undo()
    got = train(*MODELS["cnn"], ctx=ctx)
    assert_bit_identical(got, reference("cnn"))
    assert_nothing_left(ctx)


def test_exit_with_the_graph_still_alive_returns_every_buffer(monkeypatch):
    ctx = scheduler.swap(window=1, device="cpu", min_bytes=0)
    interrupt_at(monkeypatch, 3, "out")
    build, batch = MODELS["mlp"]
    model = build()
    with pytest.warns(UserWarning):
        try:
            with ctx:
                model(batch(0)[0]).sum().backward()  # records
                model(batch(1)[0]).sum()             # follows the plan: swap-out 3 raises
        except KeyboardInterrupt:
            # the traceback still holds the partial graph; the pool has every buffer back
            # (the interrupted copy's too): the graph's host copies belong to its handles
            st = ctx.stats()
            assert st["live_variables"] > 0 and st["host_in_use_bytes"] == 0
            assert any(v.host_copy() is not None for v in ctx._live)
        else:
            pytest.fail("the interrupt was lost")
    assert_nothing_left(ctx)


@pytest.mark.parametrize("then", ["backward", "drop"])
def test_a_graph_that_outlives_the_context_frees_its_host_copies_as_it_dies(then):
    build, batch = MODELS["mlp"]
    torch.manual_seed(0)
    model, ref = build(), build()
    ref.load_state_dict(model.state_dict())
    ctx = scheduler.swap(window=1, device="cpu", min_bytes=0)
    with pytest.warns(UserWarning):
        with ctx:
            model(batch(0)[0]).sum().backward()  # records
            model.zero_grad()
            loss = model(batch(1)[0]).sum()      # follows the plan: tensors swapped out
    assert ctx.stats()["host_in_use_bytes"] == 0
    copies = [weakref.ref(v.host_copy()) for v in ctx._live if v.host_copy() is not None]
    assert copies
    if then == "backward":  # the graph still trains right: its tensors come back from the host
        before = ctx.stats()["swapped_in_bytes"]
        loss.backward()
        assert ctx.stats()["swapped_in_bytes"] > before
        ref(batch(1)[0]).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    del loss
    # its host copies died with its handles, before any drain (no stats() call)
    assert all(r() is None for r in copies)
    assert_nothing_left(ctx)


def test_handle_deaths_run_no_python_code():
    # a KeyboardInterrupt lands on the next Python code that runs; in a destructor it would be
    # printed as "Exception ignored" and lost. Handles have no __del__ and their death
    # callbacks are C functions.
    assert not hasattr(Handle, "__del__")
    ctx = scheduler.swap(window=1, device="cpu", min_bytes=0)
    build, batch = MODELS["mlp"]
    with ctx:
        loss = build()(batch(0)[0]).sum()
    refs = [r for v in ctx._live for r in v.handles]
    assert refs and all(isinstance(r, HandleRef) for r in refs)
    assert all(type(r.__callback__).__name__ == "builtin_function_or_method" for r in refs)
    del loss, refs
    assert_nothing_left(ctx)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_an_interrupt_pending_while_the_graph_dies_is_raised_not_swallowed(name):
    # Ctrl-C arrives (interrupt_main sets the pending signal) and, before any Python bytecode
    # runs, the graph is dropped: the handles die. Both calls are made from C (map), so the
    # first Python code to run is whatever the deaths run; the interrupt must reach us here.
    build, batch = MODELS[name]
    model = build()
    ctx = scheduler.swap(window=1, device="cpu", min_bytes=0)
    with pytest.warns(UserWarning):
        with ctx:
            for i in range(2):
                x = batch(i)[0]
                out = model(x)
                graph = [out.float().sum()]
                del out
                if i == 0:
                    graph[0].backward()
                    continue
                with pytest.raises(KeyboardInterrupt):
                    list(map(operator.call, [_thread.interrupt_main, graph.clear]))
                    for _ in range(100):  # any bytecode would have raised it by now
                        pass
    assert_nothing_left(ctx)


@pytest.mark.parametrize("where", ["end of backward", "pack", "unpack", "freeing"])
def test_an_interrupt_in_a_hook_stops_training(monkeypatch, where):
    from scheduler.runtime import swap_sequence
    ctx = scheduler.swap(window="1MiB" if where != "freeing" else 1, device="cpu", min_bytes=0)
    target, name = {"end of backward": (swap_sequence.SwapSequence, "end_iteration"),
                    "pack": (swap_sequence.SwapSequence, "step_begin"),
                    "unpack": (swap_sequence.SwapSequence, "step_end"),
                    # the bookkeeping of a dead handle, half done: the exit's sweep redoes it
                    "freeing": (swap_transfers.SwapTransfers, "forget")}[where]
    real = getattr(target, name)
    calls = []

    def hit(self, *args):
        calls.append(1)
        if len(calls) == {"end of backward": 2, "pack": 7, "unpack": 12, "freeing": 9}[where]:
            raise KeyboardInterrupt(where)
        return real(self, *args)

    monkeypatch.setattr(target, name, hit)
    stopped_at = []
    with pytest.raises(KeyboardInterrupt, match=where), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(*MODELS["mlp"], ctx=ctx, check=stopped_at.append)
    assert len(stopped_at) < 3
    monkeypatch.undo()
    assert_nothing_left(ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_bit_identical(train(*MODELS["mlp"], ctx=ctx), reference("mlp"))
    assert_nothing_left(ctx)


@pytest.mark.parametrize("n", [1, 3])
def test_a_copy_failing_in_a_packs_eviction_can_be_retried(monkeypatch, n):
    # a host OOM while the budget evicts, inside a pack: its event was recorded, its var
    # never made; the retried step used to fail planning from that (IndexError)
    real, calls = swap_transfers.copy_bytes, []

    def copy(dst, src, non_blocking):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("out of memory (injected)")
        real(dst, src, non_blocking)
    monkeypatch.setattr(swap_transfers, "copy_bytes", copy)
    build, batch = MODELS["mlp"]
    torch.manual_seed(0)
    model, plain = build(), build()
    plain.load_state_dict(model.state_dict())
    need = sequence_of("mlp").min_budget()[0]
    ctx = scheduler.swap(window="1MiB", budget=need, device="cpu", min_bytes=0)
    failed = 0
    with ctx:
        for i in range(3):
            x, y = batch(i)
            for _ in range(2):  # the usual OOM-retry loop
                try:
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    break
                except RuntimeError as e:
                    assert "injected" in str(e)
                    failed += 1
                    model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(plain(x), y).backward()
            for p, q in zip(model.parameters(), plain.parameters()):
                assert torch.equal(p.grad, q.grad)
            model.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
    assert failed == 1
    assert_nothing_left(ctx)


def test_counts_an_interrupt_left_half_done_are_redone():
    from scheduler.runtime.host_pool import HostPool
    from scheduler.runtime.swap_stats import Residency

    class V:
        nbytes = 8
    r, a, b = Residency(), V(), V()
    r.add(a)
    r.add(b)
    r.order.pop(a)  # drop() stopped between the entry and its count
    r.end_iteration()
    assert r.bytes == 8
    pool = HostPool(pin_memory=False)
    buf = pool.acquire(16)
    pool._lent.pop(id(buf))  # release() stopped likewise
    pool.resync()
    assert pool.in_use_bytes == 0


def test_a_backward_that_raises_leaves_nothing_resident():
    # the runtime knew the running node by a strong reference: a failed backward's graph
    # (and its saved tensors) stayed alive after the program let go of the loss
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 10))
    ctx = scheduler.swap(window="1MiB", device="cpu", min_bytes=0)
    with ctx:
        for i in range(3):
            h = model[0](torch.randn(16, 32))
            if i == 1:
                h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("injected")))
            loss = model[1:](h).square().mean()
            try:
                loss.backward()
            except RuntimeError as e:
                assert "injected" in str(e)
            del loss, h
            assert ctx.stats()["resident_bytes"] == 0, i
    assert ctx.stats()["iterations"] == 3 and ctx.stats()["plan_mismatches"] == 0
