"""Input-aware optimal plans (for inputs whose shape changes): rotor or pofo on a chain
predicted for each new input shape, instead of profiling every shape again.

    source = InputAwareChain(blocks)                 # samples=10 distinct sizes profiled
    model = scheduler.wrap(blocks, "2GiB", planner="rotor", chain=source)

``InputAwareChain`` is a chain source for the runner's ``chain=`` option (a callable taking
the inputs and returning a ``Chain``). For the first ``samples`` distinct input sizes it
measures the chain (``measuring.measure_preserved``: ``scheduler.profile.measure_chain`` with
the blocks' random state, buffers and gradients put back, as the runner measures) and teaches
it to a ``scheduler.planners.mimose.ChainEstimator``; after that every new size gets the
estimator's prediction (every chain field per stage, order-2 in the input size), which is a
few numpy operations: the runner then plans it (rotor, pofo, ...) and caches the plan per
signature as for a measured chain. ``measurements`` and ``predictions`` count what it did.

The input size is Mimose's: the element count of the first input tensor (``input_size=`` to
change it). Where FSDP shards the blocks, the measured chains are agreed across ranks before
the estimator learns them (``distributed.agree_chain``), so every rank fits the same estimator
and predicts the same chains; under DDP each rank learns its own (``ChainRunner._agrees``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from torch import nn

from ..chain import Chain
from ..planners.mimose import DEFAULT_SAMPLES, ChainEstimator
from . import distributed, fsdp
from .block_calls import block_list
from .measuring import measure_preserved
from .input_shapes import InputShapes
from .options import check_callable, check_measure, default_input_size


NAME = "InputAwareChain"


class InputAwareChain:
    """Chain source: measured on the first ``samples`` distinct input sizes, predicted after."""

    def __init__(self, blocks: Sequence[nn.Module], samples: int = DEFAULT_SAMPLES,
                 input_size: Optional[Callable[[Sequence[Any]], float]] = None,
                 loss: Any = "sum", measure_options: Optional[Dict[str, Any]] = None,
                 estimator: Optional[ChainEstimator] = None):
        self.blocks = block_list(blocks, "InputAwareChain")
        self.L = len(self.blocks)
        if estimator is not None and (not isinstance(estimator, ChainEstimator)
                                      or estimator.L != self.L):
            raise ValueError(f"InputAwareChain: estimator= must be a ChainEstimator of {self.L} "
                             f"stages, got {estimator!r}")
        self.estimator = estimator or ChainEstimator(self.L, samples)
        check_callable(input_size, "input_size", NAME, "a callable from the inputs to a number")
        self.input_size = input_size or default_input_size
        self.loss = loss
        self.measure_options = check_measure(loss, measure_options, NAME)  # not at a step
        self.measurements = 0
        self.predictions = 0
        self.shapes = InputShapes(NAME)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("shapes", InputShapes(NAME))  # (pickled before it existed)

    @property
    def collecting(self) -> bool:
        """Still profiling new sizes (fewer than ``samples`` distinct sizes measured)."""
        return not self.estimator.ready

    def __call__(self, *args: Any) -> Chain:
        chain = self.known(args)
        if chain is None:
            size, exact = self._size(args)
            chain = self._measure(args)
            if fsdp.sharded(self.blocks, None):  # ranks must run one plan (ChainRunner._agrees)
                chain = distributed.agree_chain(chain, key=("input-aware", float(size)))
            if exact:  # (a smaller last batch is measured, not learnt as its bound)
                self.learn(size, chain)
        return chain

    def _size(self, args: Sequence[Any]) -> Tuple[float, bool]:
        """The input size of block 0's arguments ``args`` to predict with, and whether it is
        theirs to learn (``input_shapes.InputShapes.size_for``: a smaller last batch is
        predicted as the learnt batch; the default input size only)."""
        size = self.input_size(args)
        if self.input_size is default_input_size:
            return self.shapes.size_for(args, size)
        return size, True

    def size_to_learn(self, args: Sequence[Any]) -> Optional[float]:
        """The size a chain measured on ``args`` is learnt as (the runner's profiling steps
        under ``scheduler.checkpoint``), or None: not to be learnt."""
        size, exact = self._size(args)
        return size if exact else None

    def known(self, args: Sequence[Any]) -> Optional[Chain]:
        """The chain of block 0's arguments ``args`` without measuring anything: the one
        measured for their size, or the estimator's prediction once it is fitted; None while
        their size is still to be measured."""
        size, _ = self._size(args)
        if self.estimator.covers(size):  # (beyond the fit's reach: measured first)
            self.predictions += 0 if self.estimator.has(size) else 1
            return self.estimator.predict(size)
        return None

    def learn(self, size: float, chain: Chain) -> None:
        """A chain measured for input size ``size`` (by this source, or by the runner on a
        profiling step: ``scheduler.checkpoint``'s blocks take the model's keyword arguments
        and are measured with the model's tail there), agreed across ranks where they must be."""
        self.measurements += 1
        self.estimator.observe(size, chain)

    def _measure(self, args: Tuple[Any, ...]) -> Chain:
        return measure_preserved(self.blocks, self.blocks, args, self.loss, self.measure_options)

    def stats(self) -> Dict[str, Any]:
        return {"measurements": self.measurements, "predictions": self.predictions,
                "sizes_measured": len(self.estimator.sizes), "collecting": self.collecting}
