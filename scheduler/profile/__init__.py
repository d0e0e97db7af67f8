"""Chains of real models: measured on a device, or derived on the meta device (issue 4).

``meta_chain(blocks, input_shape)`` needs no GPU and no compute (sizes exact, times from the
documented cost model in ``cost``); ``measure_chain(blocks, sample_input)`` is rotor's parameter
estimation (seed 002, section 5.1) on a real device. Both import torch; the planners do not.
"""
from typing import Any, Callable

from .._lazy import submodule_getattr
from .cost import V100_BYTES_PER_S, V100_FLOPS_PER_S, CostModel
from .meta import meta_chain
from .op_floor import OpFloor, op_floor

__all__ = ["CostModel", "V100_BYTES_PER_S", "V100_FLOPS_PER_S", "meta_chain", "measure_chain",
           "OpFloor", "op_floor"]


def _measure_chain() -> Callable[..., Any]:
    from .measure import measure_chain
    return measure_chain


# measure_chain and the other submodules (``scheduler.profile.measure``) load on first access
__getattr__ = submodule_getattr(__name__, {"measure_chain": _measure_chain})
