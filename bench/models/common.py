"""What every zoo builder returns: the blocks of a chain and the shape of its input."""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn


class ZooModel(tuple):
    """``(blocks, input_shape)``, so ``blocks, shape = resnet50(batch=8)`` works, plus what the
    input needs: ``input_dtype`` (float32 images, int64 token ids), ``vocab`` (the exclusive upper
    bound of token ids, else None) and ``name``. ``sample_input()`` makes a matching tensor."""

    def __new__(cls, blocks: List[nn.Module], input_shape: Sequence[int], *, name: str,
                input_dtype: torch.dtype = torch.float32, vocab: Optional[int] = None) -> "ZooModel":
        self = super().__new__(cls, (list(blocks), tuple(int(d) for d in input_shape)))
        self.name, self.input_dtype, self.vocab = name, input_dtype, vocab
        return self

    @property
    def blocks(self) -> List[nn.Module]:
        return self[0]

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return self[1]

    def sample_input(self, device: Union[str, torch.device, None] = None,
                     shape: Optional[Sequence[int]] = None, seed: int = 0) -> torch.Tensor:
        """A random input (``shape`` overrides ``input_shape``, e.g. another sequence length)."""
        g = torch.Generator().manual_seed(seed)
        shape = tuple(shape) if shape is not None else self.input_shape
        if self.vocab is not None:
            x = torch.randint(0, self.vocab, shape, generator=g, dtype=self.input_dtype)
        else:
            x = torch.randn(shape, generator=g, dtype=self.input_dtype)
        return x.to(device) if device is not None else x

    def __repr__(self) -> str:
        return f"ZooModel({self.name}, {len(self.blocks)} blocks, input {self.input_shape} {self.input_dtype})"


@contextlib.contextmanager
def on_device(device: Union[str, torch.device, None]) -> Iterator[None]:
    """Build modules directly on ``device`` (``"meta"``: no memory, no init cost)."""
    if device is None:
        yield
    else:
        with torch.device(device):
            yield


def check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be a positive int, got {v!r}")


class Flatten(nn.Module):
    """Global average pool + flatten: torchvision's ``avgpool`` and ``torch.flatten`` as one stage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
