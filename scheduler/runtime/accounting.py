"""Activation bytes as autograd really holds them, counted per storage, with the profilers'
definitions (``scheduler.profile.storage``: storage keys, ``xbar``; ``autograd_graph``:
saved-tensor recording).

Two uses: the Mimose collector measures what a block's forward keeps for its backward, and
the chain runner reports the peak of activation memory it held while following a plan, to
compare with the plan's predicted peak on machines without a device allocator to ask (CPU).
Parameters and buffers are not activations: their storages are left out. Views count once.
And, for both runtimes, the one check that a saved tensor was not changed in place before
its backward (``check_unchanged``) and the one byte view of a storage their copies move
(``storage_bytes_view``).
"""
from __future__ import annotations

from typing import Iterable, List, Sequence, Set

import torch

from ..profile import autograd_graph, storage

storage_key = storage.storage_key
keys_held = storage.keys_held
SavedTensors = autograd_graph.SavedTensors


def storage_bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all the bytes of ``storage``, on its device (what a copy to or
    from the host moves)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),))


def tensors_of(values: Iterable[object]) -> List[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor) and not v.is_meta]


def tensors_bytes(values: Iterable[object], exclude: Set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind the tensors among ``values``."""
    return storage.storage_bytes(tensors_of(values), exclude)


def xbar_bytes(saved: Sequence[torch.Tensor], outputs: Sequence[object],
               inputs: Sequence[object], state_keys: Set[int]) -> int:
    """What a block's forward keeps for backward, output included (DESIGN.md ``xbar``)."""
    return storage.xbar_bytes(saved, tuple(tensors_of(outputs)), tuple(tensors_of(inputs)),
                              state_keys)


def check_unchanged(t: torch.Tensor, saved_version: int, where: str,
                    modified: bool = False) -> None:
    """Plain autograd's check that a saved tensor was not modified in place since it was
    saved (``saved_version``; ``modified``: a change seen earlier), which it skips for
    tensors packed by saved-tensor hooks: both runtimes make it at every unpack."""
    if modified or t._version != saved_version:
        raise RuntimeError(
            f"{where}: one of the variables needed for gradient computation has been "
            f"modified by an inplace operation: a saved tensor of shape {tuple(t.shape)} "
            f"changed since it was saved (version {saved_version}, now {t._version}); plain "
            "autograd raises here too (without this check the gradient would silently use "
            "the changed values)")
