"""Fault-and-fork probe of the allocator core (issue 16): random operations with content checks,
driver faults injected through the host backend, threads, and forked children.

    python bench/alloc_probe.py [--quick]

For each chunk size and budget: random malloc / free / record_stream / trim over two streams with
every allocation filled with its own byte and checked at free, and driver faults armed at random
(create, release, map, unmap, reserve, record, any; EIO, EINTR, EFBIG, ENOMEM, ENOSPC). After every
operation the invariants of :func:`check` hold (stats agree with the backend's own counts of
committed and mapped memory, no overlap, budget respected); at the end everything is freed,
trimmed and closed, and what is left committed or mapped is counted as a leak. Then C++ threads
hammer one allocator (``_core.alloc_stress_threads``), forked children use, free, trim, close
and drop the parent's allocator while the parent checks its bytes, and a list of bad arguments
must each raise its own error naming the input.

Writes bench/results/alloc_probe.json and prints a table. The test suite runs the same engine
(``Probe``) in a bounded hypothesis test (tests/test_allocator_faults.py).
"""
from __future__ import annotations

import ctypes
import errno
import gc
import os
import random
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # run as a script (bench/ is first on sys.path)
    import checkout
    checkout.on_path()

from vmalloc import Allocator, OutOfMemoryError, _core  # noqa: E402

CALLS = ("create", "release", "map", "unmap", "reserve", "record", "any")
ERRNOS = (errno.EIO, errno.EINTR, errno.EFBIG, errno.ENOMEM, errno.ENOSPC)
STREAMS = (0, 7)  # the default stream and one that owner events are recorded on at free


def view(ptr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


def check(a: Allocator, live: Dict[int, Tuple[int, int]], budget: Optional[int]) -> None:
    """The allocator's invariants (raises AssertionError naming the one that broke)."""
    s, d = a.stats(), a._debug_state()
    chunk = s["chunk_size"]
    assert d["chunks_held"] * chunk == s["physical_current"], ("physical", s, d)
    assert d["committed_bytes"] == s["physical_current"], ("committed != physical", s, d)
    assert d["mapped_bytes"] == (d["chunks_held"] - d["free_chunks"]) * chunk, ("mapped", s, d)
    assert s["cached_bytes"] == (d["free_chunks"] + d["cached_range_chunks"]) * chunk, ("cached", s, d)
    assert s["num_live"] == len(live), ("live count", s["num_live"], len(live))
    assert s["requested_current"] == sum(n for n, _ in live.values()), "requested_current"
    if budget is not None:
        assert s["physical_current"] <= budget, ("over budget", s)
    end = 0
    for p in sorted(live):
        assert p >= end, ("overlap", hex(p))
        end = p + live[p][0]


class Probe:
    """Random operations on one host allocator, with faults; counts what happened."""

    def __init__(self, chunk: int, budget: Optional[int], seed: int, fault_rate: float = 0.15,
                 max_chunks: int = 6) -> None:
        self.a = Allocator("host", chunk_size=chunk, budget=budget, small_threshold=min(chunk, 64 << 10))
        self.chunk, self.budget = chunk, budget
        self.rng = random.Random(seed)
        self.fault_rate = fault_rate
        self.max_bytes = max_chunks * chunk
        self.live: Dict[int, Tuple[int, int]] = {}  # ptr -> (bytes, fill byte)
        self.n = dict(ops=0, faults_armed=0, oom=0, driver_errors=0, free_errors=0,
                      corrupted_bytes=0, bytes_checked=0)

    def _size(self) -> int:
        r = self.rng.random()
        if r < 0.4:
            return self.rng.randint(1, 4096)
        if r < 0.6:
            return self.rng.randint(1, max(self.chunk, 64 << 10))
        return self.rng.randint(1, self.max_bytes)

    def _verify(self, p: int) -> None:
        n, byte = self.live[p]
        v = view(p, n)
        bad = int(np.count_nonzero(v != byte))
        self.n["corrupted_bytes"] += bad
        self.n["bytes_checked"] += n

    def step(self) -> None:
        rng, a = self.rng, self.a
        self.n["ops"] += 1
        if rng.random() < self.fault_rate:
            a._inject_fault(rng.choice(CALLS), rng.randint(1, 4), rng.choice(ERRNOS),
                            rng.choice((1, 1, 1, 3)))
            self.n["faults_armed"] += 1
        op = rng.random()
        try:
            if op < 0.5 or not self.live:
                n = self._size()
                p = a.malloc(n, rng.choice(STREAMS))
                byte = rng.randint(1, 255)
                view(p, n)[:] = byte
                self.live[p] = (n, byte)
            elif op < 0.85:
                p = rng.choice(list(self.live))
                self._verify(p)
                before = a.stats()
                try:
                    a.free(p)
                except RuntimeError:
                    # Events are recorded first: the pointer is still live, the stats unchanged.
                    self.n["free_errors"] += 1
                    after = a.stats()
                    assert a.allocation_size(p) == self.live[p][0], "free failed but the pointer left"
                    assert after["requested_current"] == before["requested_current"]
                    assert after["num_free"] == before["num_free"]
                    raise
                del self.live[p]
            elif op < 0.93:
                p = rng.choice(list(self.live))
                a.record_stream(p, rng.choice(STREAMS))
            else:
                a.trim()
        except OutOfMemoryError:
            self.n["oom"] += 1
        except RuntimeError:
            self.n["driver_errors"] += 1
        check(self.a, self.live, self.budget)

    def disarm(self) -> None:
        for c in CALLS + ("unreserve",):
            self.a._inject_fault(c, 0)

    def finish(self) -> Dict[str, Any]:
        """Disarm, free everything (checking contents), trim, close; count leaks."""
        self.disarm()
        for p in list(self.live):
            self._verify(p)
            self.a.free(p)
            del self.live[p]
        check(self.a, self.live, self.budget)
        self.a.trim()
        s, d = self.a.stats(), self.a._debug_state()
        fired = d["faults_fired"]
        leak = s["physical_current"] + d["committed_bytes"] + d["mapped_bytes"] + s["va_reserved"]
        self.a.close()
        return dict(self.n, faults_fired=fired, leaked_bytes=leak)


def run_config(chunk: int, budget: Optional[int], ops: int, seed: int) -> Dict[str, Any]:
    """One probe run; a broken invariant raises (the probe stops loudly, it never counts one)."""
    p = Probe(chunk, budget, seed)
    for _ in range(ops):
        p.step()
    out = p.finish()
    out.update(chunk_size=chunk, budget=budget)
    return out


def thread_stress(threads: int, iters: int) -> Dict[str, Any]:
    with Allocator("host", chunk_size=64 << 10, budget=256 << 20) as a:
        r = dict(_core.alloc_stress_threads(a, threads, iters, 1 << 20, 1))
        a.trim()
        r["leaked_bytes"] = a.stats()["physical_current"] + a._debug_state()["committed_bytes"]
    r["threads"] = threads
    return r


def _child(fn) -> int:
    """Run fn in a forked child; its exit status (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = 0 if fn() else 3
        except BaseException:  # noqa: BLE001 - any escape is a failure of the case
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def fork_cases() -> Dict[str, Any]:
    """Forked children use, free+trim, close and drop the parent's allocator; the parent checks."""
    a = Allocator("host", chunk_size=64 << 10)
    live = {}
    for i, n in enumerate((100, 5000, 70000, 300000, 1 << 20)):
        p = a.malloc(n)
        view(p, n)[:] = i + 1
        live[p] = (n, i + 1)
    spare = a.malloc(200000)
    before = a.stats()

    def raises(f) -> bool:
        try:
            f()
        except RuntimeError:
            return True
        return False

    def use() -> bool:
        return all([raises(lambda: a.malloc(10)), raises(lambda: a.free(spare)), raises(a.trim),
                    raises(a.stats), a.closed, a.forked])

    def free_trim() -> bool:
        raises(lambda: a.free(spare))
        raises(a.trim)
        a.close()
        return True

    def drop() -> bool:
        nonlocal a
        a.close()
        del a
        gc.collect()
        return True

    cases = {"child uses": use, "child frees and trims": free_trim, "child closes and drops": drop}
    results: Dict[str, Any] = {}
    corrupted = 0
    for name, fn in cases.items():
        results[name] = _child(fn)
        for p, (n, byte) in live.items():
            corrupted += int(np.count_nonzero(view(p, n) != byte))
    after = a.stats()
    same = {k: before[k] == after[k] for k in ("physical_current", "requested_current", "num_live")}
    a.free(spare)
    for p in live:
        a.free(p)
    a.close()
    return {"children": len(cases), "child_exit_codes": results, "parent_corrupted_bytes": corrupted,
            "parent_stats_unchanged": all(same.values())}


def bad_inputs() -> Dict[str, Any]:
    """Bad arguments: each must raise its own error type with a message naming the input."""
    a = Allocator("host", chunk_size=64 << 10, budget=1 << 20)
    p = a.malloc(100)
    a.free(p)
    closed = Allocator("host", chunk_size=64 << 10)
    closed.close()
    cases = [
        (lambda: a.malloc(0), ValueError, "nbytes"), (lambda: a.malloc(-5), ValueError, "nbytes"),
        (lambda: a.malloc(True), TypeError, "nbytes"), (lambda: a.malloc(1.5), TypeError, "nbytes"),
        (lambda: a.malloc("8"), TypeError, "nbytes"), (lambda: a.free(p), ValueError, "ptr"),
        (lambda: a.free(12345), ValueError, "ptr"), (lambda: a.record_stream(77, 1), ValueError, "ptr"),
        (lambda: a.malloc(2 << 20), OutOfMemoryError, "budget"),
        (lambda: a.malloc(1 << 40), OutOfMemoryError, "out of memory"),
        (lambda: a.malloc(2**70), ValueError, "nbytes"),
        (lambda: a.set_budget(100), ValueError, "budget"),
        (lambda: closed.malloc(10), RuntimeError, "closed"),
        (lambda: Allocator("host", chunk_size=2**63), ValueError, "chunk_size"),
        (lambda: Allocator("host", chunk_size=5000), ValueError, "chunk_size"),
        (lambda: Allocator("host", chunk_size=0), ValueError, "chunk_size"),
        (lambda: Allocator("host", chunk_size=1 << 20, budget=4096), ValueError, "budget"),
        (lambda: Allocator("gpu"), ValueError, "backend"),
        (lambda: Allocator("host", device=-1), ValueError, "device"),
        (lambda: Allocator("host", trace_capacity=-1), ValueError, "trace_capacity"),
        (lambda: Allocator("host", cache_slack=-1.0), ValueError, "cache_slack"),
        (lambda: a.set_pressure_callback(5), TypeError, "callback"),
        (lambda: a._inject_fault("mmap"), ValueError, "call"),
    ]
    clear = 0
    unclear = []
    for i, (f, exc, word) in enumerate(cases):
        try:
            f()
            unclear.append(f"case {i}: no error")
        except exc as e:
            if word in str(e):
                clear += 1
            else:
                unclear.append(f"case {i}: {e}")
        except Exception as e:  # noqa: BLE001 - counted as unclear: the wrong error type
            unclear.append(f"case {i}: {type(e).__name__}: {e}")
    a.close()
    return {"tried": len(cases), "clear_errors": clear, "unclear": unclear}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    from bench.common import parse_args, print_table, run_meta, say_nothing_written, write_json

    args = parse_args(__doc__.splitlines()[0], argv)
    ops = 300 if args.quick else 3000
    chunks = [4 << 10, 64 << 10, 2 << 20] if args.quick else [4 << 10, 16 << 10, 64 << 10, 256 << 10,
                                                              1 << 20, 2 << 20, 8 << 20]
    rows = []
    t0 = time.perf_counter()
    seed = 0
    for chunk in chunks:
        for budget_chunks in (None, 4, 16, 64):
            seed += 1
            budget = None if budget_chunks is None else budget_chunks * chunk
            rows.append(run_config(chunk, budget, ops, seed))
    threads = [thread_stress(t, 2000 if args.quick else 20000)
               for t in ((2, 8) if args.quick else (2, 8, 64))]
    forks = fork_cases()
    bad = bad_inputs()
    total = {k: sum(r[k] for r in rows) for k in ("ops", "faults_armed", "faults_fired", "oom",
                                                  "driver_errors", "free_errors", "bytes_checked",
                                                  "corrupted_bytes", "leaked_bytes")}
    total["thread_ops"] = sum(t["operations"] for t in threads)
    total["thread_corruptions"] = sum(t["corruptions"] for t in threads)
    total["thread_overlaps"] = sum(t["overlaps"] for t in threads)
    total["thread_leaked_bytes"] = sum(t["leaked_bytes"] for t in threads)
    total["fork_children"] = forks["children"]
    total["fork_failed_children"] = sum(1 for c in forks["child_exit_codes"].values() if c != 0)
    total["fork_parent_corrupted_bytes"] = forks["parent_corrupted_bytes"]
    total["bad_inputs_tried"] = bad["tried"]
    total["bad_inputs_unclear"] = len(bad["unclear"])
    total["seconds"] = round(time.perf_counter() - t0, 2)
    print_table(rows, ["chunk_size", "budget", "ops", "faults_fired", "oom", "driver_errors",
                       "free_errors", "corrupted_bytes", "leaked_bytes"])
    print_table([total])
    command = "python bench/alloc_probe.py" + (" --quick" if args.quick else "")
    # the tags every results file carries (machine, torch, date; vmalloc's host backend)
    out = {"meta": run_meta(command, "cpu"), "command": command, "quick": bool(args.quick), "configs": rows, "threads": threads, "fork": forks,
           "bad_inputs": bad, "total": total}
    if args.out is None:
        say_nothing_written()
    else:
        write_json("alloc_probe", out, args.out)
    return out


if __name__ == "__main__":
    main()
