"""The allocator's life: fork, close, interpreter exit, oversized requests, the pressure callback's
cycle, the bounded trace (issue 16 items 1, 2, 3, 5, 7, 10 (malloc(True)), 11)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest

from _subproc import TORCH_ENTRY_POINTS, python_env
from bench.alloc_probe import view
from vmalloc import Allocator, OutOfMemoryError

C = 64 << 10


def run_child(fn) -> int:
    """fn() in a forked child; its exit code (0 when fn returned True)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = 0 if fn() else 3
        except BaseException:  # noqa: BLE001
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def filled(a: Allocator):
    live = {}
    for i, n in enumerate((100, 5000, 3 * C + 7)):
        p = a.malloc(n)
        view(p, n)[:] = 10 + i
        live[p] = (n, 10 + i)
    return live


def intact(live) -> bool:
    return all(bool((view(p, n) == b).all()) for p, (n, b) in live.items())


# ------------------------------------------------------------------------------------ fork


def test_forked_child_cannot_use_the_parent_allocator():
    with Allocator("host", chunk_size=C) as a:
        live = filled(a)
        p = next(iter(live))

        def child() -> bool:
            assert a.forked and a.closed
            for f in (lambda: a.malloc(10), lambda: a.free(p), a.trim, a.stats,
                      lambda: a.record_stream(p, 3), lambda: a.set_budget(None)):
                with pytest.raises(RuntimeError, match="forked child cannot use it"):
                    f()
            return True

        assert run_child(child) == 0
        assert not a.forked and intact(live)


def test_child_free_trim_close_and_drop_release_nothing_of_the_parent():
    with Allocator("host", chunk_size=C) as a:
        live = filled(a)
        spare = a.malloc(2 * C)
        before = a.stats()

        def child() -> bool:
            for f in (lambda: a.free(spare), a.trim):
                try:
                    f()
                except RuntimeError:
                    pass
            a.close()
            return True

        def drop() -> bool:
            nonlocal a
            del a
            gc.collect()
            return True

        assert run_child(child) == 0
        assert run_child(drop) == 0
        assert intact(live)
        after = a.stats()
        for k in ("physical_current", "requested_current", "num_live", "num_free"):
            assert after[k] == before[k], k
        q = a.malloc(2 * C)        # the parent never hands out what a child "freed"
        assert q != spare
        view(q, 2 * C)[:] = 99
        assert intact(live)


def test_child_exiting_through_the_interpreter_releases_nothing_of_the_parent(tmp_path):
    """The child returns normally: atexit, module teardown and the allocator's destructor run."""
    script = textwrap.dedent("""
        import ctypes, os, sys
        import numpy as np
        from vmalloc import Allocator
        a = Allocator("host", chunk_size=65536)
        p = a.malloc(300000)
        v = np.ctypeslib.as_array((ctypes.c_uint8 * 300000).from_address(p))
        v[:] = 42
        pid = os.fork()
        if pid == 0:
            sys.exit(0)            # the child's interpreter exit destroys its copy of `a`
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert int((v != 42).sum()) == 0, "parent bytes changed by the child's exit"
        q = a.malloc(300000)
        assert q != p
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=python_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# ------------------------------------------------------------------------------------ close


def test_close_is_linear_in_live_small_blocks():
    """Each block is walked once at close (it used to walk its whole slab per block)."""
    with Allocator("host", chunk_size=2 << 20) as a:
        n = 40000
        for _ in range(n):
            a.malloc(512)
        slabs = a.stats()["small_pool_bytes"] // (2 << 20)
        a.close()
        visits = a._debug_state()["close_block_visits"]
        assert n <= visits <= n + 2 * slabs


def test_close_under_address_space_limit_does_not_abort(tmp_path):
    """With no memory to allocate, close() and the destructor must still finish (it allocated a
    std::set of every block and aborted with std::bad_alloc inside a noexcept function)."""
    script = textwrap.dedent("""
        import resource
        from vmalloc import Allocator
        a = Allocator("host", chunk_size=2 << 20)
        b = Allocator("host", chunk_size=2 << 20)
        ps = [a.malloc(512) for _ in range(60000)] + [b.malloc(512) for _ in range(20000)]
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm, vm))   # no new mapping from here on
        a.close()
        del ps
        print("closed", flush=True)
    """)    # b is destroyed at interpreter exit, still under the limit
    r = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=python_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "closed" in r.stdout


AFTER_CLOSE = {
    "trim": lambda a, p: a.trim(),
    "set_trace": lambda a, p: a.set_trace(True),
    "take_trace": lambda a, p: a.take_trace(),
    "reset_peak": lambda a, p: a.reset_peak(),
    "set_trace_capacity": lambda a, p: a.set_trace_capacity(5),
    "allocation_size": lambda a, p: a.allocation_size(p),
    "live_allocations": lambda a, p: a.live_allocations(),
    "set_pressure_callback": lambda a, p: a.set_pressure_callback(lambda n: False),
    "malloc": lambda a, p: a.malloc(10),
    "free": lambda a, p: a.free(p),
    "set_budget": lambda a, p: a.set_budget(None),
    "record_stream": lambda a, p: a.record_stream(p, 0),
}


@pytest.mark.parametrize("call", sorted(AFTER_CLOSE))
def test_calls_after_close_raise(call):
    """README: close() makes later calls raise RuntimeError. trim, set_trace, take_trace,
    reset_peak, set_trace_capacity, allocation_size and live_allocations returned quietly, and
    set_pressure_callback re-attached a callback (the cycle close() breaks)."""
    a = Allocator("host", chunk_size=C)
    p = a.malloc(100)
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        AFTER_CLOSE[call](a, p)
    assert "_pressure_callback" not in a.__dict__


def test_what_still_answers_after_close():
    a = Allocator("host", chunk_size=C)
    a.set_pressure_callback(lambda n: False)
    a.free(a.malloc(3 * C))
    a.close()
    assert a.stats()["num_malloc"] == 1 and a.stats()["physical_current"] == 0
    assert a.closed and a.chunk_size == C and a._debug_state()["chunks_held"] == 0
    a.set_pressure_callback(None)   # nothing to drop: code detaching on its way out need not ask
    a.close()
    assert "closed" in repr(a)


CLOSED_REGISTRY_SCRIPT = TORCH_ENTRY_POINTS + r"""
p = malloc(4096, 0, None)
vmalloc.torch_allocator.start_recording()
a = core._torch_allocator(0)
free(p, 4096, 0, None)
a.close()                      # the user closed device 0's allocator
print(core._torch_trim())      # empty_cache: the devices' loop goes on past it
core._torch_set_trace(True)
vmalloc.torch_allocator.set_trace_capacity(10)
rep = vmalloc.report(format="json")
assert rep["source"] == "vmalloc", rep["source"]
print("OK")
"""


def test_a_closed_registry_allocator_is_skipped_by_the_device_loops(tmp_path):
    r = subprocess.run([sys.executable, "-c", CLOSED_REGISTRY_SCRIPT], capture_output=True,
                       text=True, timeout=120, env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.split() == ["0", "OK"], r.stdout + r.stderr


# ------------------------------------------------------------------------------------ oversized


def test_requests_beyond_the_machine_fail_at_once():
    with Allocator("host", chunk_size=C) as a:
        for n in (1 << 40, 2**63 - 1, 2**64 - 1):
            with pytest.raises(OutOfMemoryError, match="larger than the host backend's memory"):
                a.malloc(n)
        with pytest.raises(ValueError, match="nbytes: .* is too large"):  # not a size at all
            a.malloc(2**70)
        assert a.stats()["physical_peak"] == 0
    with Allocator("host", chunk_size=1 << 40) as a:
        with pytest.raises(OutOfMemoryError, match="one chunk is larger than"):
            a.malloc(1)
        assert a.stats()["num_chunks_created"] == 0


def test_requests_past_the_address_space_fail_at_once_without_creating_a_chunk():
    """Host-lazy has no limit but the budget: a request of 2**48 bytes created every chunk
    (an ftruncate and a handle each: minutes and GBs for 2 MiB chunks) before the address
    space was tried; past 2**62 the message said "the host-lazy backend's memory (0 bytes)"."""
    asked = []
    with Allocator("host-lazy", chunk_size=1 << 40) as a:   # few chunks: quick either way
        a.set_pressure_callback(lambda n: asked.append(n) or False)
        for n in (2**48, (1 << 47) + 1, 2**63):
            with pytest.raises(OutOfMemoryError, match="larger than any address space") as info:
                a.malloc(n)
            assert "(0 bytes)" not in str(info.value)
        s = a.stats()
        assert s["num_chunks_created"] == 0 and s["num_oom"] == 3 and not asked
    with Allocator("host-lazy", chunk_size=C) as a:
        with pytest.raises(OutOfMemoryError, match="larger than any address space"):
            a.malloc(2**50)                                # 2**34 chunks: this took > 10 min
        assert a.stats()["num_chunks_created"] == 0


def test_absurd_chunk_size_is_refused_naming_it():
    with pytest.raises(ValueError, match="chunk_size: 9223372036854775808 bytes is larger than any"):
        Allocator("host", chunk_size=2**63)


@pytest.mark.parametrize("bad", [True, False, 1.5, "8", None])
def test_malloc_takes_an_int_byte_count(bad):
    with Allocator("host", chunk_size=C) as a:
        with pytest.raises(TypeError, match=f"nbytes: expected an int byte count, got {bad!r}"):
            a.malloc(bad)
        with pytest.raises(ValueError, match="nbytes: must be a positive byte count, got -3"):
            a.malloc(-3)


# ------------------------------------------------------------------------------------ callback


def test_pressure_callback_referring_to_its_allocator_is_collected():
    a = Allocator("host", chunk_size=C, budget=2 * C)
    a.set_pressure_callback(lambda missing: a.trim() > 0)
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None


def test_pressure_callback_still_works_through_the_weak_reference():
    with Allocator("host", chunk_size=C, budget=2 * C) as a:
        held = [a.malloc(2 * C)]

        def relieve(missing: int) -> bool:
            a.free(held.pop())
            return True

        a.set_pressure_callback(relieve)
        a.free(a.malloc(2 * C))
        assert a.stats()["num_pressure_calls"] == 1


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_pressure_callback_returning_a_non_bool_is_named(value):
    with Allocator("host", chunk_size=C, budget=C) as a:
        a.malloc(C)
        a.set_pressure_callback(lambda missing: value)
        with pytest.raises(TypeError, match=f"pressure callback: must return True .* got {value!r}"):
            a.malloc(C)


def test_pressure_callback_must_be_callable():
    with Allocator("host", chunk_size=C) as a:
        with pytest.raises(TypeError, match="callback: expected a callable or None, got 5"):
            a.set_pressure_callback(5)


# ------------------------------------------------------------------------------------ trace


def test_trace_is_a_bounded_ring_that_counts_what_it_dropped():
    with Allocator("host", chunk_size=C, trace_capacity=100) as a:
        a.set_trace(True)
        for _ in range(200):
            a.free(a.malloc(1000))
        assert a._debug_state()["trace_events"] == 100
        ev = a.take_trace()
        assert len(ev) == 100 and a.stats()["num_trace_dropped"] == 300
        assert [e["action"] for e in ev[:2]] == ["alloc", "free"]
        assert all(x["time"] <= y["time"] for x, y in zip(ev, ev[1:]))   # oldest first
        a.set_trace_capacity(10)
        for _ in range(20):
            a.free(a.malloc(1000))
        assert len(a.take_trace()) == 10 and a.stats()["num_trace_dropped"] == 330
        assert a.trace_capacity == 10


def test_trace_capacity_is_validated():
    with pytest.raises(ValueError, match="trace_capacity: expected an event count >= 0, got -1"):
        Allocator("host", chunk_size=C, trace_capacity=-1)


HISTORY_SCRIPT = TORCH_ENTRY_POINTS + r"""
ta.start_recording()
ta.set_trace_capacity(30)
for i in range(25):                     # the native ring keeps 30 of these 50 events
    free(malloc(1000 + i, 0, None), 1000 + i, 0, None)
rep = vmalloc.report(format="json")
assert rep["history"] == {"capacity": 30, "events_kept": 30, "events_dropped": 20}, rep["history"]
for i in range(10):                     # 20 more: the Python history drops 20 of its own
    free(malloc(2000, 0, None), 2000, 0, None)
h = vmalloc.report(format="json")["history"]
assert h == {"capacity": 30, "events_kept": 30, "events_dropped": 40}, h
assert len(reg.history[0]) == 30 and reg.history[0][-1]["size"] == 2000
print("OK")
"""


def test_recorded_history_is_bounded_and_the_report_counts_what_was_dropped(tmp_path):
    r = subprocess.run([sys.executable, "-c", HISTORY_SCRIPT], capture_output=True, text=True,
                       timeout=120, env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def test_interrupt_in_the_pressure_callback_propagates_and_leaves_the_allocator_usable():
    with Allocator("host", chunk_size=C, budget=2 * C) as a:
        p = a.malloc(2 * C)

        def interrupted(missing: int) -> bool:
            raise KeyboardInterrupt

        a.set_pressure_callback(interrupted)
        with pytest.raises(KeyboardInterrupt):
            a.malloc(C)
        s = a.stats()
        assert s["num_live"] == 1 and s["requested_current"] == 2 * C
        a.free(p)
        a.free(a.malloc(2 * C))
