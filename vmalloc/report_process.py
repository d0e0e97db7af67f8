"""Which process writes which report: under torchrun (issue 15) a launcher and one process per
rank start, ``multiprocessing`` workers and forked children follow, and every one of them
inherits ``VMALLOC_REPORT``. Here: each process's rank and identity (the report's ``"process"``
key), whether it is torchrun's launcher (which writes none), and the path its exit report goes to.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Mapping, Optional, Set, Tuple

from .env import is_report_stream


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
      it must not overwrite that rank's report with its own);
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
    # the pid tells apart a multiprocessing child from its parent, and processes whose rank
    # variable cannot be read
    by_pid = _is_child_process() or _rank_unreadable(env)
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
