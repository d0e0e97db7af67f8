"""bench/e2e.py's output: the results file's ``meta`` (machine, GPU, driver, torch, date,
command), the table on stdout and the throughput and memory plots."""
from __future__ import annotations

import datetime as _dt
import platform
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch

from bench.common import driver_version
from bench.e2e_grid import Grid
from bench.e2e_job import JobResult
from vmalloc.sizes import format_size


def meta(device: torch.device, command: str) -> Dict[str, Any]:
    gpu, driver = "cpu", None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(0)
        driver = driver_version()
    return {"gpu": gpu, "driver": driver, "torch": torch.__version__,
            "date": _dt.date.today().isoformat(), "command": command,
            "host": platform.node(), "cuda": torch.version.cuda}


def table(rows: Sequence[JobResult]) -> str:
    head = f"{'model':<10} {'method':<22} {'batch':>6} {'throughput':>14} {'peak':>12} {'status':<6} note"
    lines = [head, "-" * len(head)]
    for r in rows:
        tp = f"{r.throughput:,.1f} {r.unit.split('/')[0][:3]}/s" if r.throughput else "-"
        peak = format_size(r.peak_bytes) if r.peak_bytes is not None else "-"
        lines.append(f"{r.model:<10} {r.method:<22} {r.batch_size:>6} {tp:>14} {peak:>12} "
                     f"{r.status:<6} {r.note[:60]}")
    return "\n".join(lines)


def plots(rows: Sequence[JobResult], stem: Path, grid: Grid) -> List[str]:
    if not rows:   # a run stopped (--stop-at) before its first job
        return []
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    for what, key, ylabel in (("throughput", "throughput", "throughput"),
                              ("memory", "peak_bytes", "peak physical memory (GiB)")):
        models = sorted({r.model for r in rows})
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
        for ax, model in zip(axes[0], models):
            for name in dict.fromkeys(r.method for r in rows if r.model == model):
                pts = [(r.batch_size, getattr(r, key)) for r in rows
                       if r.model == model and r.method == name and r.status == "ok"
                       and getattr(r, key) is not None]
                if pts:
                    xs, ys = zip(*pts)
                    ys = [y / 2**30 for y in ys] if key == "peak_bytes" else ys
                    ax.plot(xs, ys, marker="o", label=name)
            budget = grid.budget_for(model)
            if key == "peak_bytes" and budget:
                ax.axhline(budget / 2**30, color="k", ls="--", lw=1, label="budget")
            unit = next((r.unit for r in rows if r.model == model and r.unit), "")
            ax.set(title=model, xlabel="batch size",
                   ylabel=f"{ylabel} ({unit})" if what == "throughput" else ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = f"{stem}-{what}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out
