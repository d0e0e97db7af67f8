"""The ``vmalloc`` command: ``report FILE.json``, ``replay TRACE``, ``demo``."""
from __future__ import annotations

import argparse
import importlib
import glob
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Union

from .env import check_output_path
from .sizes import format_size, parse_size

if TYPE_CHECKING:  # pragma: no cover
    from .replay.trace import Trace


def _cmd_report(args: argparse.Namespace) -> int:
    rpt = importlib.import_module("vmalloc.report")
    from .replay.files import read_bounded

    def check_head(head: bytes) -> None:  # /dev/zero, a binary file: refused before reading on
        if head.strip() and head.lstrip()[:1] not in (b"{", b"["):  # JSON: load() judges it
            raise ValueError(f"{args.file}: not a JSON report (starts with {head[:8].hex(' ')})")
    # a directory, /dev/zero, a huge file: refused here
    read_bounded(args.file, args.max_size, check_head, option="vmalloc report --max-trace-size")
    try:
        rep = rpt.load(args.file)
    except UnicodeDecodeError:
        raise ValueError(f"report: {args.file!r} is not a JSON report (not text)") from None
    try:
        text = rpt.to_text(rep)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        # JSON with a 'memory' or 'comparison' key but not the rest of a report: report.py
        # reads it as a report would be, so say which part is missing or of the wrong type
        what = f"missing key {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args \
            else str(exc)
        raise ValueError(f"{args.file}: not a complete vmalloc report ({what})") from None
    print(text)
    return 0


def _table(cmp: dict) -> str:
    """The side-by-side table of one replayed trace, with a note under it for every smallest
    budget that is only an upper bound (the caching model's search ran out of trials)."""
    rpt = importlib.import_module("vmalloc.report")
    from .replay.run import MAX_SCAN_TRIALS
    out = [rpt.side_by_side_from_json(cmp)]
    for r in cmp["rows"]:
        if r.get("min_budget") and not r.get("min_budget_exact", True):
            out.append(f"note: {r['allocator']}: smallest budget {format_size(r['min_budget'])} "
                       "is an upper bound (the search stopped after "
                       f"{MAX_SCAN_TRIALS} replays); a smaller one may run")
    return "\n".join(out)


def _replay_one(path: Union[str, "Trace"], chunk_sizes: Sequence[int], bisect: bool,
                device: Optional[int], backend: str = "host-lazy",
                max_bytes: Optional[int] = None) -> dict:
    rpt = importlib.import_module("vmalloc.report")
    from .replay import DEFAULT_MAX_BYTES, compare, default_contenders, load
    trace = load(path, device=device, max_bytes=max_bytes or DEFAULT_MAX_BYTES) \
        if isinstance(path, str) else path
    rows = compare(trace, default_contenders(chunk_sizes, backend), bisect=bisect, timeline=True)
    cmp = rpt.comparison_json(trace.name, rows, trace.meta)
    cmp["timelines"] = {r.allocator: r.timeline for r in rows}
    return cmp


def _plot(cmps: List[dict], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rpt = importlib.import_module("vmalloc.report")
    fig, axes = plt.subplots(len(cmps), 1, figsize=(9, 3.2 * len(cmps)), squeeze=False)
    for ax, cmp in zip(axes[:, 0], cmps):
        rpt.draw_replay_timelines(ax, cmp["timelines"])
        ax.set_title(f"trace {cmp['trace']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cmd_replay(args: argparse.Namespace) -> int:
    chunks = [parse_size(c, "--chunk-size") for c in (args.chunk_size or ["2MiB", "20MiB"])]
    # the outputs are written after the whole replay: a path that cannot be written fails now
    if args.json:
        check_output_path(args.json, "--json", "replay.json")
    if args.png:
        check_output_path(args.png, "--png", "replay.png")
    cmps = [_replay_one(p, chunks, not args.no_bisect, args.device, max_bytes=args.max_size)
            for p in args.trace]
    for cmp in cmps:
        print(_table(cmp))
        print()
    if args.json:
        # written beside it, then renamed: Ctrl-C or a full disk leaves no half-written file;
        # allow_nan=False: the rows hold None, never NaN, so the file is standard JSON
        tmp = f"{args.json}.part"
        try:
            with open(tmp, "w") as f:
                json.dump({"comparison": [{k: v for k, v in c.items() if k != "timelines"}
                                          for c in cmps]}, f, indent=1, allow_nan=False)
            os.replace(tmp, args.json)
        except BaseException as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if isinstance(exc, OSError) and exc.filename == tmp:  # name the path the user gave
                raise OSError(exc.errno, exc.strerror, args.json) from None
            raise
        print(f"wrote {args.json}")
    if args.png and _plot(cmps, args.png):
        print(f"wrote {args.png}")
    return 0


def bundled_traces(directory: Optional[str] = None) -> List[str]:
    """The bundled traces: ``directory``, else ``bench/traces`` of the working directory or of
    the source checkout this package runs from."""
    here = Path(__file__).resolve().parent.parent
    for d in ([directory] if directory else [os.path.join(os.getcwd(), "bench", "traces"),
                                              str(here / "bench" / "traces")]):
        found = sorted(glob.glob(os.path.join(d, "*.json.gz")) + glob.glob(os.path.join(d, "*.json")))
        if found:
            return found
    if directory:
        raise FileNotFoundError(f"--traces {directory}: no traces (*.json, *.json.gz) there")
    raise FileNotFoundError("no bundled traces found (looked in ./bench/traces and the source "
                            "checkout); run from the repository root or pass --traces DIR")


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


def _plan_and_replay(args: argparse.Namespace, chunks: Sequence[int]) -> None:
    """Steps 1-2 of the CPU demo: plan a bundled chain with every planner, simulate, and
    replay the fastest plan's allocation trace. The CLI sits above both packages (like the
    autoload hook), so this is the one place vmalloc reaches into the scheduler, lazily."""
    from scheduler import demo

    from .replay.trace import from_json
    chain = demo.find_chain(args.chain)
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
    print(_table(_replay_one(trace, chunks, not args.no_bisect, None)) + "\n")


def _cmd_demo(args: argparse.Namespace) -> int:
    parse_size(args.budget, "--budget")  # bad on the CPU too: say so now, not on a GPU later
    # a --traces that is no directory fails now, not after the planning steps (an existing one
    # without traces is said at step 3, as before: tests/test_demo.py stops the demo that way)
    if args.traces and not os.path.isdir(args.traces):
        raise ValueError(f"--traces {args.traces}: no such directory")
    gpu = False
    if not args.replay_only:
        try:
            import torch
            gpu = torch.cuda.is_available()
        except ImportError:
            gpu = False
    if gpu:
        env = dict(os.environ, VMALLOC="1", VMALLOC_BUDGET=args.budget)
        here = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
        print(f"vmalloc demo: training a 12-layer MLP on the GPU with VMALLOC=1, "
              f"VMALLOC_BUDGET={args.budget}\n")
        return subprocess.call([sys.executable, "-c", _GPU_DEMO], env=env)
    chunks = [2 << 20, 20 << 20]
    if not args.replay_only:
        _plan_and_replay(args, chunks)
    traces = bundled_traces(args.traces)
    print(f"[3/3] replaying the {len(traces)} bundled allocation traces through vmalloc "
          "(host-lazy backend: real page mappings that take no RAM, since a replay never writes) and "
          "a model of PyTorch's caching allocator.\n"
          "phys/req = peak physical / peak requested; frag = 1 - requested/physical (GMLake's "
          "metric); smallest budget = least physical memory the whole trace replays in; IF = "
          "internal fragmentation (seed 003 Eq. 1) and its Eq. 2 bound N_max x chunk.\n",
          flush=True)
    summary = []
    for path in traces:
        cmp = _replay_one(path, chunks, not args.no_bisect, None, max_bytes=args.max_size)
        print(_table(cmp))
        print()
        rows = {r["allocator"]: r for r in cmp["rows"]}
        summary.append((cmp["trace"], rows))
    key = "physical_peak" if args.no_bisect else "min_budget"
    what = "peak physical without a cap" if args.no_bisect else "smallest budget that runs"
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .env import VARIABLES
    env_help = "\n".join(f"  {k} (default {d}): {h}" for k, (d, h) in VARIABLES.items())
    p = argparse.ArgumentParser(
        prog="vmalloc", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="vmalloc: chunked virtual-addressing GPU allocator - reports, replays, demo",
        epilog="environment (read when torch is imported):\n" + env_help)
    sub = p.add_subparsers(dest="cmd", required=True)
    from .replay.files import DEFAULT_MAX_BYTES
    size_help = (f"largest (decompressed) input file read, in bytes or e.g. 1GiB (default "
                 f"{format_size(DEFAULT_MAX_BYTES)}): a bigger one is refused")

    def max_size(text: str) -> int:
        n = parse_size(text, "--max-trace-size")
        if n == 0:
            raise ValueError("--max-trace-size: must be positive, got 0")
        return n
    r = sub.add_parser("report", help="print a saved report (VMALLOC_REPORT=FILE.json or replay --json)")
    r.add_argument("file")
    r.add_argument("--max-trace-size", dest="max_size", type=max_size, default=DEFAULT_MAX_BYTES,
                   help=size_help)
    r.set_defaults(fn=_cmd_report)
    rp = sub.add_parser("replay", help="replay allocation traces: vmalloc vs PyTorch's caching allocator")
    rp.add_argument("trace", nargs="+", help="JSON trace (.json/.json.gz) or PyTorch snapshot pickle")
    rp.add_argument("--chunk-size", action="append",
                    help="vmalloc chunk size (repeatable; default 2MiB and 20MiB)")
    rp.add_argument("--no-bisect", action="store_true", help="skip the smallest-budget search")
    rp.add_argument("--device", type=int, default=None, help="snapshot device (default: busiest)")
    rp.add_argument("--json", help="write the comparison as JSON here")
    rp.add_argument("--png", help="write memory-over-time plots here (needs matplotlib)")
    rp.add_argument("--max-trace-size", dest="max_size", type=max_size,
                    default=DEFAULT_MAX_BYTES, help=size_help)
    rp.set_defaults(fn=_cmd_replay)
    d = sub.add_parser("demo", help="the main job: replay bundled traces (no GPU) or train under a budget (GPU)")
    d.add_argument("--traces", help="directory of traces (default: bench/traces)")
    d.add_argument("--no-bisect", action="store_true", help="skip the smallest-budget search")
    d.add_argument("--replay-only", action="store_true",
                   help="only replay the bundled traces (no planning; no training even with a GPU)")
    d.add_argument("--chain", default="resnet101-i1000-b2",
                   help="bundled chain to plan (bench/chains/NAME.json; default resnet101-i1000-b2)")
    d.add_argument("--fraction", type=float, default=0.4,
                   help="memory limit as a fraction of what storing every activation needs (default 0.4)")
    d.add_argument("--budget", default="4GiB", help="GPU demo: VMALLOC_BUDGET (default 4GiB)")
    d.add_argument("--max-trace-size", dest="max_size", type=max_size, default=DEFAULT_MAX_BYTES,
                   help=size_help)
    d.set_defaults(fn=_cmd_demo)
    args = p.parse_args(argv)
    try:
        rc = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, not at exit
        return rc
    except BrokenPipeError:
        # `vmalloc report F | head`: the reader left; stop quietly as cat and grep do. Point
        # stdout at /dev/null so the interpreter's flush at exit does not complain again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout with no file descriptor: nothing to redirect
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    except KeyboardInterrupt:
        # one line, not a traceback; 130 = 128 + SIGINT, as a shell reports it
        print(f"vmalloc {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, MemoryError, RecursionError) as exc:
        # one line naming the file and the problem (the readers put the file first)
        msg = str(exc) or type(exc).__name__
        if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
            msg = f"{exc.filename}: {exc.strerror}"
        print(f"vmalloc {args.cmd}: {' '.join(msg.split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
