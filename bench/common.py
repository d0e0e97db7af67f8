"""Shared bench helpers: a --quick flag, a table on stdout, JSON (and PNG) in bench/results/,
where a run writes (``output_dir``: a --quick run writes only with --out), and the checks of the
scripts' flags (``type=`` functions: a bad value exits 2 before any work), and what a results
file is tagged with (``run_meta``; ``reproduce_command``: its command, less ``--stop-at``)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, NoReturn, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ROOT = os.path.dirname(HERE)
if __name__ == "common":  # run as `python bench/<name>.py` from a checkout (bench/ is first)
    import checkout
    checkout.on_path()


def parse_args(description: str, argv: Optional[Sequence[str]] = None,
               extra: Optional[callable] = None) -> argparse.Namespace:
    """The flags every such script takes (--quick, --out DIR) and ``extra``'s; ``args.out`` is
    ``output_dir``'s answer: the folder to write into, None for a --quick run without --out."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a smaller run (seconds, for CI smoke "
                   "tests; writes nothing unless --out)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for the JSON/PNG (default bench/results; --quick: none)")
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    args.out = output_dir(args.quick, args.out)
    return args


# ------------------------------------------------------------------ where a run writes
# bench/results holds full runs: the README's Results section is generated from it
# (bench/readme_results.py). A --quick run (the CI smoke run) writing there would leave a dirty
# tree and, once committed, smoke-run numbers in the README. (bench/e2e.py keeps its own
# rule: its committed file is the --smoke run, and its --quick is the GPU run.)

def output_dir(quick: bool, out: Optional[str], default: Any = RESULTS) -> Optional[Any]:
    """Where a run writes its results: ``out`` (the --out given) when there is one; else
    None for a ``--quick`` run (it prints its table and writes nothing), else ``default``
    (bench/results, or the script's own file there)."""
    if out is not None:
        return out
    return None if quick else default


def say_nothing_written(out_flag: str = "--out DIR") -> None:
    """The line a --quick run without --out ends with (see ``output_dir``)."""
    print(f"\n--quick without --out: nothing written (bench/results holds full runs); pass "
          f"{out_flag} to keep this run's results")


# ------------------------------------------------------------------ flag checks
# argparse ``type=`` functions: a bad value ends the run at once, before anything is measured
# or written, with exit status 2 and "argument --flag: ..." naming the flag and the value.

class UsageError(SystemExit):
    """Exit status 2 (as argparse's for a bad flag) whose ``str`` is the message: a caller
    that catches it (a test, a driver script) can read what was wrong."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class BadValueError(UsageError, ValueError):
    """A ``UsageError`` that is also the ``ValueError`` a script's ``main`` raised for that
    value before it was checked up front (callers that catch ``ValueError`` still do)."""


def usage_error(message: str, prog: Optional[str] = None,
                parser: Optional[argparse.ArgumentParser] = None,
                value_error: bool = False) -> NoReturn:
    """End the run as argparse does for a bad flag: (``parser``'s usage line and)
    ``prog: error: message`` on stderr, exit 2. For the checks a ``type=`` cannot make (a
    value against another flag, a folder's content, a list of names)."""
    if parser is not None:
        parser.print_usage(sys.stderr)
        prog = prog or parser.prog
    prog = prog or os.path.basename(sys.argv[0] or "bench")
    line = f"{prog}: error: {message}"
    print(line, file=sys.stderr)
    raise (BadValueError if value_error else UsageError)(line)


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """A count (steps, threads, slots): a whole number >= 1."""
    return _whole(text, 1)


def nonnegative_int(text: str) -> int:
    """A whole number >= 0 (0: off)."""
    return _whole(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, bytes/s)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """A byte size > 0 as ``vmalloc.sizes.parse_size`` reads it ("16GiB", "40MB", 1048576)."""
    from vmalloc.sizes import parse_size
    try:
        value = parse_size(text, "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("size: ", "", 1)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a byte size must be > 0, got {text!r}")
    return value


def torch_device(*allowed: str, index: bool = True):
    """A ``type=`` for ``--device``: a name ``torch.device`` reads, of a kind in ``allowed``
    (default cpu and cuda), and for cuda one this machine has. Returns the text as given.
    ``index=False``: the bare kind only (``cuda``, not ``cuda:1``)."""
    kinds = allowed or ("cpu", "cuda")

    def check(text: str) -> str:
        import torch
        try:
            dev = torch.device(text)
        except (RuntimeError, ValueError, TypeError):
            raise argparse.ArgumentTypeError(f"not a device: {text!r} (expected one of: "
                                             f"{', '.join(kinds)})") from None
        if dev.type not in kinds or (not index and text != dev.type):
            raise argparse.ArgumentTypeError(f"{text!r}: expected one of: {', '.join(kinds)}"
                                             + ("" if index else " (pick a GPU with "
                                                "CUDA_VISIBLE_DEVICES)"))
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device on this machine "
                                                 "(torch.cuda.is_available() is False)")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise argparse.ArgumentTypeError(f"{text!r}: this machine has "
                                                 f"{torch.cuda.device_count()} CUDA device(s)")
        return text
    check.__name__ = "device"
    return check


def existing_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r}: no such directory")
    return text


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    return text


#: What ``vmalloc.replay.load`` reads: contract-2 JSON traces (optionally gzip'ed) and PyTorch
#: memory snapshots (pickle or JSON).
TRACE_SUFFIXES = (".json", ".json.gz", ".pickle", ".pkl", ".pickle.gz", ".pkl.gz")


def trace_files(path: str) -> List[str]:
    """The trace files ``path`` names: the file itself, or a folder's ``TRACE_SUFFIXES`` files
    (sorted). ``ValueError`` (saying why) when there are none."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError("no such file or directory")
    found = sorted(os.path.join(path, n) for n in os.listdir(path)
                   if n.endswith(TRACE_SUFFIXES) and os.path.isfile(os.path.join(path, n)))
    if not found:
        raise ValueError("no trace files there (" + ", ".join("*" + s for s in TRACE_SUFFIXES) + ")")
    return found


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
    # written whole, then renamed: a kill mid-write leaves the last whole file
    from vmalloc.atomic_file import write_atomic   # (lazily, as parse_size above)
    write_atomic(path, json.dumps(finite(data), indent=1, default=float, allow_nan=False) + "\n")
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


def without_stop_at(argv: Sequence[str]) -> List[str]:
    """``argv`` less ``--stop-at EPOCH`` / ``--stop-at=EPOCH``: the device call's deadline, not
    part of how to reproduce a run (repeated later, it would stop at once and measure nothing)."""
    out: List[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--stop-at":
            skip = True   # and its value, the next argument
        elif not arg.startswith("--stop-at="):
            out.append(arg)
    return out


def reproduce_command(script: str, argv: Sequence[str]) -> str:
    """The command a results file records (``meta.command``, the README's "Reproduce:"):
    ``python SCRIPT ARGS`` with the run's own flags, ``--stop-at`` left out."""
    return " ".join(["python", script, *without_stop_at(argv)])


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
