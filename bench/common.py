"""Shared bench helpers: a --quick flag, a table on stdout, JSON (and PNG) in bench/results/."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run as `python bench/<name>.py` from a checkout
    sys.path.insert(0, ROOT)


def parse_args(description: str, argv: Optional[Sequence[str]] = None,
               extra: Optional[callable] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a smaller run (seconds, for CI smoke tests)")
    p.add_argument("--out", default=RESULTS, help="where JSON/PNG go (default bench/results)")
    if extra is not None:
        extra(p)
    return p.parse_args(argv)


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities (no plan, no bound) as None: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(name: str, data: Dict[str, Any], out: str = RESULTS) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(finite(data), f, indent=1, default=float, allow_nan=False)
        f.write("\n")
    return path


def print_table(rows: List[Dict[str, Any]], columns: Optional[List[str]] = None,
                title: str = "") -> None:
    """Rows of dicts as an aligned text table (floats with 4 significant digits)."""
    if not rows:
        return
    columns = columns or list(rows[0])

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    if title:
        print(title)
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    print()


def save_png(fig: Any, name: str, out: str = RESULTS) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def driver_version() -> Optional[str]:
    """The NVIDIA driver's version (nvidia-smi), or None where there is none to ask."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def run_meta(command: str, device: str = "cpu") -> Dict[str, Any]:
    """What a results file is tagged with: machine, GPU (or "cpu"), torch (and transformers)
    version, date, command; ``device_tag`` names the file (``cpu`` or the GPU's name)."""
    import datetime
    import platform
    import torch
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    meta: Dict[str, Any] = {"machine": platform.machine(), "host_cpus": os.cpu_count(),
                            "device": device, "gpu": gpu, "torch": torch.__version__,
                            "date": datetime.date.today().isoformat(), "command": command,
                            "device_tag": "cpu" if gpu == "cpu" else gpu.replace(" ", "_")}
    if device == "cuda":
        meta["driver"] = driver_version()
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    return meta
