"""Nothing the runtimes touch outlives the model: after a few training steps under
``scheduler.checkpoint`` (every planner, new and repeated shapes) and ``del`` + ``gc.collect()``,
weak references to the model and to every parameter are dead. A reference cycle through
autograd's C++ graph (a saved-tensor hook or node hook holding, through Python objects, a
tensor whose ``grad_fn`` leads back to that graph) is invisible to Python's collector: the
graph, its activations and the parameters it saved would leak, as the Mimose collector's
measuring run once did (~100 MiB per GPT-2 model in bench/hf.py)."""
from __future__ import annotations

import copy
import gc
import warnings
import weakref
from typing import List, Optional

import pytest
import torch
from torch import nn

import scheduler
from scheduler.profile import _trace

from wrap_models import every_block, one_thread  # noqa: F401  (one_thread: autouse fixture)

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
    # Mimose's knob to Mimose, the measurement's to the others (an unread option raises)
    options = {"samples": 3} if planner == "mimose" else \
        {"measure_options": {"repeat": 1, "warmup": 0}}
    model = scheduler.checkpoint(gpt2(), "320KiB", planner=planner, **options)
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


# ------------------------------------------------------------------------------ model loops
class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor,
                skip: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self.drop(torch.tanh(self.lin(x))) * mask
        return y if skip is None else y + skip


class Loop(nn.Module):
    """``changes``: the loop changes the value between blocks (anchored calls); ``skips``: it
    passes block 0's output to every later block as a keyword (a shared argument with autograd
    history from the chain's own graph); ``stop_at``: it raises before calling that block."""

    def __init__(self, changes: bool = False, skips: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Blk() for _ in range(4)])
        self.changes, self.skips = changes, skips
        self.stop_at: Optional[int] = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        first = None
        for i, b in enumerate(self.layers):
            if i == self.stop_at:
                raise KeyboardInterrupt  # not an Exception: no forward hook sees it
            x = b(x, mask, skip=first)
            if self.changes:
                x = x * 2
            if self.skips and i == 0:
                first = x
        return x


@pytest.mark.parametrize("loop", ["changes", "skips", "stops"])
def test_a_forward_dropped_or_stopped_between_blocks_leaks_nothing(loop):
    """What a step keeps of the loop's calls (an anchored value, a shared argument computed
    from an earlier block, the last output while the loop runs between blocks) once reached
    the step's own graph, whose holders reach the step: a graph dropped without its backward,
    or a forward stopped between blocks with the model then deleted, leaked the model. The
    gradients stay plain training's."""
    torch.manual_seed(0)
    plain = Loop(changes=loop == "changes", skips=loop == "skips")
    model = scheduler.checkpoint(copy.deepcopy(plain), None, every_block)
    x, mask = torch.randn(8, 16), torch.ones(8, 16)
    for net in (plain, model):
        torch.manual_seed(1)
        net(x, mask).sum().backward()
    del net
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(),
                                                          model.parameters()))
    if loop == "stops":
        model.stop_at = 2
        try:  # (not pytest.raises: its traceback would keep the frames alive)
            model(x, mask)
        except KeyboardInterrupt:
            pass
    else:
        model(x, mask)  # a forward whose graph is dropped without backward
    refs = _refs(model)
    del model
    gc.collect()
    assert [r() is not None for r in refs] == [False] * len(refs)
