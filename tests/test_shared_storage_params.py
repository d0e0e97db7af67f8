"""Parameters that are views of one flat buffer (torch's ZeroRedundancyOptimizer with
``parameters_as_bucket_view=True``, DeepSpeed ZeRO-1/2, Megatron's contiguous buffers): the
chain scheduler.checkpoint measures is the one of the same model with a storage per weight.
A tail weight is tied to the head only when it is the same autograd leaf (GPT-2's LM head *is*
its token embedding), not when it merely shares the head's storage, and a weight's gradient
is its own size, not its storage's (the whole buffer)."""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

import scheduler

from test_checkpoint_hf import FAST, assert_same, make, step
from wrap_models import one_thread

_AUTOUSE = (one_thread,)  # an autouse fixture: imported to run here (one thread)

MEMORY = ("x", "xbar", "delta", "fw_tmp", "fck_tmp", "bw_tmp")


def flatten_params(model: nn.Module) -> torch.Tensor:
    """What ZeRO-1/2 and the contiguous buffers do: one flat buffer, each weight a view of it
    (same values; a tied weight, one Parameter, is one view)."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    off = 0
    for p in params:
        n = p.numel()
        p.data = flat[off:off + n].view_as(p)
        off += n
    return flat


def measured(name: str, flat: bool) -> Tuple[nn.Module, nn.Module, Any, Dict[str, Any]]:
    """A plain reference, the model (its weights views of one buffer if ``flat``), both after
    the profiling step (gradients equal), the chain scheduler.checkpoint measured, the batch."""
    ref, batch = make(name)
    model = copy.deepcopy(ref)
    if flat:
        flatten_params(model)
        assert len({p.untyped_storage()._cdata for p in model.parameters()}) == 1
    chains: List[Any] = []
    scheduler.checkpoint(model, 1 << 40, "rotor", measure_options=FAST,
                         on_chain=lambda c: chains.append(c) or c)
    assert_same(ref, model, step(ref, batch, 0), step(model, batch, 0), name)
    (c,) = chains
    return ref, model, c, batch


def memory_of(c: Any) -> Dict[str, Any]:
    """The chain's sizes (not its times), what it holds outside, and the tail's sizes."""
    tail = {k: v for k, v in c.meta["tail"].items() if k not in ("fw", "bw")}
    return {**{k: list(getattr(c, k)) for k in MEMORY}, "outside": c.meta["outside"],
            "tail": tail}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_flat_buffer_chain_is_the_plain_ones(name):
    """Llama (LM head untied): no tied gradient with or without the buffer (it once counted
    every weight as tied, each the size of the whole buffer: bw_tmp[L] and every op's
    'outside' grew by all the parameters); GPT-2 (LM head tied): its one tied gradient, the
    embedding's size, both ways."""
    _, plain_model, plain, _ = measured(name, flat=False)
    _, _, flat, _ = measured(name, flat=True)
    assert memory_of(flat) == memory_of(plain)
    lm = plain_model.get_output_embeddings().weight
    tied = lm is plain_model.get_input_embeddings().weight
    assert tied == (name == "gpt2")
    assert flat.meta["outside"]["tied_grads"] == (lm.numel() * lm.element_size() if tied else 0)


def test_flat_buffer_plan_runs_bit_identical():
    """The plan made on the flat model's chain trains as the plain model does."""
    ref, model, _, batch = measured("llama", flat=True)
    for seed in (1, 2):
        assert_same(ref, model, step(ref, batch, seed), step(model, batch, seed), "llama")
