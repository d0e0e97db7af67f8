"""Registration with PyTorch (issue 3)."""


def enable(chunk_size=None, budget=None, device=None):
    raise NotImplementedError("vmalloc.enable is not built yet")


def is_enabled() -> bool:
    return False


def stats(device=None):
    raise NotImplementedError("vmalloc.stats is not built yet")
