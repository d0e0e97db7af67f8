"""Nothing the runtimes touch outlives the model: after a few training steps under
``scheduler.checkpoint`` (every planner, new and repeated shapes) and ``del`` + ``gc.collect()``,
weak references to the model and to every parameter are dead. A reference cycle through
autograd's C++ graph (a saved-tensor hook or node hook holding, through Python objects, a
tensor whose ``grad_fn`` leads back to that graph) is invisible to Python's collector: the
graph, its activations and the parameters it saved would leak, as the Mimose collector's
measuring run once did (~100 MiB per GPT-2 model in bench/hf.py)."""
from __future__ import annotations

import gc
import warnings
import weakref
from typing import List

import pytest
import torch
from torch import nn

import scheduler
from scheduler.profile import _trace

from wrap_models import one_thread  # noqa: F401  (autouse fixture)

import transformers
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*(use_cache|is_gradient_checkpointing).*")

VOCAB = 64
SHAPES = [(2, 8), (2, 12), (2, 16), (2, 8), (2, 20), (2, 16), (2, 16)]  # new and repeated


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
        eos_token_id=0, use_cache=False))


def _refs(model: nn.Module) -> List[weakref.ref]:
    return [weakref.ref(model)] + [weakref.ref(p) for p in model.parameters()]


@pytest.mark.parametrize("planner", ["rotor", "pofo", "periodic", "mimose", "none"])
def test_a_checkpointed_model_is_freed_after_training(planner):
    model = scheduler.checkpoint(gpt2(), "320KiB", planner=planner, samples=3,
                                 measure_options={"repeat": 1, "warmup": 0})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for b, s in SHAPES:  # mimose: collects (measuring runs) on the first 3 sizes, plans after
        ids = torch.randint(0, VOCAB, (b, s))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model(input_ids=ids, labels=ids)  # and a forward whose graph is dropped without backward
    refs = _refs(model)
    del model, opt
    gc.collect()
    assert [r() is not None for r in refs] == [False] * len(refs)


def test_saved_tensors_recorder_keeps_no_graph():
    """``SavedTensors`` (the collector's and the profilers' recorder) on a graph dropped
    without backward: the graph and what it saved are freed with it."""
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with _trace.SavedTensors() as rec:
        y = lin(x).tanh()  # tanh saves its own output: the tensor whose grad_fn saved it
    assert rec.tensors and all(t.grad_fn is None for t in rec.tensors)
    # the graph's nodes keep the pack hook, so the recorder lives exactly as long as they do
    recorder = weakref.ref(rec)
    del y, rec
    gc.collect()
    assert recorder() is None
