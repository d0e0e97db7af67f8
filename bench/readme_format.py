"""Formatting for README.md's generated Results block: fixed number, rate, size and percent
formats, markdown tables, and the context (`Ctx`) the section renderers share: where the results
files are, how the README links to them, and the goals collected for "Goals at a glance".

Only the standard library (the block is generated in CI before anything is built); the output
depends only on the inputs, so rendering twice gives the same bytes.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

Goal = Tuple[str, str, str, str]   # (benchmark, goal, measured, met: yes | **no** | n/a)


# ------------------------------------------------------------------------------ formatting
def num(x: Optional[float], digits: int = 3) -> str:
    """A float with `digits` significant digits, no exponent for everyday magnitudes."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x == 0:
        return "0"
    mag = math.floor(math.log10(abs(x)))
    if -4 <= mag < 7:
        return f"{x:.{max(0, digits - 1 - mag)}f}"
    return f"{x:.{digits - 1}e}"


def rate(x: Optional[float]) -> str:
    """Events per second: 46.1 M, 134.8 k."""
    if x is None:
        return "-"
    for div, unit in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.1f}"


def size(n: Optional[float]) -> str:
    """Bytes in binary units: 3.00 GiB, 512 B."""
    if n is None:
        return "-"
    for div, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def pct(x: Optional[float], sign: bool = True) -> str:
    """A percentage already in percent units."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:+.1f}%" if sign else f"{x:.1f}%"


def g(x: float) -> str:
    """A goal threshold as written in the issue: 2, 0.1, 1.05."""
    return f"{x:g}"


def met(ok: Optional[bool]) -> str:
    """A goal's "met" cell: yes, **no** (bold, so misses stand out), or n/a when not decided."""
    return "n/a" if ok is None else ("yes" if ok else "**no**")


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> List[str]:
    """A markdown table; columns listed in `right` are right-aligned (numbers)."""
    align = ["---:" if i in right else "---" for i in range(len(head))]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


# ------------------------------------------------------------------------------ context
class Ctx:
    """Where the results are and how a README beside `readme_dir` links to them."""

    def __init__(self, results: str, readme_dir: str) -> None:
        self.results = results
        self.readme_dir = readme_dir
        self.goals: List[Goal] = []

    def path(self, name: str) -> str:
        return os.path.join(self.results, name)

    def load(self, name: str) -> Optional[Dict[str, Any]]:
        p = self.path(name)
        if not os.path.exists(p):
            return None
        with open(p) as f:
            return json.load(f)

    def link(self, name: str) -> Optional[str]:
        """A markdown link to results file `name` if it exists."""
        p = self.path(name)
        if not os.path.exists(p):
            return None
        return f"[{name}]({self.rel(name)})"

    def figures(self, names: Sequence[str]) -> List[str]:
        links = [lk for lk in (self.link(n) for n in names) if lk]
        return [f"Figure: {', '.join(links)}."] if links else []

    def rel(self, name: str = "") -> str:
        """`name` in the results folder, relative to the README (forward slashes)."""
        p = os.path.join(self.results, name) if name else self.results
        return os.path.relpath(p, self.readme_dir).replace(os.sep, "/")

    def source(self, name: str) -> str:
        return f"`{self.rel(name)}`"

    def goal(self, bench: str, what: str, measured: str, ok: Optional[bool]) -> None:
        self.goals.append((bench, what, measured, met(ok)))


def reproduce(command: str) -> str:
    """The line naming the command that made a section's results file."""
    return f"Reproduce: `{command.strip()}`"


def meta_line(meta: Dict[str, Any], keys: Sequence[Tuple[str, str]]) -> str:
    """"Recorded: label value, ..." for the `(key, label)` pairs `meta` has; "" if none."""
    parts = [f"{label} {meta[k]}" for k, label in keys if meta.get(k) not in (None, "")]
    return ("Recorded: " + ", ".join(parts) + ".") if parts else ""
