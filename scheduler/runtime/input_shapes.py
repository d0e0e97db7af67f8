"""Whether block 0's inputs vary along one direction: what Mimose's estimator and
``InputAwareChain`` assume when they predict a step's bytes from the input size alone.

Their default input size is the element count of block 0's first tensor (seed 004, 3.1), whose
dimension 0 is taken as the batch. The bytes of a step are a function of that count while
either the batch varies (linear in it) or the rest of the shape does (a sequence length, an
image's height and width, together or not: what the blocks see per sample), but not both: at
one element count, a smaller batch of longer sequences holds more (attention's scores grow with
the length squared). GPT-2 learnt at batch 4 planned a 1 x 176 input as the 4 x 44 it had
measured, and held 1.56x its budget. So ``InputShapes.size_for``:

- keeps the element count while the inputs vary along one of those two directions;
- for a batch smaller than the one learnt (a data loader's last batch) at a per-sample shape the
  samples vary along, plans for the learnt batch (``exact`` False: an upper bound, never learnt
  from, never collected), which holds at least as much;
- otherwise warns once, naming two shapes, and goes on with the element count.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch

from vmalloc import user_warning

Shape = Tuple[int, ...]


def _first_shape(args: Sequence[Any]) -> Optional[Shape]:
    for a in args:
        if isinstance(a, torch.Tensor):
            return tuple(a.shape)
    return None


class InputShapes:
    """The shapes of block 0's first input seen so far: the first one, and which of the batch
    (dimension 0) and the rest has varied since."""

    def __init__(self, who: str):
        self.who = who
        self.first: Optional[Shape] = None
        self.batch_varies = False    # a shape with another batch, the rest as the first's
        self.sample_varies = False   # a shape with the first's batch, another rest
        self.said = False

    def size_for(self, args: Sequence[Any], size: float) -> Tuple[float, bool]:
        """The input size to plan ``args`` with (``size``: their element count), and whether
        it is theirs (``exact``) rather than an upper bound to plan with and not learn from."""
        shape = _first_shape(args)
        if shape is None or not shape:
            return size, True
        if self.first is None:
            self.first = shape
            return size, True
        b0, rest0 = self.first[0], self.first[1:]
        b, rest = shape[0], shape[1:]
        if len(shape) != len(self.first):
            self._two_ways(shape)
        elif b == b0:
            self.sample_varies = self.sample_varies or rest != rest0
            if self.sample_varies and self.batch_varies:
                self._two_ways(shape)
        elif rest == rest0 and not self.sample_varies:
            self.batch_varies = True
        elif b < b0 and not self.batch_varies and b > 0:
            # a smaller batch (the last of an epoch) on inputs whose per-sample shape varies:
            # planned as the learnt batch would be (it holds more), not learnt from
            return size * b0 / b, False
        else:
            self._two_ways(shape)
        return size, True

    def _two_ways(self, shape: Shape) -> None:
        if self.said:
            return
        self.said = True
        user_warning.warn(
            f"{self.who}: the input size (elements of block 0's first tensor) is what the bytes "
            f"of a step are predicted from, but the inputs vary in both their batch size "
            f"(dimension 0) and the rest of their shape ({self.first} and {shape}); at one "
            "element count a smaller batch of longer sequences holds more (attention's scores "
            "grow with the length squared), so planned steps can exceed the budget. Keep the "
            "batch size fixed (a smaller last batch is fine) or the rest of the shape fixed, "
            "pass input_size= a number that determines the bytes (then this is not checked), "
            "or use planner='rotor' without chain= (it measures each shape)", RuntimeWarning)
