"""Files written whole or not at all: the data goes to a temporary file beside the target,
which is then renamed over it, so Ctrl-C, a kill or a full disk mid-write never leaves a
truncated report, replay comparison or trace for the next reader to choke on."""
from __future__ import annotations

import contextlib
import os
import stat
import threading
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]


def write_atomic(path: PathLike, data: Union[bytes, str]) -> None:
    """Write ``data`` (bytes, or text in the locale's encoding as ``open(path, "w")`` writes it)
    to ``path``: the old file stays as it was until the new one is complete. A symbolic link is
    written through (its target is replaced, the link stays), an existing file keeps its
    permission bits, and two processes writing the same path each publish a whole file (each
    has its own temporary one). A device or pipe (``/dev/null``, ``/dev/stdout``) is written in
    place: there is no file to replace. An ``OSError`` names ``path``."""
    target = os.path.realpath(os.fspath(path))
    mode = "wb" if isinstance(data, bytes) else "w"
    try:
        st = os.stat(target)
    except OSError:   # not there (yet): a new regular file
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        with open(target, mode) as f:
            f.write(data)
        return
    # one name per process and thread (two writers of one path never share it), created
    # exclusively with the umask's bits, as open() makes a new file
    tmp = f"{target}.{os.getpid()}.{threading.get_ident()}.part"
    try:
        with open(tmp, "x" + mode[1:]) as f:
            f.write(data)
        if st is not None:   # the file keeps its permission bits
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename in (tmp, target):  # the caller's name
            raise OSError(exc.errno, exc.strerror, os.fspath(path)) from None
        raise
