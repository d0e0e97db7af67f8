"""Fragmentation reports (issue 3)."""


def report(format="text"):
    raise NotImplementedError("vmalloc.report is not built yet")
