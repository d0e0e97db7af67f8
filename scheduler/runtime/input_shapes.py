"""Whether block 0's inputs vary along one direction: what Mimose's estimator and
``InputAwareChain`` assume when they predict a step's bytes from the input size alone.

Their default input size is the element count of block 0's first tensor (seed 004, 3.1): a
good key while the inputs grow along one direction, the sequence length at a fixed batch, the
batch at a fixed length, an image's side (height and width together). Where two dimensions vary
independently (random batch sizes and random lengths), a step's bytes are not a function of the
element count (attention's grow with the sequence length squared): GPT-2 learnt at batch 4
planned a 1 x 176 input as the 4 x 44 one it had measured, and held 1.56x its budget. The
fits cannot tell, so ``InputShapes`` watches the shapes and says so, once, naming two of them.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Tuple

import torch

Shape = Tuple[int, ...]


def _first_shape(args: Sequence[Any]) -> Optional[Shape]:
    for a in args:
        if isinstance(a, torch.Tensor):
            return tuple(a.shape)
    return None


def _direction(first: Shape, shape: Shape) -> Optional[Tuple[Tuple[int, ...], float]]:
    """The dimensions in which ``shape`` differs from ``first`` and their common ratio, or
    None where they differ by different ratios (or in rank): two directions at once."""
    if len(shape) != len(first):
        return None
    dims = tuple(i for i, (a, b) in enumerate(zip(first, shape)) if a != b)
    ratios = {shape[i] / first[i] if first[i] else float("inf") for i in dims}
    if len(ratios) > 1:
        return None
    return dims, (ratios.pop() if ratios else 1.0)


class InputShapes:
    """The shapes of block 0's first input seen so far, and one warning when they leave a
    single direction of growth (``see``)."""

    def __init__(self, who: str):
        self.who = who
        self.first: Optional[Shape] = None
        self.dims: Optional[Tuple[int, ...]] = None   # the direction's dimensions so far
        self.said = False

    def see(self, args: Sequence[Any]) -> None:
        shape = _first_shape(args)
        if self.said or shape is None:
            return
        if self.first is None:
            self.first = shape
            return
        d = _direction(self.first, shape)
        if d is None or (d[0] and self.dims is not None and d[0] != self.dims):
            self.said = True
            warnings.warn(
                f"{self.who}: the input size (elements of block 0's first tensor) is what the "
                f"bytes of a step are predicted from, but the inputs vary along more than one "
                f"direction ({self.first} and {shape}: e.g. the batch size and the sequence "
                "length); their bytes are not a function of their element count (attention's "
                "grow with the length squared), so planned steps can exceed the budget. Pad "
                "to a fixed batch size or a fixed length, pass input_size= a number that "
                "determines the bytes (then this is not checked), or use planner='rotor' "
                "without chain= (it measures each shape)", RuntimeWarning, stacklevel=4)
            return
        if d[0] and self.dims is None:
            self.dims = d[0]
