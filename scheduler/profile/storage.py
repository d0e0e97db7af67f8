"""Sizes of tensors as memory holds them: counted per *storage*, so views and in-place results
are never counted twice, and what a stage keeps for its backward (``xbar``) in those terms.

A storage is identified by its ``StorageImpl`` address (``untyped_storage()._cdata``), which
works on the ``meta`` device too (there every data pointer is 0). An address is only an
identity while its storage lives: whoever compares keys across time keeps the storages alive
(``keys_held``), not the tensors, since a tensor given a new ``.data`` lets go of its old one.
(The op tracer, which must hold nothing, follows storages by their Python objects instead.)
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Iterator, Optional, Sequence, Set, Tuple

import torch

Tensors = Tuple[torch.Tensor, ...]


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def use_count(storage: torch.UntypedStorage) -> Optional[int]:
    """How many references hold ``storage``'s bytes (each tensor on it, and its Python storage
    object, one each); None on a torch without that private API (callers assume the worst)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(storage._cdata)


@contextlib.contextmanager
def keys_held(tensors: Iterable[torch.Tensor]) -> Iterator[Set[int]]:
    """The keys of the storages behind ``tensors``, valid for the body: the storages are held
    until it ends. (Holding the tensors would not do: FSDP1 gives its original parameters a
    new ``.data`` at each unshard, freeing the storage each had, and a new activation can then
    take that address and be left out with the weights.)"""
    held = {storage_key(t): t.untyped_storage() for t in tensors}
    try:
        yield set(held)
    finally:
        del held


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: Set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out the keys in ``exclude``."""
    seen: Dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()  # its key (``storage_key``) and size from one lookup
        if s._cdata not in exclude:
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def dense_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def grad_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Size of the gradient with respect to ``tensors``: dense, one per differentiable tensor."""
    return sum(dense_bytes(t) for t in tensors if t.requires_grad)


def xbar_bytes(saved: Sequence[torch.Tensor], outputs: Tensors, inputs: Tensors,
               state_keys: Set[int]) -> int:
    """What the forward of a stage keeps for its backward, output included (DESIGN.md ``xbar``):
    the distinct storages autograd saved plus those of the outputs, less the stage's input
    (stored as ``x[s]``, or inside ``xbar[s-1]``) and less parameters and buffers (weights are not
    activations). The outputs count even when they alias the input, so ``xbar[s] >= x[s+1]``."""
    out_keys = {storage_key(t) for t in outputs}
    exclude = ({storage_key(t) for t in inputs} | state_keys) - out_keys
    return storage_bytes(list(saved) + list(outputs), exclude)
