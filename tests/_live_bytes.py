"""A live-storage byte counter (a dispatch mode): the bytes of the storages ops create, alive
now and at the peak, as CUDA's allocator statistics count them, without the buffers kernels
keep to themselves. Storages an op reads that it did not create (made before) never count."""
from __future__ import annotations

import weakref

import torch
from scheduler.profile.eager_mode import EagerDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorageBytes(EagerDispatchMode):  # (compiled code it runs stays compiled)
    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: dict = {}

    def _note(self, t: torch.Tensor, count: bool) -> None:
        s = t.untyped_storage()
        known = self.seen.get(s._cdata)
        if known is not None and known() is s:
            return
        n = s.nbytes() if count else 0
        self.live += n
        self.peak = max(self.peak, self.live)
        self.seen[s._cdata] = weakref.ref(s, lambda _, n=n: setattr(self, "live", self.live - n))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:   # made before: never counted
            if isinstance(t, torch.Tensor):
                self._note(t, count=False)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._note(t, count=True)
        return out
