"""What the swap runtime keeps per saved storage (``Var``) and what autograd holds instead of a
saved tensor (``Handle``), and how handle deaths reach the runtime without running Python code.

Why no ``__del__``: a Ctrl-C lands on whatever Python code runs next; when that is a destructor
(or a weakref callback written in Python) the ``KeyboardInterrupt`` is printed as "Exception
ignored" and lost, and training goes on. So a handle's death runs C code only:

* each handle holds the var's ``Keeper`` (the one strong reference to the device storage while
  the bytes are on the device, besides the handles' own views): when the last handle dies the
  keeper dies with it and the device memory is freed at once, by reference counting;
* each handle is watched by a ``HandleRef`` whose callback is ``deque.append``: the runtime
  drains that queue at safe points (its hooks, ``stats()``, exit) and does the bookkeeping
  there, where an interrupt propagates like any other exception;
* when the context exits while a graph still holds vars, their host copies move into the
  keepers too: nothing that graph holds waits for a drain that may never come.
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Deque, List, Optional

import torch

from ..planners.swap_schedule import DEVICE
from ..profile.storage import use_count


class Keeper:
    """Holds a var's device storage for as long as a handle of it is alive; after the context
    exited, also its host copy (so a graph that outlives the context frees both as it dies)."""

    __slots__ = ("storage", "host", "__weakref__")

    def __init__(self, storage: Any):
        self.storage = storage
        self.host: Optional[torch.Tensor] = None


class Handle:
    """What autograd keeps instead of a saved tensor: a view of a variable."""

    __slots__ = ("var", "view", "meta", "keeper", "version", "modified", "source",
                 "__weakref__")

    def __init__(self, var: "Var", t: torch.Tensor, keeper: Keeper):
        self.var = var
        self.view: Optional[torch.Tensor] = t.detach()  # detached: no grad_fn reference cycle
        self.meta: Any = None  # (dtype, shape, stride, offset), taken when the view is dropped
        self.keeper = keeper
        # autograd does not check a hook-packed tensor for in-place changes: the runtime does
        # (``accounting.check_unchanged``), on the view (which shares the tensor's version
        # counter) while it lives, and remembers a change seen when the view is dropped for
        # a swap-out; after that, on the saved tensor itself while the program holds it (a
        # weak reference: it keeps no bytes), or on its base: a view made inside an op
        # (``x.view`` in ``nn.Linear``) dies with the forward while the program holds ``x``,
        # and a view shares its base's version counter
        self.version = t._version
        self.modified = False
        base = t._base
        self.source = (weakref.ref(t), None if base is None else weakref.ref(base), t._version)

    def changed_since_saved(self) -> bool:
        """A change seen when the view was dropped, or made since to the tensor it saved (or
        to that tensor's base)."""
        if self.modified:
            return True
        ref, base_ref, version = self.source
        t = ref()
        if t is None and base_ref is not None:
            t = base_ref()
        return t is not None and t._version != version


class HandleRef(weakref.ref):
    """A weak reference to a handle that remembers its var (the handle is gone when read)."""

    __slots__ = ("var",)

    def __init__(self, handle: Handle, callback: Any):
        super().__init__(handle, callback)
        self.var = handle.var


class Var:
    """One saved storage: where its bytes are and who still needs them."""

    __slots__ = ("vid", "it", "nbytes", "state", "keeper_ref", "inflight", "storage_ref", "ptr",
                 "device", "stream", "host", "out_event", "in_event", "in_tensor", "in_readers",
                 "handles", "copied_version")

    def __init__(self, vid: int, it: int, storage: Any, nbytes: int, ptr: int, device: Any):
        self.vid = vid
        self.it = it
        self.nbytes = nbytes
        self.state = DEVICE
        self.keeper_ref: Any = None       # weak: the handles own the keeper
        # the device storage while a swap-out copy reads it (a swap-out called off too: its
        # copy still runs, and the handles may all die before it ends)
        self.inflight: Any = None
        self.storage_ref = weakref.ref(storage)
        self.ptr = ptr
        self.device = device
        self.stream: Any = None           # CUDA: the stream current when it was saved
        self.host: Optional[torch.Tensor] = None   # host copy (kept once made: never changes)
        self.out_event: Any = None        # completion of the device-to-host copy
        self.in_event: Any = None         # completion of the host-to-device copy
        self.in_tensor: Optional[torch.Tensor] = None  # swapped-in memory until first use
        # CUDA, while the device bytes are a swap-in's copy: the streams that read them so far,
        # each ordered after the copy (``in_event``) and ``record_stream``-ed (autograd runs a
        # node on its forward op's stream: nodes on two streams may read one saved tensor)
        self.in_readers: Optional[List[Any]] = None
        self.handles: List[HandleRef] = []
        # the version counter of its saved tensors when the host copy was made (None: unknown),
        # to tell whether the bytes a new save hands over changed since
        # (``SwapTransfers.save_again``)
        self.copied_version: Optional[int] = None

    # the device storage, while the bytes are on the device and a handle is alive
    @property
    def storage(self) -> Any:
        keeper = self.keeper_ref() if self.keeper_ref is not None else None
        if keeper is not None and keeper.storage is not None:
            return keeper.storage
        return self.inflight

    def set_storage(self, storage: Any) -> None:
        keeper = self.keeper_ref() if self.keeper_ref is not None else None
        if keeper is not None:
            keeper.storage = storage

    def keeper(self, storage: Any) -> Keeper:
        """The keeper new handles share (made again if every earlier handle died)."""
        keeper = self.keeper_ref() if self.keeper_ref is not None else None
        if keeper is None:
            keeper = Keeper(storage)
            self.keeper_ref = weakref.ref(keeper)
        elif keeper.storage is None:
            keeper.storage = storage
        return keeper

    def host_copy(self) -> Optional[torch.Tensor]:
        """The host copy: the var's (a pooled buffer) or, after exit, its handles'."""
        if self.host is not None:
            return self.host
        keeper = self.keeper_ref() if self.keeper_ref is not None else None
        return None if keeper is None else keeper.host

    def live_handles(self) -> List[Handle]:
        return [h for h in (r() for r in self.handles) if h is not None]

    def held_elsewhere(self) -> bool:
        """The program also holds the device storage (the batch its loop keeps, a module's
        buffer, the output the next layer is reading): dropping the runtime's references would
        free no device memory. Told from the storage's reference count: the runtime's own are
        the keeper's storage object, its handles' views and a swap-in's tensor, one each."""
        storage = self.storage
        n = None if storage is None else use_count(storage)
        if n is None:  # (unknown: assume not, as before this was asked)
            return False
        ours = (1 + sum(1 for h in self.live_handles() if h.view is not None)
                + (self.in_tensor is not None))
        return n > ours


class DeathQueue:
    """Handles that died, appended by C code (``deque.append`` as the weakref callback)."""

    def __init__(self) -> None:
        self.dead: Deque[HandleRef] = deque()

    def watch(self, handle: Handle) -> HandleRef:
        return HandleRef(handle, self.dead.append)

    def __bool__(self) -> bool:
        return bool(self.dead)

    def pop(self) -> Optional[HandleRef]:
        try:
            return self.dead.popleft()
        except IndexError:
            return None
