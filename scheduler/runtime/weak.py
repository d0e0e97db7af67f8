"""Attributes held weakly in memory and strongly in a copy or a pickle.

An object that refers weakly to what holds it (so that deleting the holder frees it at once:
no reference cycle for the garbage collector to find) must, copied or pickled with its holder,
refer to the holder's copy: ``copy`` copies a weak reference as itself (the copy would refer to
the original), and ``pickle`` refuses one. ``WeakFields`` gives its state the referents
themselves (the copy's memo or the pickle's maps them to their copies) and weakens them again
when the state is set.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Tuple


def gone() -> None:
    """The stand-in for a weak reference to nothing (called like one, returns None)."""
    return None


class WeakFields:
    """Mixin: the attributes named in ``WEAK`` hold a weak reference (or ``gone``)."""

    WEAK: Tuple[str, ...] = ()

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        for name in self.WEAK:
            state[name] = state[name]()   # the referent, or None once it is gone
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        for name in self.WEAK:
            state[name] = gone if state[name] is None else weakref.ref(state[name])
        self.__dict__.update(state)
