"""Python face of the native allocator (issue 2)."""


class Allocator:  # placeholder until issue 2 lands
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("vmalloc.Allocator is not built yet")
