"""The ``vmalloc replay`` command: replay allocation traces through vmalloc and the model of
PyTorch's caching allocator, print the side-by-side table of each, and write the comparison as
JSON and memory-over-time plots. ``vmalloc demo`` replays its traces through the same steps."""
from __future__ import annotations

import argparse
import json
import re
from typing import TYPE_CHECKING, List, Optional, Sequence, Union

from .atomic_file import write_atomic
from .env import check_output_path, output_path
from .report_format import comparison_json, draw_replay_timelines, side_by_side_from_json
from .sizes import format_size, parse_size

if TYPE_CHECKING:  # pragma: no cover
    from .replay.trace import Trace


def table(cmp: dict) -> str:
    """The side-by-side table of one replayed trace, with a note under it for every smallest
    budget that is only an upper bound (the caching model's search ran out of trials)."""
    from .replay.run import MAX_SCAN_TRIALS
    out = [side_by_side_from_json(cmp)]
    peak = max((r["requested_peak"] for r in cmp["rows"]), default=0)
    for r in cmp["rows"]:
        if peak and r.get("chunk_size", 0) > peak:
            out.append(f"note: {r['allocator']}: one chunk ({format_size(r['chunk_size'])}) is "
                       f"more than the trace ever requests at once ({format_size(peak)}): its "
                       "physical figures are mostly that chunk's unused rest")
        if r.get("min_budget") and not r.get("min_budget_exact", True):
            out.append(f"note: {r['allocator']}: smallest budget {format_size(r['min_budget'])} "
                       "is an upper bound (the search stopped after "
                       f"{MAX_SCAN_TRIALS} replays); a smaller one may run")
    return "\n".join(out)


def replay_one(path: Union[str, "Trace"], chunk_sizes: Sequence[int], bisect: bool,
                device: Optional[int], backend: str = "host-lazy",
                max_bytes: Optional[int] = None) -> dict:
    """The comparison of one trace (a file or a :class:`Trace`) as JSON: a row per contender
    (vmalloc at each chunk size, the caching model), and their timelines under ``"timelines"``."""
    from .replay import DEFAULT_MAX_BYTES, compare, default_contenders, load
    trace = load(path, device=device, max_bytes=max_bytes or DEFAULT_MAX_BYTES) \
        if isinstance(path, str) else path
    rows = compare(trace, default_contenders(chunk_sizes, backend), bisect=bisect, timeline=True)
    cmp = comparison_json(trace.name, rows, trace.meta)
    cmp["timelines"] = {r.allocator: r.timeline for r in rows}
    return cmp


def _plot(cmps: List[dict], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(cmps), 1, figsize=(9, 3.2 * len(cmps)), squeeze=False)
    for ax, cmp in zip(axes[:, 0], cmps):
        draw_replay_timelines(ax, cmp["timelines"])
        ax.set_title(f"trace {cmp['trace']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def chunk_sizes(texts: Sequence[str], backend: str = "host-lazy") -> List[int]:
    """The ``--chunk-size`` values in bytes, each tried on the replay's backend first: one
    chunk must map there (a chunk past the address space, 100TiB, would replay as one
    out-of-memory row), and the size must suit the backend's granularity."""
    from .allocator import Allocator
    from .errors import OutOfMemoryError
    out = []
    for text in texts:
        c = parse_size(text, "--chunk-size")
        try:
            with Allocator(backend, c) as a:
                a.free(a.malloc(c))
        except ValueError as exc:   # zero, not a multiple of the granularity
            raise ValueError(f"--chunk-size {text}: {str(exc).split(': ', 1)[-1]}") from None
        except OutOfMemoryError as exc:
            # the allocator's reason, e.g. "cannot reserve 100 TiB of virtual address space"
            why = re.search(r"cannot [^;]*", str(exc))
            raise ValueError(f"--chunk-size {text}: one chunk of {format_size(c)} cannot be "
                             f"mapped on this machine ({why.group(0) if why else exc}); use a "
                             "smaller chunk size") from None
        out.append(c)
    return out


def cmd_replay(args: argparse.Namespace) -> int:
    """``vmalloc replay TRACE... [--json F] [--png F]``."""
    chunks = chunk_sizes(args.chunk_size or ["2MiB", "20MiB"])
    # the outputs are written after the whole replay: a path that cannot be written fails now,
    # and the path checked (~ expanded, made absolute) is the one written
    if args.json:
        check_output_path(args.json, "--json", "replay.json")
        args.json = output_path(args.json)
    if args.png:
        check_output_path(args.png, "--png", "replay.png")
        args.png = output_path(args.png)
    cmps = [replay_one(p, chunks, not args.no_bisect, args.device, max_bytes=args.max_size)
            for p in args.trace]
    for cmp in cmps:
        print(table(cmp))
        print()
    if args.json:
        # whole or not at all: Ctrl-C or a full disk leaves no half-written file;
        # allow_nan=False: the rows hold None, never NaN, so the file is standard JSON
        write_atomic(args.json, json.dumps(
            {"comparison": [{k: v for k, v in c.items() if k != "timelines"} for c in cmps]},
            indent=1, allow_nan=False))
        print(f"wrote {args.json}")
    if args.png and _plot(cmps, args.png):
        print(f"wrote {args.png}")
    return 0
