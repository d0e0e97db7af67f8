"""The ``VMALLOC*`` environment variables, read once and validated.

Every size goes through :func:`vmalloc.sizes.parse_size` with the variable's name, so a
malformed value is an error that names the variable (never a silent default). This module
imports nothing heavy: the ``.pth`` autoload imports it at interpreter start.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from .sizes import CUDA_GRANULARITY, check_budget_holds_a_chunk, parse_chunk_size, parse_size

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

#: Every variable vmalloc reads, with its default, for the README and ``vmalloc --help``.
VARIABLES = {
    "VMALLOC": ("0", "1/true/yes/on registers vmalloc as PyTorch's CUDA allocator when torch is imported"),
    "VMALLOC_CHUNK_SIZE": ("2MiB", "physical chunk size (a multiple of 2 MiB, the CUDA granularity)"),
    "VMALLOC_BUDGET": ("none", "cap on physical bytes per device; 0 or unset = no cap"),
    "VMALLOC_WINDOW": ("unset", "turns on the byte-window swap runtime with this window (e.g. 2GiB)"),
    "VMALLOC_REPORT": ("unset", "where the fragmentation report goes at exit: a path (.json = JSON, "
                                "else text; PATH.png beside it), '-' or 'stdout' for stdout, "
                                "'stderr'"),
}


@dataclass(frozen=True)
class EnvConfig:
    """What the environment asks for. ``None`` means "not set" (use the default)."""

    enabled: bool = False
    chunk_size: Optional[int] = None
    budget: Optional[int] = None
    window: Optional[int] = None
    report: Optional[str] = None

    @property
    def active(self) -> bool:
        """True when anything must happen at ``import torch``."""
        return self.enabled or self.window is not None


def parse_flag(value: str, name: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (case-insensitive); anything else is an error."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}: expected 1 or 0 (or true/false, yes/no, on/off), got {value!r}")


def _size(env: Mapping[str, str], name: str, allow_zero: bool) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    n = parse_size(raw, name)
    if n == 0:
        if allow_zero:
            return None  # 0 = no cap, as in the C++ Config
        raise ValueError(f"{name}: must be a positive byte size, got {raw!r}")
    return n


#: ``VMALLOC_REPORT`` values that name a stream, not a path: ``-`` and ``stdout`` (stdout) and
#: ``stderr``, in any case, as :func:`is_report_stream` compares them (a file of such a name is
#: given as ``./stdout``)
REPORT_STREAMS = ("-", "stdout", "stderr")


def report_target(raw: str) -> str:
    """The ``VMALLOC_REPORT`` value ``raw`` as the exit report reads it: ``stdout`` (any case)
    as ``-``, the one name of stdout there; anything else unchanged."""
    return "-" if raw.lower() == "stdout" else raw


def is_report_stream(target: str) -> bool:
    """True when the report destination ``target`` is one of :data:`REPORT_STREAMS`; the one
    check of the start-up validation and of where the exit report goes."""
    return target.lower() in REPORT_STREAMS


def check_report_target(target: str, name: str = "VMALLOC_REPORT") -> None:
    """A report path must be writable at exit: its directory must exist and be writable, and
    the path must not be a directory nor a read-only file. Checked at start-up, since the report
    is written at exit (too late to say). The directory is what is checked, so the per-rank
    names the report derives beside the path stay valid."""
    if is_report_stream(target):
        return
    check_output_path(target, name)


def check_output_path(target: str, name: str, example: str = "vmalloc-report.txt") -> None:
    """Raise ``ValueError`` naming ``name`` and ``target`` unless a file can be written there:
    for outputs written after long work (an exit report, ``vmalloc replay --json``), which
    must fail before that work, not after it."""
    if "\0" in target:
        raise ValueError(f"{name}: {target!r} is not a path (it holds a NUL byte)")
    path = os.path.abspath(os.path.expanduser(target))
    if os.path.isdir(path) or target.endswith(os.sep):
        raise ValueError(f"{name}: {target!r} is a directory; give a file name such as "
                         f"{os.path.join(target, example)!r}")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"{name}: {target!r}: the directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: {target!r}: the directory {parent!r} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{name}: {target!r} exists and is not writable")


def _chunk_size(env: Mapping[str, str], enabled: bool) -> Optional[int]:
    """``VMALLOC_CHUNK_SIZE``: a byte size; with ``VMALLOC=1`` also a multiple of 2 MiB. Without
    it the chunk size is unused (the autoload says it is ignored), so, as the budget's check
    against one chunk, the granularity is not checked: a leftover value stops no program."""
    n = _size(env, "VMALLOC_CHUNK_SIZE", allow_zero=False)
    if n is None or not enabled:
        return n
    return parse_chunk_size(env["VMALLOC_CHUNK_SIZE"], "VMALLOC_CHUNK_SIZE")


def output_path(target: str) -> str:
    """``target`` as the absolute path it names now (``~`` expanded, relative to the current
    directory): what :func:`check_output_path` checked, kept for the write that comes after long
    work, which a later ``os.chdir`` (Hydra's run directories) must not move elsewhere."""
    return os.path.abspath(os.path.expanduser(target))


def read_env(environ: Optional[Mapping[str, str]] = None) -> EnvConfig:
    """Read and validate the ``VMALLOC*`` variables; raise ``ValueError`` naming a bad one.
    A ``VMALLOC_REPORT`` path comes back absolute (:func:`output_path`)."""
    env = os.environ if environ is None else environ
    report = env.get("VMALLOC_REPORT")
    if report is not None:
        report = report.strip()
        if report == "":
            report = None
        else:
            report = report_target(report)
            check_report_target(report)
            if not is_report_stream(report):
                report = output_path(report)
    enabled = parse_flag(env.get("VMALLOC", ""), "VMALLOC")
    chunk_size = _chunk_size(env, enabled)
    budget = _size(env, "VMALLOC_BUDGET", allow_zero=True)
    if enabled:  # (without VMALLOC=1 the budget is the swap runtime's, or unused)
        check_budget_holds_a_chunk(budget, chunk_size or CUDA_GRANULARITY, "VMALLOC_BUDGET",
                                   "VMALLOC_CHUNK_SIZE")
    return EnvConfig(
        enabled=enabled,
        chunk_size=chunk_size,
        budget=budget,
        window=_size(env, "VMALLOC_WINDOW", allow_zero=False),
        report=report,
    )
