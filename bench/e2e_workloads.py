"""bench/e2e.py's workloads: the models it trains (the project's zoo at full size on a GPU,
tiny in the CPU smoke), their inputs at each step (bert-dyn: a seeded draw of sequence
lengths), and the loss every method trains on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Workload:
    """A model at one batch size: blocks, the inputs of successive steps (one, or several of
    different sequence lengths), targets, and how to count throughput."""
    model: str
    batch: int
    blocks: List[nn.Module]
    inputs: List[torch.Tensor]
    unit: str                  # images/s or tokens/s
    seed: int
    targets: Optional[torch.Tensor] = None

    def input(self, step: int) -> torch.Tensor:
        return self.inputs[step % len(self.inputs)]

    def items(self, step: int) -> int:
        """Images, or tokens, that step ``step`` trains on."""
        x = self.input(step)
        return x.shape[0] if self.unit == "images/s" else x.numel()


SMOKE_SIZES = {"resnet": dict(image=32, num_classes=10),
               "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab=128),
               "bert": dict(n_layer=2, hidden=64, heads=4, intermediate=128, vocab=128)}
# BERT-style with variable sequence lengths (the Mimose path): a fixed, seeded draw per run
DYNAMIC_LENGTHS = {True: (8, 32), False: (64, 512)}   # smoke: tiny; GPU: GLUE-like range
DYNAMIC_STEPS = 16                                    # distinct inputs cycled through


def parse_model(model: str) -> Tuple[str, Optional[int], bool]:
    """``resnet50`` / ``gpt2-s2048`` (sequence length) / ``bert-dyn`` (variable lengths)
    -> (zoo name, sequence length, dynamic)."""
    name, _, suffix = model.partition("-")
    if model.startswith("resnet") and not suffix:
        return model, None, False
    if name in ("gpt2", "bert") and suffix.startswith("s") and suffix[1:].isdigit():
        return name, int(suffix[1:]), False
    if name == "bert" and suffix == "dyn":
        return name, None, True
    raise ValueError(f"--models: cannot read {model!r} (resnet<depth>, gpt2-s<seq>, "
                     "bert-s<seq>, bert-dyn)")


def known_models() -> str:
    """The --models names bench/e2e.py can train, for an error message."""
    from bench.models import ZOO
    return (", ".join(k for k in ZOO if k.startswith("resnet"))
            + ", gpt2-s<seq>, bert-s<seq>, bert-dyn")


def model_error(model: str) -> Optional[str]:
    """Why ``model`` (a --models name) cannot be trained, or None: a name ``parse_model``
    cannot read, or a model the zoo does not have (``resnet5``). bench/e2e.py checks its
    --models with it, and scripts/gpu-check its own before it builds anything."""
    try:
        zoo_name = parse_model(model)[0]
    except ValueError as exc:
        return str(exc)
    from bench.models import ZOO
    if zoo_name not in ZOO:
        return f"--models {model!r}: the model zoo has no {zoo_name!r} (it has {known_models()})"
    return None


def zoo_spec(model: str, smoke: bool) -> Tuple[str, str, bool, Dict[str, Any]]:
    """(zoo name, family, dynamic, the zoo builder's keyword arguments) of ``model``; a dynamic
    model is built for its longest input."""
    name, seq_len, dynamic = parse_model(model)
    family = "resnet" if name.startswith("resnet") else name
    kw: Dict[str, Any] = dict(SMOKE_SIZES[family]) if smoke else {}
    if dynamic:
        kw["seq_len"] = DYNAMIC_LENGTHS[smoke][1]
    elif seq_len is not None:
        kw["seq_len"] = seq_len
    return name, family, dynamic, kw


def build_workload(model: str, batch: int, device: torch.device, smoke: bool,
                   seed: int) -> Workload:
    from bench.models import build  # the project's own zoo (no torchvision)

    name, family, dynamic, kw = zoo_spec(model, smoke)
    lengths: List[Optional[int]] = [None]
    if dynamic:
        lo, hi = DYNAMIC_LENGTHS[smoke]
        g = torch.Generator().manual_seed(seed + 2)
        lengths = [int(v) for v in torch.randint(lo, hi + 1, (DYNAMIC_STEPS,), generator=g)]
    torch.manual_seed(seed)  # the same weights for every method
    zm = build(name, batch=batch, device=device, **kw)
    blocks = [b.to(device) for b in zm.blocks]
    inputs = [zm.sample_input(device=device, seed=seed + i,
                              shape=None if n is None else (batch, n))
              for i, n in enumerate(lengths)]
    return Workload(model, batch, blocks, inputs,
                    "images/s" if family == "resnet" else "tokens/s", seed)


def loss_of(out: torch.Tensor, wl: Workload) -> torch.Tensor:
    """Cross entropy against fixed random targets shaped after the output (the same for every
    method, so losses compare bit for bit)."""
    if wl.targets is None:
        g = torch.Generator().manual_seed(wl.seed + 1)
        wl.targets = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g).to(out.device)
    if out.dim() < 2:
        return out.float().mean()
    return F.cross_entropy(out.float().flatten(0, -2), wl.targets.flatten())
