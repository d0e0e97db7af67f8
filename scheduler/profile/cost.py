"""The cost model that turns counted work into seconds (used by ``meta_chain``).

Time of a stage's forward (or backward) =
    FLOPs / ``flops_per_s``  +  bytes moved / ``bytes_per_s``

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions, i.e. the
work that dominates; element-wise ops count as 0 FLOPs there). "Bytes moved" is the traffic of
every non-view ATen op: the bytes of its tensor inputs plus the bytes of its outputs, which is
what element-wise ops (batch norm, ReLU, softmax, adds) cost on a GPU. Summing both terms rather
than taking a per-op roofline maximum is deliberately simple and slightly pessimistic.

The defaults are the NVIDIA Tesla V100-PCIE of seed 002's experiments (section 5.3): 14 TFLOP/s
peak FP32 and 900 GB/s HBM2. Real kernels reach a fraction of peak; the absolute times are
therefore optimistic, but the ratios between stages (what the planners use) are realistic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

#: V100-PCIE peak FP32 throughput, FLOP/s.
V100_FLOPS_PER_S: float = 14e12
#: V100 HBM2 bandwidth, bytes/s.
V100_BYTES_PER_S: float = 900e9


@dataclass(frozen=True)
class CostModel:
    """FLOP throughput and memory bandwidth of the device a chain is derived for."""

    flops_per_s: float = V100_FLOPS_PER_S
    bytes_per_s: float = V100_BYTES_PER_S

    def __post_init__(self) -> None:
        for name in ("flops_per_s", "bytes_per_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"CostModel.{name}: must be a finite positive number, got {v!r}")

    def seconds(self, flops: float, nbytes: float) -> float:
        return flops / self.flops_per_s + nbytes / self.bytes_per_s
