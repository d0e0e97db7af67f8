"""Replace rows of a bench/e2e.py results file with the same jobs measured again, in one call.

    python bench/e2e_remeasure.py bench/results/e2e-<GPU>-quick.json NEW.json --why "..."

NEW is the file of a later `bench/e2e.py --methods ... --models ... --out NEW.json` on the
same GPU, budget and step count: a runtime changed, so its rows (and plain training's, as
the baseline, measured in the same call) are measured again side by side. Each of NEW's rows
replaces the row of the same model, method and batch (or joins the file); the file's
``meta.remeasured`` lists every such replacement (rows, command, date, driver, torch, why, the
earlier throughputs), so the README says which rows are newer than the rest of the grid.
``bench/e2e.py --resume`` keeps that list for the rows it keeps (``carried``).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __name__ == "__main__":  # run as a script (bench/ is first on sys.path)
    import checkout
    checkout.on_path()
# (light at import: bench/readme_runtime.py reads ``entries``; the writing and plotting
# imports are in main)

Row = Dict[str, Any]


def label(row: Row) -> str:
    return f"{row['model']} {row['method']} b{row['batch_size']}"


def entries(meta: Dict[str, Any]) -> List[Dict[str, Any]]:
    """meta.remeasured as a list (one session wrote a single entry as a dict)."""
    got = meta.get("remeasured") or []
    return [got] if isinstance(got, dict) else list(got)


def mismatch(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    """What makes NEW's rows incomparable with the file's: another GPU, budget or step count."""
    out = []
    if old.get("gpu") != new.get("gpu"):
        out.append(f"GPU {new.get('gpu')!r} (the file's: {old.get('gpu')!r})")
    for key in ("budget", "steps"):
        a, b = (old.get("grid") or {}).get(key), (new.get("grid") or {}).get(key)
        if a is not None and b is not None and a != b:
            out.append(f"{key} {b} (the file's: {a})")
    return out


def merge(doc: Dict[str, Any], new: Dict[str, Any], why: str) -> Dict[str, Any]:
    """DOC with NEW's rows in place of its rows for the same jobs, and the entry saying so."""
    meta, new_meta = dict(doc.get("meta") or {}), new.get("meta") or {}
    differ = mismatch(meta, new_meta)
    if differ:
        raise ValueError("measured under " + ", ".join(differ) + ": its rows cannot stand "
                         "in one table with the file's")
    rows: List[Row] = list(doc.get("results") or [])
    fresh: List[Row] = list(new.get("results") or [])
    if not fresh:
        raise ValueError("has no rows")
    at = {label(r): i for i, r in enumerate(rows)}
    earlier: Dict[str, Optional[float]] = {}
    for r in fresh:
        i = at.get(label(r))
        if i is None:
            rows.append(r)
        else:
            tp = rows[i].get("throughput")
            earlier[label(r)] = round(tp, 1) if isinstance(tp, (int, float)) else tp
            rows[i] = r
    # (where NEW was written is the device machine's business: the rows live in the file now)
    command = re.sub(r"(--out[ =])\S+", r"\1FILE", str(new_meta.get("command", "")))
    entry = {"rows": [label(r) for r in fresh], "command": command,
             **{k: new_meta.get(k) for k in ("date", "driver", "torch")},
             "why": why, "earlier_throughput": earlier}
    meta["remeasured"] = entries(meta) + [entry]
    return {**doc, "meta": meta, "results": rows}


def earlier_meta(path: Path) -> Dict[str, Any]:
    """The meta of the results file at PATH; none for a missing or unreadable one (--resume
    has already refused a file it cannot read)."""
    try:
        got = json.loads(path.read_text()).get("meta")
    except (OSError, ValueError, AttributeError):
        return {}
    return got if isinstance(got, dict) else {}


def carried(meta: Any, kept: Sequence[Any]) -> List[Dict[str, Any]]:
    """The remeasured entries of an earlier file's META for the rows a --resume KEPT
    (JobResult or row dicts): a row run again is no longer the re-measured one."""
    if not isinstance(meta, dict):
        return []
    have = {label(r if isinstance(r, dict) else vars(r)) for r in kept}
    out = []
    for e in entries(meta):
        rows = [x for x in e.get("rows", []) if x in have]
        if rows:
            out.append({**e, "rows": rows})
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path, help="the results file whose rows are replaced")
    p.add_argument("new", type=Path, help="bench/e2e.py's file of the jobs measured again")
    p.add_argument("--why", required=True, help="what changed, and why these rows")
    args = p.parse_args(argv)
    from vmalloc.atomic_file import write_atomic

    docs = []
    for path in (args.file, args.new):
        try:
            docs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path}: cannot read a results file ({exc})") from None
    try:
        out = merge(docs[0], docs[1], args.why)
    except ValueError as exc:
        raise SystemExit(f"{args.new}: {exc}") from None
    write_atomic(args.file, json.dumps(out, indent=1) + "\n")
    print(f"{args.file}: replaced {', '.join(out['meta']['remeasured'][-1]['rows'])}")
    _replot(args.file, out)
    return 0


def _replot(path: Path, doc: Dict[str, Any]) -> None:
    """The file's throughput and memory plots, drawn again from its rows."""
    from bench.e2e_grid import Grid
    from bench.e2e_job import JobResult
    from bench.e2e_output import plots

    rows = [JobResult.of_row(r) for r in doc["results"]]
    grid = doc["meta"].get("grid") or {}
    made = plots(rows, path.with_suffix(""), Grid({}, [], grid.get("budget"), 0, 0))
    if made:
        print("redrew " + ", ".join(made))


if __name__ == "__main__":
    raise SystemExit(main())
