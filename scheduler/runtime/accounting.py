"""Activation bytes as autograd really holds them, counted per storage.

Two uses: the Mimose collector measures what a block's forward keeps for its backward
(``saved_bytes``), and the chain runner reports the peak of activation memory it held
while following a plan (``LiveSet``), to compare with the plan's predicted peak on machines
without a device allocator to ask (CPU). Parameters are not activations: tensors sharing a
storage with a parameter are left out. Views are counted once, by their storage.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Iterator, List, Set

import torch


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def tensors_bytes(tensors: Iterable[object], exclude: Set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (non-tensors ignored)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            k = storage_key(t)
            if k not in exclude and k != 0:
                seen[k] = storage_bytes(t)
    return sum(seen.values())


@contextlib.contextmanager
def recording_saved(into: List[torch.Tensor]) -> Iterator[None]:
    """Within the body, every tensor autograd saves for backward is appended to ``into``
    (and saved unchanged)."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        into.append(t)
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def parameter_storages(module: torch.nn.Module) -> Set[int]:
    return {storage_key(p) for p in module.parameters()} | \
           {storage_key(b) for b in module.buffers() if b is not None}
