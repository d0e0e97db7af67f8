"""malloc+free throughput of vmalloc's allocator core (seed 003, section 4).

    python bench/alloc_micro.py [--quick] [--out DIR] [--policies-only]

``--policies-only``: the reuse-policy table alone, measured again and put into the existing
results file (its counts are the same on any machine; a GPU session's rows stay).

Host backend (always):
  * fast path: a freed range (or small block) handed back without a driver call, malloc+free
    pairs per second, timed in C++ (``_core.alloc_bench_cycle``: no Python in the loop) and from
    a Python loop;
  * remap path: a budget of k chunks and alternating k / k-1 chunk requests with splitting off, so
    every malloc unmaps and maps chunks; reported as pairs/s and as the cost per chunk remapped
    (one unmap + one map);
  * fresh path: trim() after every free, so each malloc creates, maps, and later releases chunks;
  * reuse-policy table: training-like traces (static and dynamic shapes) replayed with and
    without a budget under each combination of the reuse knobs (split_cached; merge_cached; no
    cap / cache_slack=0.25 / prefer_remap): maps per malloc (overall and in the steady second half),
    cache hits, physical peak / requested peak. This is what chose the defaults.
CUDA backend (only where torch sees a GPU; skipped otherwise and said so in the JSON): the same
fast/remap numbers next to cudaMalloc/cudaFree and PyTorch's caching allocator (torch.empty/del),
plus the fast path once a second stream was seen (``vmalloc_fast_2chunks_two_streams``: every
free then records an event, one cuEventRecord per pair; the fake driver's test shows it is the
only driver call there).

Writes bench/results/alloc_micro.json (``--out DIR``: DIR/alloc_micro.json; ``--quick``: nothing
unless ``--out``, a smoke run leaves the committed full run alone) and prints a table:
once the host section is done, again with the cuda one. A cuda measurement that fails is an
error entry for its row (``{"error": message}``, and listed in ``cuda.errors``); the other
rows and the host section are still written.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script (bench/ is first on sys.path)
    import checkout
    checkout.on_path()

from vmalloc import Allocator, _core  # noqa: E402
from vmalloc.allocator import granularity  # noqa: E402
from vmalloc.atomic_file import write_atomic  # noqa: E402
from bench.common import output_dir, run_meta, say_nothing_written  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
RESULTS = ROOT / "bench" / "results" / "alloc_micro.json"


def best_of(runs: int, fn: Callable[[], float]) -> float:
    """Smallest of `runs` timings (seconds): the least disturbed by the other jobs on the machine."""
    return min(fn() for _ in range(runs))


# ------------------------------------------------------------------------------------------------
# Fast, remap and fresh paths


def fast_path(backend: str, chunk: int, nbytes: int, pairs: int, runs: int,
              side_stream: Optional[int] = None) -> Dict[str, float]:
    """malloc/free pairs of one cached size on the default stream. side_stream: one allocation on
    that stream first, so the allocator has seen two streams and records an event at every free
    (cross-stream reuse must wait for it): the fast path's cost in a program with side streams."""
    with Allocator(backend, chunk_size=chunk) as a:
        if side_stream is not None:
            a.free(a.malloc(nbytes, stream=side_stream))
        _core.alloc_bench_cycle(a, [nbytes], 1000)  # warm: the range is cached
        cpp = best_of(runs, lambda: _core.alloc_bench_cycle(a, [nbytes], pairs))

        def py_loop() -> float:
            m, f = a.malloc, a.free
            t0 = time.perf_counter()
            for _ in range(pairs // 10):
                f(m(nbytes))
            return time.perf_counter() - t0

        py = best_of(runs, py_loop)
        s = a.stats()
        assert s["num_map"] <= -(-nbytes // chunk), "the fast path mapped chunks"
    return {"nbytes": nbytes, "cpp_pairs_per_s": pairs / cpp, "cpp_ns_per_pair": cpp / pairs * 1e9,
            "python_pairs_per_s": (pairs // 10) / py, "python_ns_per_pair": py / (pairs // 10) * 1e9}


def remap_path(backend: str, chunk: int, k: int, cycles: int, runs: int) -> Dict[str, float]:
    with Allocator(backend, chunk_size=chunk, budget=k * chunk, small_threshold=0,
                   split_cached=False) as a:
        sizes = [k * chunk, (k - 1) * chunk]
        _core.alloc_bench_cycle(a, sizes, 2)
        before = a.stats()
        secs = best_of(runs, lambda: _core.alloc_bench_cycle(a, sizes, cycles))
        after = a.stats()
    maps = (after["num_map"] - before["num_map"]) / runs
    unmaps = (after["num_unmap"] - before["num_unmap"]) / runs
    pairs = 2 * cycles
    return {"k": k, "pairs_per_s": pairs / secs, "us_per_pair": secs / pairs * 1e6,
            "chunks_remapped_per_pair": maps / pairs, "unmaps_per_pair": unmaps / pairs,
            "us_per_chunk_remapped": secs / maps * 1e6}


def fresh_path(backend: str, chunk: int, k: int, iters: int, runs: int) -> Dict[str, float]:
    with Allocator(backend, chunk_size=chunk, small_threshold=0) as a:
        def loop() -> float:
            m, f, trim = a.malloc, a.free, a.trim
            t0 = time.perf_counter()
            for _ in range(iters):
                f(m(k * chunk))
                trim()
            return time.perf_counter() - t0

        secs = best_of(runs, loop)
    return {"k": k, "us_per_cycle": secs / iters * 1e6,
            "us_per_chunk_create_map_unmap_release": secs / iters / k * 1e6}


# ------------------------------------------------------------------------------------------------
# Reuse-policy comparison on a replayed mixed-size trace


def mixed_trace(seed: int, steps: int, layers: int, dynamic: bool) -> List[Tuple[str, int, int]]:
    """A training-like trace: activations of varied sizes allocated in the forward and freed in
    reverse in the backward, a temporary per layer, a gradient per layer. With `dynamic`, sizes
    drift per step (dynamic shapes), so exact-size reuse alone does not suffice."""
    rng = random.Random(seed)
    base = [rng.choice([rng.randint(4 * KiB, 512 * KiB), rng.randint(MiB, 48 * MiB)])
            for _ in range(layers)]
    events, nid = [], 0
    for _ in range(steps):
        scale = rng.uniform(0.6, 1.4) if dynamic else 1.0
        acts = []
        for b in base:
            n = max(1, int(b * scale))
            nid += 1
            events.append(("alloc", nid, n))
            acts.append(nid)
            nid += 1
            events.append(("alloc", nid, n // 2 + 1))
            events.append(("free", nid, 0))
        for aid in reversed(acts):
            nid += 1
            events.append(("alloc", nid, max(1, int(base[0] * scale))))
            events.append(("free", aid, 0))
            events.append(("free", nid, 0))
    return events


def replay(events, **kwargs) -> Dict[str, float]:
    """Replay through a host allocator; counts over the whole trace and over its second half
    (the steady state, once the cache is warm)."""
    with Allocator("host", **kwargs) as a:
        live: Dict[int, int] = {}
        m, f = a.malloc, a.free
        half = None
        t0 = time.perf_counter()
        for i, (action, eid, n) in enumerate(events):
            if i == len(events) // 2:
                half = a.stats()
            if action == "alloc":
                live[eid] = m(n)
            else:
                f(live.pop(eid))
        secs = time.perf_counter() - t0
        s = a.stats()
    steady_mallocs = s["num_malloc"] - half["num_malloc"]
    return {"maps_per_malloc": s["num_map"] / s["num_malloc"],
            "unmaps_per_malloc": s["num_unmap"] / s["num_malloc"],
            "steady_maps_per_malloc": (s["num_map"] - half["num_map"]) / steady_mallocs,
            "cache_hit_rate": s["num_cache_hits"] / max(1, s["num_cache_hits"] + s["num_remaps"]),
            "physical_peak_over_requested_peak": s["physical_peak"] / s["requested_peak"],
            "physical_peak_mib": s["physical_peak"] / MiB,
            "us_per_event": secs / len(events) * 1e6,
            "driver_seconds": s["driver_seconds"]}


def policy_table(quick: bool) -> Dict[str, object]:
    chunk = 2 * MiB
    out: Dict[str, object] = {"chunk_size": chunk, "traces": {}}
    for kind in ("static", "dynamic"):
        events = mixed_trace(seed=7, steps=4 if quick else 12, layers=24, dynamic=kind == "dynamic")
        # The budget: the peak of live chunks under the paper's scheme plus 10%, so the policies
        # must reuse physical memory rather than grow.
        probe = replay(events, chunk_size=chunk, small_threshold=0, prefer_remap=True,
                       split_cached=False)
        budget = int(probe["physical_peak_mib"] * 1.10) * MiB
        rows = {}
        modes = (("no cap", dict(cache_slack=None)), ("slack 0.25", dict(cache_slack=0.25)),
                 ("remap first", dict(prefer_remap=True)))
        for split in (True, False):
            for merge in ((True, False) if split else (False,)):   # (merging needs splits)
                for mode, knobs in modes:
                    for label, b in (("no budget", None), ("budget", budget)):
                        if mode == "slack 0.25" and b is not None:
                            continue  # with a budget the slack does not apply: same as "no cap"
                        name = (f"split {'on' if split else 'off'}, merge {'on' if merge else 'off'}, "
                                f"{mode} [{label}]")
                        rows[name] = replay(events, chunk_size=chunk, budget=b, split_cached=split,
                                            merge_cached=merge, **knobs)
        out["traces"][kind] = {"events": len(events), "budget": budget, "rows": rows}
    return out


# ------------------------------------------------------------------------------------------------
# CUDA comparison (a lent GPU only)


def cuda_section(quick: bool, runs: int) -> Dict[str, object]:
    """The cuda rows; one that fails (a driver error, cudaMalloc refusing, an exception) is
    ``{"error": message}`` under its name (the remap/fresh lists keep the k that ran) and
    listed in ``errors``: the other rows are still measured and written."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine: the cuda backend, cudaMalloc and the "
                           "PyTorch caching allocator were not measured"}
    out: Dict[str, object] = {"device": torch.cuda.get_device_name(0)}
    errors: Dict[str, str] = {}

    def row(name: str, fn: Callable[[], object]) -> Optional[object]:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - one failed measurement must not lose the rest
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"cuda {name}: failed: {errors[name]}", file=sys.stderr)
            return None

    def keyed(name: str, fn: Callable[[], object]) -> None:
        got = row(name, fn)
        out[name] = {"error": errors[name]} if got is None else got

    g = row("granularity", lambda: granularity("cuda"))
    if g is None:   # nothing of vmalloc's cuda backend can run
        out["errors"] = errors
        return out
    out["granularity"] = g
    pairs = 20_000 if quick else 200_000
    keyed("vmalloc_fast_2chunks", lambda: fast_path("cuda", g, 2 * g, pairs, runs))
    keyed("vmalloc_fast_small_4KiB", lambda: fast_path("cuda", g, 4 * KiB, pairs, runs))
    # a pooled stream: never destroyed
    keyed("vmalloc_fast_2chunks_two_streams", lambda: fast_path(
        "cuda", g, 2 * g, pairs, runs, side_stream=torch.cuda.Stream(device=0).cuda_stream))
    remap = [row(f"vmalloc_remap k={k}", lambda k=k: remap_path("cuda", g, k, 200 if quick else 1000, runs))
             for k in (2, 8, 32)]
    out["vmalloc_remap"] = [r for r in remap if r is not None]
    fresh = [row(f"vmalloc_fresh k={k}", lambda k=k: fresh_path("cuda", g, k, 50 if quick else 200, runs))
             for k in (1, 8)]
    out["vmalloc_fresh"] = [r for r in fresh if r is not None]

    row("torch init", lambda: torch.zeros(1, device="cuda"))
    rt = _cudart()
    if rt is not None:
        for n in (4 * KiB, 2 * g, 32 * g):
            keyed(f"cudaMalloc_cudaFree_{n}", lambda n=n: _cuda_malloc_pairs(
                rt, n, 200 if quick else 2000, runs))
    for n in (4 * KiB, 2 * g, 32 * g):
        keyed(f"torch_caching_empty_del_{n}", lambda n=n: _torch_pairs(
            torch, n, 2000 if quick else 20000, runs))
    if errors:
        out["errors"] = errors
    return out


def _cuda_malloc_pairs(rt: ctypes.CDLL, n: int, iters: int, runs: int) -> Dict[str, float]:
    """cudaMalloc + cudaFree pairs of ``n`` bytes per second."""
    p = ctypes.c_void_p()

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            rc = rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n))
            if rc != 0:
                raise RuntimeError(f"cudaMalloc({n}) returned cudaError {rc}")
            rc = rt.cudaFree(p)
            if rc != 0:
                raise RuntimeError(f"cudaFree returned cudaError {rc}")
        return time.perf_counter() - t0

    secs = best_of(runs, loop)
    return {"pairs_per_s": iters / secs, "us_per_pair": secs / iters * 1e6}


def _torch_pairs(torch: object, n: int, iters: int, runs: int) -> Dict[str, float]:
    """torch.empty + del pairs of ``n`` bytes per second (PyTorch's caching allocator)."""
    def tloop() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            t = torch.empty(n, dtype=torch.uint8, device="cuda")  # type: ignore[attr-defined]
            del t
        return time.perf_counter() - t0

    tloop()
    secs = best_of(runs, tloop)
    return {"pairs_per_s": iters / secs, "us_per_pair": secs / iters * 1e6}


def _cudart() -> Optional[ctypes.CDLL]:
    import glob

    import torch

    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    names += glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*.so*"))
    names += glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia", "*",
                                    "lib", "libcudart.so*"))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


# ------------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="folder for alloc_micro.json (default bench/results; --quick: none)")
    ap.add_argument("--policies-only", action="store_true",
                    help="measure the reuse-policy table again and put it into the existing "
                         "alloc_micro.json (host.policies, with host.policies_meta): its counts "
                         "are the same on any machine, the GPU's rows stay")
    args = ap.parse_args(argv)
    out = output_dir(args.quick, args.out, RESULTS.parent)
    path = None if out is None else Path(out) / RESULTS.name
    if args.policies_only:
        return policies_only(path, args.quick)
    runs = 3 if args.quick else 5
    pairs = 200_000 if args.quick else 2_000_000
    chunk = 2 * MiB

    command = "python bench/alloc_micro.py" + (" --quick" if args.quick else "")
    res: Dict[str, object] = {
        # run_meta's tags (GPU, torch, date), then this bench's own (machine: the full platform)
        "meta": {**run_tags(command), "command": command,
                 "machine": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                 "host_granularity": granularity("host"), "chunk_size": chunk,
                 "note": "best of %d runs; the machine is shared, so numbers are lower bounds" % runs},
        "host": {
            "fast_large_2chunks": fast_path("host", chunk, 2 * chunk, pairs, runs),
            "fast_large_64chunks": fast_path("host", chunk, 64 * chunk, pairs, runs),
            "fast_small_4KiB": fast_path("host", chunk, 4 * KiB, pairs, runs),
            "remap": [remap_path("host", chunk, k, 500 if args.quick else 3000, runs) for k in (2, 8, 32)],
            "fresh": [fresh_path("host", chunk, k, 100 if args.quick else 500, runs) for k in (1, 8)],
            "policies": policy_table(args.quick),
        },
        # written so until the cuda section ends: a crash there (the process killed) keeps the host
        "cuda": {"skipped": "the cuda section did not finish (the process ended during it)"},
    }
    write(path, res)
    try:
        res["cuda"] = cuda_section(args.quick, runs)
    except Exception as exc:  # noqa: BLE001 - the host section is kept either way
        res["cuda"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    write(path, res)
    print_table(res)
    if path is None:
        say_nothing_written()
    else:
        print(f"\nwrote {path.relative_to(ROOT) if path == RESULTS else path}")


def policies_only(path: Optional[Path], quick: bool) -> None:
    """``--policies-only``: the reuse-policy table measured again (after a change of the reuse
    policy: maps, unmaps and physical peaks are counts, the same on any machine; only
    ``us_per_event`` is this machine's) and put into the results file in place of the old one."""
    if path is None or not path.exists():
        raise SystemExit(f"alloc_micro --policies-only: no results file to update ({path}); "
                         "run the whole bench first")
    res = json.loads(path.read_text())
    command = "python bench/alloc_micro.py --policies-only" + (" --quick" if quick else "")
    res["host"]["policies"] = policy_table(quick)
    res["host"]["policies_meta"] = {**run_tags(command), "command": command,
                                    "machine": platform.platform(), "cpus": os.cpu_count()}
    write(path, res)
    for kind, t in res["host"]["policies"]["traces"].items():
        for name, r in t["rows"].items():
            print(f"{kind:8s} {name:50s} maps/malloc {r['maps_per_malloc']:.2f} "
                  f"(steady {r['steady_maps_per_malloc']:.2f})  physical/requested "
                  f"{r['physical_peak_over_requested_peak']:.3f}")
    print(f"\nwrote the policy table into {path}")


def run_tags(command: str) -> Dict[str, object]:
    """``bench.common.run_meta``'s tags for this machine: its GPU's name where torch sees one
    (the cuda section runs there), else "cpu"; none without torch (the host section needs
    no torch, and the cuda section then says it was skipped)."""
    try:
        import torch
    except ImportError:
        return {}
    return run_meta(command, "cuda" if torch.cuda.is_available() else "cpu")


def write(path: Optional[Path], res: Dict[str, object]) -> None:
    """The JSON, written then renamed (a kill leaves the last whole file); None: nothing
    (--quick without --out)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(res, indent=2) + "\n")

def print_table(res: Dict[str, object]) -> None:
    h = res["host"]
    print("host backend, chunk 2 MiB                 C++ pairs/s    ns/pair   Python pairs/s")
    for key in ("fast_large_2chunks", "fast_large_64chunks", "fast_small_4KiB"):
        r = h[key]
        print(f"  {key:<38} {r['cpp_pairs_per_s']:>12,.0f} {r['cpp_ns_per_pair']:>10.1f} "
              f"{r['python_pairs_per_s']:>16,.0f}")
    print("\nremap path (budget = k chunks, alternate k / k-1)  pairs/s   us/pair  chunks/pair  us/chunk")
    for r in h["remap"]:
        print(f"  k={r['k']:<3} {'':<40} {r['pairs_per_s']:>9,.0f} {r['us_per_pair']:>8.1f} "
              f"{r['chunks_remapped_per_pair']:>11.1f} {r['us_per_chunk_remapped']:>9.2f}")
    print("\nfresh path (trim after each free)          us/cycle   us/chunk (create+map+unmap+release)")
    for r in h["fresh"]:
        print(f"  k={r['k']:<3} {'':<36} {r['us_per_cycle']:>9.1f} {r['us_per_chunk_create_map_unmap_release']:>9.2f}")
    for kind, p in h["policies"]["traces"].items():
        print(f"\nreuse policies, {kind}-shape trace ({p['events']} events, budget {p['budget'] / MiB:.0f} MiB;"
              " host us/event is dominated by chunk creation)")
        print(f"  {'policy':<46} {'maps/malloc':>11} {'steady':>7} {'unmaps/malloc':>13} {'hit rate':>8} "
              f"{'phys/req peak':>13} {'us/event':>8}")
        for name, r in p["rows"].items():
            print(f"  {name:<46} {r['maps_per_malloc']:>11.3f} {r['steady_maps_per_malloc']:>7.3f} "
                  f"{r['unmaps_per_malloc']:>13.3f} {r['cache_hit_rate']:>8.3f} "
                  f"{r['physical_peak_over_requested_peak']:>13.3f} {r['us_per_event']:>8.2f}")
    c = res["cuda"]
    print("\ncuda:", c.get("skipped") or json.dumps(c, indent=1))


if __name__ == "__main__":
    main()
