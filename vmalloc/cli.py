"""The ``vmalloc`` command: its argument parser and the one way every subcommand ends (exit
status, one-line errors). The subcommands: ``report FILE.json`` (:mod:`.cli_report`),
``replay TRACE`` (:mod:`.cli_replay`), ``demo`` (:mod:`.cli_demo`)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, NoReturn, Optional, Sequence

from .cli_demo import cmd_demo
from .cli_replay import cmd_replay
from .cli_report import cmd_report
from .sizes import format_size, parse_size

#: the bundled chain ``vmalloc demo`` plans (scheduler.demo.DEFAULT_CHAIN, not imported here:
#: every command would load the scheduler; tests/test_demo.py keeps the two equal)
DEFAULT_CHAIN = "resnet101-i1000-b2"


def _version() -> str:
    """``vmalloc 0.1.0 (/path/to/vmalloc)``: the version of the package running (pyproject's,
    which tests/test_user_inputs_vmalloc.py keeps ``vmalloc.__version__`` equal to) and where it
    was imported from: a source tree or an installed package."""
    from . import __file__ as init, __version__
    return f"vmalloc {__version__} ({os.path.dirname(os.path.abspath(init))})"


class _Parser(argparse.ArgumentParser):
    """An argument error in one line, ``vmalloc <cmd>: <message>``, exit 2, as every other
    error of the CLI (argparse's own prints the usage block first). The subcommands' parsers
    are of this class too (``add_subparsers`` makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


#: the options that take a byte size: a negative one, ``--budget -4GiB``, is their value, not
#: an unknown option (argparse takes only plain negative numbers, ``-5``, for values)
_SIZE_OPTIONS = ("--chunk-size", "--budget", "--max-trace-size")


def _join_negative_sizes(argv: Sequence[str]) -> List[str]:
    """``--budget -4GiB`` as ``--budget=-4GiB``, so that the size's own check names the value
    (argparse would say "expected one argument"). Nothing after ``--`` is touched."""
    out: List[str] = []
    args = iter(argv)
    for a in args:
        if a == "--":
            out.append(a)
            out.extend(args)
            break
        out.append(a)
        if a in _SIZE_OPTIONS:
            nxt = next(args, None)
            if nxt is None:
                break
            if nxt[:1] == "-" and nxt[1:2].isdigit():   # -4GiB, -2MiB, -5: a value
                out[-1] = f"{a}={nxt}"
            else:
                out.append(nxt)
    return out


def _core_missing(exc: ImportError) -> bool:
    """``vmalloc._core`` cannot be imported (not built, or an installation of other sources:
    :mod:`vmalloc._core_locator` names it so): its message says what to do, in one line."""
    return (exc.name or "").endswith("._core")


def _max_trace_size(text: str) -> int:
    """``--max-trace-size``: a positive byte size. An ``ArgumentTypeError``: argparse shows its
    message (a ValueError's it drops), after the option's name (so parse_size's own
    "--max-trace-size: " prefix goes)."""
    try:
        n = parse_size(text, "--max-trace-size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None
    if n == 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive byte size such as 256MiB, 1GiB or 268435456, got {text!r}")
    return n


def _add_input_options(p: argparse.ArgumentParser, *, bisect: bool) -> None:
    """The options every command that reads files shares: ``--max-trace-size``, and for those
    that replay (``bisect``) ``--no-bisect``."""
    from .replay.files import DEFAULT_MAX_BYTES
    if bisect:
        p.add_argument("--no-bisect", action="store_true", help="skip the smallest-budget search")
    p.add_argument("--max-trace-size", dest="max_size", type=_max_trace_size,
                   default=DEFAULT_MAX_BYTES,
                   help=f"largest (decompressed) input file read, in bytes or e.g. 1GiB (default "
                        f"{format_size(DEFAULT_MAX_BYTES)}): a bigger one is refused")


def _parser() -> _Parser:
    """The ``vmalloc`` parser; each subcommand's sets ``fn`` (what runs it) and ``parser``
    (itself: an unknown argument is said in its name)."""
    from .env import VARIABLES
    env_help = "\n".join(f"  {k} (default {d}): {h}" for k, (d, h) in VARIABLES.items())
    p = _Parser(
        prog="vmalloc", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="vmalloc: chunked virtual-addressing GPU allocator - reports, replays, demo",
        epilog="environment (read when torch is imported):\n" + env_help)
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="print a saved report (VMALLOC_REPORT=FILE.json or replay --json)")
    r.add_argument("file")
    _add_input_options(r, bisect=False)
    r.set_defaults(fn=cmd_report, parser=r)
    rp = sub.add_parser("replay", help="replay allocation traces: vmalloc vs PyTorch's caching allocator")
    rp.add_argument("trace", nargs="+", help="JSON trace (.json/.json.gz) or PyTorch snapshot pickle")
    rp.add_argument("--chunk-size", action="append",
                    help="vmalloc chunk size (repeatable; default 2MiB and 20MiB)")
    rp.add_argument("--device", type=int, default=None, help="snapshot device (default: busiest)")
    rp.add_argument("--json", help="write the comparison as JSON here")
    rp.add_argument("--png", help="write memory-over-time plots here (needs matplotlib)")
    _add_input_options(rp, bisect=True)
    rp.set_defaults(fn=cmd_replay, parser=rp)
    d = sub.add_parser("demo", help="the main job: replay bundled traces (no GPU) or train under a budget (GPU)")
    d.add_argument("--traces", help="directory of traces (default: bench/traces)")
    d.add_argument("--replay-only", action="store_true",
                   help="only replay the bundled traces (no planning; no training even with a GPU)")
    d.add_argument("--chain", default=DEFAULT_CHAIN,
                   help="bundled chain to plan (bench/chains/NAME.json; default %(default)s)")
    d.add_argument("--fraction", type=float, default=0.4,
                   help="memory limit as a fraction of what storing every activation needs (default 0.4)")
    d.add_argument("--budget", default="4GiB", help="GPU demo: VMALLOC_BUDGET (default 4GiB)")
    _add_input_options(d, bisect=True)
    d.set_defaults(fn=cmd_demo, parser=d)
    return p


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; every way it can end is an exit status, and every error one
    line on stderr naming the command."""
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
    except ImportError as exc:
        if not _core_missing(exc):
            raise   # a bug, or a dependency missing: its traceback says where
        print(f"vmalloc {args.cmd}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (ValueError, OSError, RuntimeError, MemoryError, RecursionError) as exc:
        # one line naming the file and the problem (the readers put the file first)
        msg = str(exc) or type(exc).__name__
        if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
            msg = f"{exc.filename}: {exc.strerror}"
        print(f"vmalloc {args.cmd}: {' '.join(msg.split())}", file=sys.stderr)
        return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, extra = _parser().parse_known_args(
        _join_negative_sizes(sys.argv[1:] if argv is None else argv))
    if extra:   # said by the command's parser, so that the message names the command
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
