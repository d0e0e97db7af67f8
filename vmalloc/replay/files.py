"""Finding and reading trace files: bounded, streamed, and every bad file answered with one
``TraceFileError`` naming the file and the problem.

:func:`trace_files_in` lists a folder's traces. A file is read in chunks (decompressed on the
fly when gzip'ed) and refused as soon as it holds more than ``max_bytes`` (default
``DEFAULT_MAX_BYTES``; ``vmalloc replay --max-trace-size`` raises it): a gzip bomb or
``/dev/zero`` costs at most that much memory. The content is then a contract-2 JSON trace or a
PyTorch snapshot (JSON or a pickle of plain containers only).
"""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import zlib
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

from .snapshot import from_snapshot
from .trace import Trace, from_json

PathLike = Union[str, "os.PathLike[str]"]
DEFAULT_MAX_BYTES = 256 << 20  # decompressed bytes read from one trace file
_CHUNK = 1 << 20
#: What :func:`load` reads, by file name: contract-2 JSON traces (optionally gzip'ed) and PyTorch
#: memory snapshots (pickle or JSON, optionally gzip'ed)
TRACE_SUFFIXES = (".json", ".json.gz", ".pickle", ".pkl", ".pickle.gz", ".pkl.gz")
JSON_TRACE_SUFFIXES = (".json", ".json.gz")   # the project's own traces (bench/traces)


class TraceFileError(ValueError):
    """A trace file that cannot be used; the message starts with the file's name."""


def trace_files_in(directory: PathLike, suffixes: Sequence[str] = TRACE_SUFFIXES) -> List[str]:
    """The trace files of ``directory``, sorted: its files whose names end in one of
    ``suffixes`` (hidden ones left out); empty when it holds none or is no directory."""
    if not os.path.isdir(directory):
        return []
    names = (n for n in os.listdir(directory)
             if n.endswith(tuple(suffixes)) and not n.startswith("."))
    return sorted(p for p in (os.path.join(directory, n) for n in names) if os.path.isfile(p))


def read_bounded(path: PathLike, max_bytes: int = DEFAULT_MAX_BYTES,
                 check_head: Optional[Callable[[bytes], None]] = None,
                 option: str = "vmalloc replay --max-trace-size", what: str = "trace file") -> bytes:
    """The file's bytes, gunzipped when gzip'ed; ``TraceFileError`` beyond ``max_bytes``.
    ``check_head`` sees the first (decompressed) chunk and may refuse the file at once;
    ``option`` is what the too-large message says raises the limit (the caller's own), ``what``
    what the file should be."""
    if os.path.isdir(path):
        raise TraceFileError(f"{path}: is a directory, not a {what}")
    try:
        raw = open(path, "rb")
    except OSError as exc:
        raise TraceFileError(f"{path}: cannot open ({exc.strerror or exc})") from None
    with raw:
        try:
            magic = raw.read(2)
            gzipped = magic == b"\x1f\x8b"
            if gzipped:
                raw.seek(0)  # gzip needs the whole stream (a pipe is not a gzip'ed trace)
            src: Any = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
            parts = [] if gzipped else [magic]
            total = len(parts[0]) if parts else 0
            while True:
                chunk = src.read(min(_CHUNK, max_bytes + 1 - total))
                if not chunk:
                    break
                if check_head is not None and total < _CHUNK:
                    check_head((b"".join(parts) + chunk)[:64])
                    check_head = None
                parts.append(chunk)
                total += len(chunk)
                if total > max_bytes:
                    verb = "decompresses to" if gzipped else "holds"
                    kind = what.split()[0]   # ("trace", "report")
                    raise TraceFileError(
                        f"{path}: {verb} more than {max_bytes} bytes, the limit for one {kind} "
                        f"({option} raises it)")
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise TraceFileError(f"{path}: damaged or truncated gzip data ({exc})") from None
        except OSError as exc:
            raise TraceFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return b"".join(parts)


def load(path: PathLike, device: Optional[int] = None,
         max_bytes: int = DEFAULT_MAX_BYTES) -> Trace:
    """Read a trace file: contract-2 JSON (optionally gzip'ed) or a PyTorch snapshot (pickle or
    JSON). ``device`` picks a snapshot's device (default: the busiest); given for a JSON trace it
    is refused. Every problem is a ``TraceFileError`` (a ``ValueError``) naming ``path``."""
    name = os.path.basename(str(path))
    for suffix in (".gz", ".json", ".pickle", ".pkl"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    def check_head(head: bytes) -> None:  # refuse /dev/zero and other junk before reading on
        # JSON, or a pickle (every protocol >= 2 starts with 0x80)
        if head.lstrip()[:1] not in (b"{", b"[", b"\x80") and head.strip():
            raise TraceFileError(f"{path}: neither a JSON trace nor a PyTorch snapshot pickle "
                                 f"(starts with {head[:8].hex(' ')})")

    raw = read_bounded(path, max_bytes, check_head)
    if not raw.strip():
        raise TraceFileError(f"{path}: is empty")
    try:
        if raw.lstrip()[:1] in (b"{", b"["):
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise TraceFileError(f"{path}: not valid JSON ({exc})") from None
            if isinstance(data, Mapping) and "device_traces" in data:
                return from_snapshot(data, device, name)
            if device is not None:  # silently ignoring it would replay what was not asked for
                raise TraceFileError(f"{path}: a JSON trace has one device; device (--device "
                                     f"{device}) applies to PyTorch snapshots only")
            return from_json(data, name)
        check_head(raw[:64])
        try:
            # a snapshot is plain dicts/lists: refuse anything else (no arbitrary objects)
            data = _SafeUnpickler(io.BytesIO(raw)).load()
        except Exception as exc:  # noqa: BLE001 - report any unpickling problem the same way
            raise TraceFileError(f"{path}: neither a JSON trace nor a PyTorch snapshot pickle "
                                 f"({exc})") from None
        if not isinstance(data, Mapping):
            raise TraceFileError(f"{path}: the pickle holds {type(data).__name__}, not a "
                                 f"snapshot dict")
        return from_snapshot(data, device, name)
    except TraceFileError:
        raise
    except (ValueError, RecursionError, OverflowError, TypeError) as exc:
        # OverflowError, TypeError: a safety net for a damaged file no check above foresaw
        raise TraceFileError(f"{path}: {exc}") from None


class _SafeUnpickler(pickle.Unpickler):
    """Unpickle only builtin containers and scalars (a snapshot is nothing else)."""

    def find_class(self, module: str, name: str):  # noqa: D401
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a snapshot")
