"""Which process writes which report: under torchrun (issue 15) a launcher and one process per
rank start, ``multiprocessing`` workers, forked children and plain subprocesses follow, and every
one of them inherits ``VMALLOC_REPORT``. Here: each process's rank and identity (the report's
``"process"`` key), whether it is torchrun's launcher (which writes none), which process owns a
report path (:func:`claim_report`, when torch is imported) and the path its exit report goes to.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Dict, Mapping, MutableMapping, Optional, Set, Tuple

from .env import is_report_stream


#: Set when torch is imported by the process that owns the report of its rank (``"<pid>:<rank>"``,
#: the rank empty when there is none) and inherited by every process it starts: a descendant of
#: the same rank finds another pid there, so its report is named by its pid (:func:`report_path`).
OWNER_VARIABLE = "VMALLOC_REPORT_OWNER"

#: the launch variables read here, with the least value each can take
_MINIMUM = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1}
_warned: Set[Tuple[str, str]] = set()


def _env_int(environ: Mapping[str, str], name: str) -> Optional[int]:
    """``name`` as an int; ``None`` when unset or empty. A value that is not an integer (or is
    below the least the variable can take) is ``None`` too, said once on stderr: it is read at
    exit for the report, which must not be lost to it."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is not None and value >= _MINIMUM[name]:
        return value
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        then = "" if name == "WORLD_SIZE" else " (a VMALLOC_REPORT file then names the pid)"
        print(f"vmalloc: {name}={raw!r} is not an integer >= {_MINIMUM[name]}; ignored{then}",
              file=sys.stderr, flush=True)
    return None


def _rank_unreadable(environ: Mapping[str, str]) -> bool:
    """A rank variable is set but neither gives a rank: several processes may share it."""
    return process_rank(environ) is None and any(environ.get(n, "").strip()
                                                  for n in ("RANK", "LOCAL_RANK"))


def process_rank(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """This process's rank: ``RANK`` (torchrun, torch.distributed, most MPI launchers), else
    ``LOCAL_RANK``; ``None`` when neither is set (or neither is an integer >= 0: said once on
    stderr)."""
    env = os.environ if environ is None else environ
    rank = _env_int(env, "RANK")
    return rank if rank is not None else _env_int(env, "LOCAL_RANK")


def is_launcher(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True in torchrun's own process (the elastic agent that starts the ranks): it has no rank
    of its own, runs ``torch.distributed.run``/``launch`` as its main program, and trains
    nothing, yet imports torch (so the autoload's exit report would run there too)."""
    if process_rank(environ) is not None:
        return False  # every worker torchrun starts has RANK set
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name in ("torch.distributed.run", "torch.distributed.launch"):
        return True   # python -m torch.distributed.run ...
    argv = sys.argv or [""]
    prog = os.path.basename(argv[0])
    if prog in ("torchrun", "torchrun.exe"):
        return True   # the torchrun console script
    # `accelerate launch` drives the same elastic agent. (Whether the agent's module is merely
    # imported says nothing: HF's Trainer imports it in every training process.)
    return prog in ("accelerate", "accelerate.exe") and argv[1:2] == ["launch"]


def _is_child_process() -> bool:
    """A ``multiprocessing`` child (spawn/fork workers): it shares its parent's environment."""
    try:
        import multiprocessing
        return multiprocessing.parent_process() is not None
    except Exception:  # noqa: BLE001 - old Pythons, odd embeddings: treat as a lone process
        return False


#: :data:`OWNER_VARIABLE` as vmalloc writes it (ASCII digits: ``str.isdigit`` passes a '²',
#: which ``int`` refuses)
_OWNER_FORM = re.compile(r"([0-9]+):([0-9]*)")


def _owner(environ: Mapping[str, str]) -> Optional[Tuple[int, Optional[int]]]:
    """``(pid, rank)`` of :data:`OWNER_VARIABLE`; ``None`` when unset or not of that form (said
    once on stderr: vmalloc writes only that form, so another value was set by hand or mangled
    on the way; it is treated as unset, and the process claims the path itself)."""
    raw = environ.get(OWNER_VARIABLE, "")
    form = _OWNER_FORM.fullmatch(raw.strip())
    if form:
        return int(form.group(1)), (int(form.group(2)) if form.group(2) else None)
    if raw.strip() and (OWNER_VARIABLE, raw) not in _warned:
        _warned.add((OWNER_VARIABLE, raw))
        print(f"vmalloc: {OWNER_VARIABLE}={raw!r} is not <pid>:<rank>, the form vmalloc sets it "
              "in (it is vmalloc's own, inherited from the process that owns the report path); "
              "ignored, as if unset: unset it", file=sys.stderr, flush=True)
    return None


def check_launch_variables(environ: Optional[Mapping[str, str]] = None) -> None:
    """Say at start-up (the autoload, when ``VMALLOC_REPORT`` is set), not only at exit, what
    the report would ignore: a ``RANK``, ``LOCAL_RANK`` or ``WORLD_SIZE`` that is not an integer
    >= its least value, and a :data:`OWNER_VARIABLE` not of vmalloc's form; one stderr line
    each, never again at exit. None stops the program: the report is written all the same."""
    env = os.environ if environ is None else environ
    for name in _MINIMUM:
        _env_int(env, name)
    _owner(env)


def claim_report(environ: Optional[MutableMapping[str, str]] = None,
                 pid: Optional[int] = None) -> None:
    """Called when torch is imported in a process with ``VMALLOC_REPORT`` set (the autoload's
    ``on_torch_import``): from then on the process writes an exit report, and the processes it
    starts must not write theirs to the same path. Unless a process this one descends from owns
    the report of the same rank already (a driver that imported torch, then runs the training
    with ``subprocess.run``), this process owns it: :data:`OWNER_VARIABLE` names it, for the
    processes it starts. A rank differing from the owner's owns its own. A launcher
    (:func:`is_launcher`) writes no report, so it claims nothing: the process it starts (one
    rank-less process under ``accelerate launch``) owns the path, as does the training script of
    a driver that never imports torch.

    ``pid``: the process that owns the path if this one claims it; default this one. The
    autoload passes the pid of the process this interpreter started in: a child of a bare
    ``os.fork()`` made before torch was imported (the parent had claimed nothing yet) so names
    its parent, whose report is written at the path if it imports torch too, and its own report
    is named by its pid."""
    env = os.environ if environ is None else environ
    if is_launcher(env):
        return
    pid = os.getpid() if pid is None else pid
    rank = process_rank(env)
    owner = _owner(env)
    if owner is None or owner[1] != rank:
        env[OWNER_VARIABLE] = f"{pid}:{'' if rank is None else rank}"


def _descends_from_owner(environ: Mapping[str, str], pid: int, rank: Optional[int]) -> bool:
    """Another process owns this rank's report path: this one was started (or forked) by it."""
    owner = _owner(environ)
    return owner is not None and owner[0] != pid and owner[1] == rank


def process_identity(device: Optional[int] = None,
                     environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Who writes a report: rank, local rank and world size (``None`` outside a distributed
    launch), pid, host and device."""
    env = os.environ if environ is None else environ
    import socket
    return {"rank": process_rank(env), "local_rank": _env_int(env, "LOCAL_RANK"),
            "world_size": _env_int(env, "WORLD_SIZE"), "pid": os.getpid(),
            "host": socket.gethostname(), "device": device}


def report_path(target: str, environ: Optional[Mapping[str, str]] = None,
                pid: Optional[int] = None) -> Optional[str]:
    """Where this process writes the ``VMALLOC_REPORT`` exit report; ``None``: write none.

    - ``-`` / ``stderr``: unchanged (each report names its rank and pid on its second line, "process: ...");
    - the launcher (:func:`is_launcher`) writes no report;
    - a path with ``{rank}`` or ``{pid}`` in it: filled in (``{rank}`` is the pid's
      ``pid<N>`` when there is no rank);
    - under a distributed launch (``RANK`` or ``LOCAL_RANK`` set) the rank goes before the
      extension: ``frag.json`` -> ``frag.rank0.json``, ``frag.txt`` -> ``frag.rank1.txt``;
    - in a ``multiprocessing`` child, the pid too: ``frag.pid4242.json``, and under a rank
      ``frag.rank0.pid4242.json`` (a spawned DataLoader worker inherits its rank's ``RANK``:
      it must not overwrite that rank's report with its own); the same in any process started
      or forked by the owner of its rank's report (:func:`claim_report`, once it imported
      torch): a training script a driver runs with ``subprocess.run``, a child of a bare
      ``os.fork()`` (also one forked before torch was imported: :func:`claim_report`'s ``pid``);
    - with ``RANK``/``LOCAL_RANK`` set to something that is not an integer >= 0 (said on
      stderr): the pid, ``frag.pid4242.json``, since such processes cannot be told apart;
    - a lone process writes the path as given.
    """
    env = os.environ if environ is None else environ
    if is_launcher(env):
        return None
    if is_report_stream(target):
        return target
    pid = os.getpid() if pid is None else pid
    rank = process_rank(env)
    # the pid tells apart a child (multiprocessing, subprocess, fork) from its parent, and
    # processes whose rank variable cannot be read
    by_pid = _is_child_process() or _rank_unreadable(env) or _descends_from_owner(env, pid, rank)
    if "{rank}" in target or "{pid}" in target:
        path = target.replace("{rank}", str(rank) if rank is not None else f"pid{pid}") \
                     .replace("{pid}", str(pid))
        if not by_pid or "{pid}" in target or rank is None:
            return path
        root, ext = os.path.splitext(path)
        return f"{root}.pid{pid}{ext}"
    tags = ([f"rank{rank}"] if rank is not None else []) + ([f"pid{pid}"] if by_pid else [])
    if not tags:
        return target
    root, ext = os.path.splitext(target)
    return f"{root}.{'.'.join(tags)}{ext}"
