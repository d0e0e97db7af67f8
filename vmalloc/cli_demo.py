"""The ``vmalloc demo`` command, the README's main job: without a GPU, plan a bundled chain with
every planner, simulate the plans, replay the fastest plan's allocation trace, then replay the
bundled traces (``bench/traces``); with one, train a small model under ``VMALLOC=1`` and a budget.

This is the one vmalloc module that uses the ``scheduler`` package (its planners and
``scheduler.demo``): the demo sits above both packages, like the autoload hook, and imports the
scheduler lazily, when it plans or looks for the bundled files (``scheduler.demo.bundle_roots``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from .cli_replay import replay_one, table
from .sizes import CUDA_GRANULARITY, check_budget_holds_a_chunk, format_size, parse_size


def _bundle_roots() -> List[Path]:
    """Where the bundled files are looked for: ``scheduler.demo.bundle_roots``, the one search
    (the working directory, then the checkout the packages run from)."""
    from scheduler.demo import bundle_roots
    return bundle_roots()


def _missing(*what: str) -> FileNotFoundError:
    """The error for bundled files found in none of :func:`_bundle_roots`."""
    looked = " nor in ".join(str(r) for r in _bundle_roots())
    return FileNotFoundError(
        f"the bundled files are missing: no {' and no '.join(what)} in {looked} (the current "
        "directory, then the directory vmalloc runs from); run vmalloc demo from the "
        "repository root, a checkout of vmalloc")


def _bundled(sub: str, suffixes: Sequence[str]) -> List[str]:
    """The files of ``bench/<sub>`` in the first of :func:`_bundle_roots` that has any."""
    from .replay.files import trace_files_in
    for root in _bundle_roots():
        found = trace_files_in(str(root / "bench" / sub), suffixes)
        if found:
            return found
    return []


def bundled_traces(directory: Optional[str] = None) -> List[str]:
    """The bundled traces: ``directory``, else ``bench/traces`` of the working directory or of
    the source checkout this package runs from."""
    from .replay.files import JSON_TRACE_SUFFIXES, trace_files_in
    found = trace_files_in(directory, JSON_TRACE_SUFFIXES) if directory \
        else _bundled("traces", JSON_TRACE_SUFFIXES)
    if found:
        return found
    if directory:
        raise FileNotFoundError(f"--traces {directory}: no traces (*.json, *.json.gz) there")
    raise _missing("bench/traces/*.json(.gz) (or pass --traces DIR)")


def _demo_inputs(args: argparse.Namespace) -> Tuple[Any, List[str]]:
    """The chain to plan (None with --replay-only) and the traces to replay, found before any
    step runs; what is missing is said in one error, with where it was looked for.
    (scheduler.demo.find_chain would plan a random stand-in where no chain is bundled.)"""
    from .replay.files import JSON_TRACE_SUFFIXES
    missing = []
    traces = bundled_traces(args.traces) if args.traces else _bundled("traces", JSON_TRACE_SUFFIXES)
    if not traces:
        missing.append("bench/traces/*.json(.gz) (or pass --traces DIR)")
    if not args.replay_only:
        from scheduler import demo
        if not demo.bundled_chains():
            missing.append(f"bench/chains/*.json (--chain {args.chain} is planned from "
                           f"bench/chains/{args.chain}.json)")
    if missing:
        raise _missing(*missing)
    # an unknown chain name: an error listing the bundled ones
    return (None if args.replay_only else demo.find_chain(args.chain)), traces


_GPU_DEMO = textwrap.dedent("""
    import vmalloc._autoload as auto
    auto.install()            # what the installed .pth does at start-up when VMALLOC=1
    import torch, vmalloc
    if not vmalloc.is_enabled():   # never a demo of PyTorch's own allocator passing for ours
        raise SystemExit("vmalloc demo: VMALLOC=1 did not make vmalloc PyTorch's allocator "
                         "(see the warnings above)")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU())
                                  for _ in range(12)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(20):
        x = torch.randn(4096, 2048, device="cuda")
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    print(f"loss {loss.item():.5f}; vmalloc enabled: {vmalloc.is_enabled()}")
    print(vmalloc.report())
""")


def _plan_and_replay(args: argparse.Namespace, chain: Any, chunks: Sequence[int]) -> None:
    """Steps 1-2 of the CPU demo: plan a bundled chain with every planner, simulate, and
    replay the fastest plan's allocation trace (the scheduler is imported here, lazily: see
    the module doc)."""
    from scheduler import demo

    from .replay.trace import from_json
    print(f"[1/3] planning {chain.name} under {args.fraction:.0%} of what storing every "
          "activation needs, with each planner, and simulating every plan ...", flush=True)
    memory, rows = demo.plan_all(chain, args.fraction)
    print(demo.table(chain, memory, rows) + "\n")
    best = demo.fastest_fitting(memory, rows)
    if best is None:
        print("no planner fits that limit; skipping the replay of a planned trace\n")
        return
    trace = from_json(best.result.alloc_trace, name=f"{chain.name} planned by {best.planner}")
    print(f"[2/3] replaying the allocation trace of the fastest plan ({best.planner}, "
          f"{len(trace.events)} events) through vmalloc and the caching-allocator model ...",
          flush=True)
    print(table(replay_one(trace, chunks, not args.no_bisect, None)) + "\n")


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Ctrl-C inside the block is noted, not raised, and raised as ``KeyboardInterrupt`` when
    the block ends: ``import torch`` imports numpy from C code that swallows the
    ``KeyboardInterrupt`` raised inside it, so a Ctrl-C landing there was lost and the demo ran
    on. Outside the main thread (no signal handlers there), with Ctrl-C ignored (``SIG_IGN``) or
    under a handler set from C (which could not be put back) the block runs as it is."""
    noted: List[int] = []
    old = signal.getsignal(signal.SIGINT)
    if old in (None, signal.SIG_IGN) or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if noted:
            raise KeyboardInterrupt


def _gpu_present() -> bool:
    """Whether torch is installed and sees a CUDA device; Ctrl-C meanwhile is honoured."""
    with _sigint_held():
        try:
            import torch
        except ImportError:
            return False
        return bool(torch.cuda.is_available())


def cmd_demo(args: argparse.Namespace) -> int:
    """``vmalloc demo``: train on the GPU when there is one, else plan and replay. Every
    option, and (without a GPU) every bundled file the steps read, is checked before step 1."""
    # bad on the CPU too: say so now, not from the GPU demo's child later
    check_budget_holds_a_chunk(parse_size(args.budget, "--budget"), CUDA_GRANULARITY, "--budget",
                               "VMALLOC_CHUNK_SIZE")
    if not 0 < args.fraction <= 1:       # (NaN fails this too)
        raise ValueError(f"--fraction: expected a number in (0, 1] (a share of what storing "
                         f"every activation needs), got {args.fraction!r}")
    if args.traces and not os.path.isdir(args.traces):
        why = "is not a directory" if os.path.exists(args.traces) else "no such directory"
        raise ValueError(f"--traces {args.traces}: {why}")
    if not args.replay_only and _gpu_present():
        env = dict(os.environ, VMALLOC="1", VMALLOC_BUDGET=args.budget)
        here = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
        print(f"vmalloc demo: training a 12-layer MLP on the GPU with VMALLOC=1, "
              f"VMALLOC_BUDGET={args.budget}\n")
        return subprocess.call([sys.executable, "-c", _GPU_DEMO], env=env)
    chunks = [2 << 20, 20 << 20]
    chain, traces = _demo_inputs(args)
    if chain is not None:
        _plan_and_replay(args, chain, chunks)
    print(f"[3/3] replaying the {len(traces)} bundled allocation traces through vmalloc "
          "(host-lazy backend: real page mappings that take no RAM, since a replay never writes) and "
          "a model of PyTorch's caching allocator.\n"
          "phys/req = peak physical / peak requested; frag = 1 - requested/physical (GMLake's "
          "metric); smallest budget = least physical memory the whole trace replays in; IF = "
          "internal fragmentation (seed 003 Eq. 1) and its Eq. 2 bound N_max x chunk.\n",
          flush=True)
    summary = []
    for path in traces:
        cmp = replay_one(path, chunks, not args.no_bisect, None, max_bytes=args.max_size)
        print(table(cmp))
        print()
        rows = {r["allocator"]: r for r in cmp["rows"]}
        summary.append((cmp["trace"], rows))
    key = "physical_peak" if args.no_bisect else "min_budget"
    what = "peak physical without a budget" if args.no_bisect else "smallest budget that runs"
    print(f"summary ({what}, vs the caching model):")
    model = "pytorch caching (model)"
    for name, rows in summary:
        base = rows.get(model, {}).get(key)
        parts = []
        for alloc, r in rows.items():
            v = r.get(key)
            if v and base and alloc != model:
                d = 100 * (v - base) / base
                parts.append(f"{alloc}: {format_size(v)} ({abs(d):.1f}% {'less' if d < 0 else 'more'})")
        parts.append(f"caching model: {format_size(base) if base else 'n/a'}")
        print(f"  {name}: " + "; ".join(parts))
    return 0
