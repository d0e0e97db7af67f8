"""The ``vmalloc report FILE`` command: print a saved report (``VMALLOC_REPORT=FILE.json``, or a
replay comparison from ``vmalloc replay --json``) as text."""
from __future__ import annotations

import argparse

from .report_format import loads, to_text


def cmd_report(args: argparse.Namespace) -> int:
    """``vmalloc report FILE``: the file is read once (a pipe cannot be read twice), bounded by
    ``--max-trace-size`` and gunzipped when gzip'ed; a directory, ``/dev/zero`` or a huge file
    is refused while it is read."""
    from .replay.files import read_bounded   # (the replay package: loaded for this command only)

    def check_head(head: bytes) -> None:  # /dev/zero, a binary file: refused before reading on
        if head.strip() and head.lstrip()[:1] not in (b"{", b"["):  # JSON: loads() judges it
            if head.startswith(b"vmalloc "):   # VMALLOC_REPORT=name.txt: text, read as it is
                raise ValueError(f"{args.file}: a text report (VMALLOC_REPORT= a name not "
                                 "ending in .json writes text); `vmalloc report` reads the "
                                 "JSON ones (VMALLOC_REPORT=name.json)")
            raise ValueError(f"{args.file}: not a JSON report (starts with {head[:8].hex(' ')})")
    raw = read_bounded(args.file, args.max_size, check_head,
                       option="vmalloc report --max-trace-size", what="report file")
    rep = loads(raw, args.file)
    try:
        text = to_text(rep)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        # JSON with a 'memory' or 'comparison' key but not the rest of a report: report_format
        # reads it as a report would be, so say which part is missing or of the wrong type
        what = f"missing key {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args \
            else str(exc)
        raise ValueError(f"{args.file}: not a complete vmalloc report ({what})") from None
    print(text)
    return 0
