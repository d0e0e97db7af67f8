"""The ``vmalloc replay`` command: replay allocation traces through vmalloc and the model of
PyTorch's caching allocator, print the side-by-side table of each, and write the comparison as
JSON and memory-over-time plots. ``vmalloc demo`` replays its traces through the same steps."""
from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, List, Optional, Sequence, Union

from .atomic_file import write_atomic
from .env import check_output_path
from .report import comparison_json, draw_replay_timelines, side_by_side_from_json
from .sizes import format_size, parse_size

if TYPE_CHECKING:  # pragma: no cover
    from .replay.trace import Trace


def table(cmp: dict) -> str:
    """The side-by-side table of one replayed trace, with a note under it for every smallest
    budget that is only an upper bound (the caching model's search ran out of trials)."""
    from .replay.run import MAX_SCAN_TRIALS
    out = [side_by_side_from_json(cmp)]
    for r in cmp["rows"]:
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


def cmd_replay(args: argparse.Namespace) -> int:
    """``vmalloc replay TRACE... [--json F] [--png F]``."""
    chunks = [parse_size(c, "--chunk-size") for c in (args.chunk_size or ["2MiB", "20MiB"])]
    # the outputs are written after the whole replay: a path that cannot be written fails now
    if args.json:
        check_output_path(args.json, "--json", "replay.json")
    if args.png:
        check_output_path(args.png, "--png", "replay.png")
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
