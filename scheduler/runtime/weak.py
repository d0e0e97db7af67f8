"""Weak references that a deep copy follows: an object that refers weakly to what holds it
(so that deleting the holder frees it at once, no reference cycle) must, when copied with
it, refer to the holder's copy, not to the original (``copy`` copies a weak reference as
itself)."""
from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Dict


def copied_ref(ref: Callable[[], Any], memo: Dict[int, Any]) -> Callable[[], Any]:
    """A weak reference to the deep copy (in ``memo``'s copy) of what ``ref`` refers to;
    ``ref`` itself when that is gone."""
    obj = ref()
    if obj is None:
        return ref
    return weakref.ref(copy.deepcopy(obj, memo))
