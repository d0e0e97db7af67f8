"""Tensors kept in place under a pressure callback (vmalloc's allocator, ``allocator=``): when
the allocator runs short, they can still leave the device.

An iteration kept in place hands autograd the saved tensor itself (``swap_in_place``), so no
handle of the runtime's stands between them. What the runtime keeps instead is a weak
reference to each (``watch``: the pack's only extra cost). To evict one, it copies its storage
to the host and shrinks the storage to nothing (``resize_(0)``, as FSDP frees a flat
parameter): every tensor on it stays the same object, only its bytes are gone. The unpack that
reads it first grows the storage back and copies the bytes in (``restore``); the others find
them there.

A storage is evicted only if nothing but the kept tensors holds it (its use count): one the
program holds too (its batch, the output the next layer reads) would free nothing, and one an
autograd node is reading is held by the node, since under a pressure callback the unpack hands
the node a tensor of its own (``swap.SwapContext._unpack``: autograd would otherwise hand the
node our very tensor where it needs no gradient, a dropout mask say). Oldest first, as the
tracked path's pressure evictions. It is a rescue, not a schedule: the iteration takes the full
path from the pressure on, and its plan is kept in place again only after twice as long a
streak as before (``swap.SwapContext._on_pressure``, ``swap_planning.Entry.in_place_after``). The host copy hangs on the kept tensors themselves
(``HOST``): it dies with the graph, read or not, even after the context has exited.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Iterator, List, Tuple

import torch

from ..profile.storage import use_count


# the attribute of a kept tensor that holds its storage's host copy while it is evicted
HOST = "_swap_kept_host"


class OnHost:
    """A kept storage while it is evicted: its size, the tensors that may bring it back (their
    ``HOST`` attribute holds the copy), and whether its host copy is whole (``evicted``: set
    before the storage is shrunk, so an interrupt on either side of the shrink leaves a state
    ``restore`` reads right: it copies back whenever the copy is whole)."""

    __slots__ = ("nbytes", "members", "evicted")

    def __init__(self, nbytes: int, members: List[Any]):
        self.nbytes = nbytes
        self.members = members  # weak references to the kept tensors on the storage
        self.evicted = False

    def alive(self) -> bool:
        return any(r() is not None for r in self.members)

    def holds(self, t: torch.Tensor) -> bool:
        return any(r() is t for r in self.members)

    def forget(self) -> None:
        """Let go of the host copy (its bytes are back on the device, or were never gone)."""
        for r in self.members:
            m = r()
            if m is not None:
                m.__dict__.pop(HOST, None)


class KeptEvictor:
    """The running iteration's kept tensors (weakly, in pack order) and the storages evicted."""

    def __init__(self) -> None:
        self.kept: List[Any] = []  # weak references to the running iteration's kept tensors
        # storage key (``_cdata``: the same object however many tensors share it) -> its bytes
        self.on_host: Dict[int, OnHost] = {}

    def watch(self, kept: torch.Tensor) -> None:
        self.kept.append(weakref.ref(kept))

    def kept_on(self, device: Any = None) -> Iterator[torch.Tensor]:
        """The running iteration's kept tensors still alive, on ``device`` (any: None)."""
        for r in self.kept:
            t = r()
            if t is not None and (device is None or t.device == device):
                yield t

    def keeps_on(self, device: Any = None) -> bool:
        return next(self.kept_on(device), None) is not None

    def new_iteration(self) -> None:
        """The running iteration is over: its tensors can no longer be evicted (a graph kept
        past it holds them where they are, as without a pressure callback)."""
        self.kept = []
        self.prune()

    def off_device(self) -> int:
        """Bytes of kept tensors now on the host (not resident)."""
        return sum(g.nbytes for g in self.on_host.values() if g.evicted)

    def prune(self) -> None:
        """Forget the storages no tensor can read any more (their graph died unread: the host
        copy went with it)."""
        if self.on_host:
            for key in [k for k, g in self.on_host.items() if not g.alive()]:
                del self.on_host[key]

    def evict(self, needed: int, device: Any = None) -> int:
        """Evict kept storages, oldest first, until ``needed`` bytes are freed (on ``device``
        only, if given: another device's free nothing there): bytes freed."""
        self.prune()
        groups: Dict[int, Tuple[torch.UntypedStorage, List[torch.Tensor]]] = {}
        for t in self.kept_on(device):
            s = t.untyped_storage()
            groups.setdefault(s._cdata, (s, []))[1].append(t)
        freed = 0
        for key, (storage, members) in groups.items():
            if freed >= needed:
                break
            n = storage.nbytes()
            if n == 0 or key in self.on_host or not storage.resizable():
                continue
            # held by the kept tensors and ``storage`` (this Python object) only
            if use_count(storage) != len(members) + 1:
                continue
            host = torch.UntypedStorage(n, device="cpu")
            host.copy_(storage)  # (a blocking copy on the current stream: the forward's)
            if storage.device.type == "cuda":  # no kernel of any stream may read it still:
                torch.cuda.synchronize(storage.device)  # its memory goes back at once
            group = OnHost(n, [weakref.ref(m) for m in members])
            for m in members:
                m.__dict__[HOST] = host
            self.on_host[key] = group
            # marked before the bytes go (the host copy is whole): an interrupt on either side
            # of the shrink leaves ``restore`` copying, harmlessly where the bytes stayed
            group.evicted = True
            storage.resize_(0)
            freed += n
        return freed

    def restore(self, t: torch.Tensor) -> int:
        """Bring back the storage of the kept tensor ``t`` if it was evicted: bytes brought."""
        storage = t.untyped_storage()
        key = storage._cdata
        group = self.on_host.get(key)
        if group is None or not group.holds(t):
            if storage.nbytes() == 0 and t.numel():
                raise RuntimeError(
                    "swap runtime: a saved tensor kept in place has no bytes and no host copy "
                    f"(shape {tuple(t.shape)}, {t.dtype}): its storage was freed by someone else")
            return 0
        brought = 0
        if group.evicted:
            if storage.nbytes() == 0:
                storage.resize_(group.nbytes)  # (may ask the pressure callback: it skips it)
            # (also where an interrupt came before the shrink, or cut an earlier restore short)
            storage.copy_(t.__dict__[HOST])
            brought = group.nbytes
        # (not marked: an interrupt came before the host copy was whole; the bytes are there)
        del self.on_host[key]
        group.forget()
        return brought
