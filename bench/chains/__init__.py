"""The bundled chains: ``names()``, ``path(name)``, ``load(name) -> scheduler.Chain``.

Names are ``<cnn>-i<image>-b<batch>`` (e.g. ``resnet101-i1000-b8``) and
``<gpt2|bert>-s<seq_len>-b<batch>``; ``make_chains.py`` regenerates them.
"""
from __future__ import annotations

import os
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))


def names() -> List[str]:
    return sorted(f[:-5] for f in os.listdir(HERE) if f.endswith(".json"))


def path(name: str) -> str:
    p = os.path.join(HERE, name + ".json")
    if not os.path.exists(p):
        raise ValueError(f"name: no bundled chain {name!r}; available: {', '.join(names())}")
    return p


def load(name: str):
    from scheduler.chain import Chain
    return Chain.from_json(path(name))
