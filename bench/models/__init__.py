"""The benchmark model zoo, written for this project (no torchvision needed).

Every builder returns a ``ZooModel``: a ``(blocks, input_shape)`` pair (a chain of ``nn.Module``
blocks, each taking the previous block's output) that also carries ``input_dtype``, ``vocab``,
``name`` and ``sample_input()``. Pass ``device="meta"`` to build without memory or init cost
(what ``scheduler.profile.meta_chain`` needs).

    from bench.models import build
    blocks, shape = build("resnet101", batch=8, image=1000, device="meta")
"""
from typing import Any, Callable, Dict

from .bert import bert
from .common import ZooModel
from .densenet import densenet, densenet121, densenet201
from .gpt2 import gpt2
from .resnet import resnet, resnet18, resnet34, resnet50, resnet101, resnet152, resnet1001

#: name -> builder. CNNs take ``batch, image, num_classes, device``; transformers ``batch, seq_len, device``.
ZOO: Dict[str, Callable[..., ZooModel]] = {
    "resnet18": resnet18, "resnet34": resnet34, "resnet50": resnet50, "resnet101": resnet101,
    "resnet152": resnet152, "resnet1001": resnet1001,
    "densenet121": densenet121, "densenet201": densenet201,
    "gpt2": gpt2, "bert": bert,
}


def build(name: str, **kwargs: Any) -> ZooModel:
    if name not in ZOO:
        raise ValueError(f"name: unknown model {name!r}; the zoo has {sorted(ZOO)}")
    return ZOO[name](**kwargs)


__all__ = ["ZOO", "ZooModel", "build", "bert", "densenet", "densenet121", "densenet201", "gpt2",
           "resnet", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnet1001"]
