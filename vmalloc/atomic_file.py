"""Files written whole or not at all: the data goes to a file beside the target
(``PATH.part``), which is then renamed over it, so Ctrl-C, a kill or a full disk mid-write never
leaves a truncated report, replay comparison or trace for the next reader to choke on."""
from __future__ import annotations

import contextlib
import os
import stat
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


def write_atomic(path: PathLike, data: Union[bytes, str]) -> None:
    """Write ``data`` (bytes, or text in the locale's encoding as ``open(path, "w")`` writes it)
    to ``path``: the old file stays as it was until the new one is complete. A device or pipe
    (``/dev/null``, ``/dev/stdout``) is written in place: there is no file to replace. An
    ``OSError`` names ``path``, not the ``.part`` file."""
    target = os.fspath(path)
    mode = "wb" if isinstance(data, bytes) else "w"
    if _is_special(target):
        with open(target, mode) as f:
            f.write(data)
        return
    tmp = f"{target}.part"
    try:
        with open(tmp, mode) as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename == tmp:  # name the path the caller gave
            raise OSError(exc.errno, exc.strerror, target) from None
        raise


def _is_special(path: str) -> bool:
    """An existing path that is no regular file (a device, a FIFO): renaming over it would
    replace the device node itself."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:   # not there (yet): a new regular file
        return False
