"""``scheduler.checkpoint`` called again through another module than the first time: a wrapper
holding the checkpointed model (peft's ``PeftModel``, a user's module), a part of it
(``model.transformer``) or a parent. The second call replaces the first, wherever that was
made (never two wrappers on a block), ``undo`` and ``checkpointed`` see through wrappers, and
blocks whose installation died with the module it was made on (``merge_and_unload()``) say so
at the next training step and are unwrapped by the next call or ``undo``."""
from __future__ import annotations

import copy
import gc
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

import scheduler
from scheduler.planners.mimose import plan_from_checkpoints
from scheduler.runtime.checkpoint import _BlockForward, checkpointed, undo
from test_checkpoint_hf import FAST, assert_same, budgets, make, step

GONE = "plan went with it"


class Wrapper(nn.Module):
    """A module holding the model and calling it: what a user's training wrapper does."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model

    def forward(self, **kwargs: Any) -> Any:
        return self.m(**kwargs)


def _forwards(blocks: nn.ModuleList) -> List[Any]:
    return [b.__dict__.get("forward") for b in blocks]


def _assert_wrapped_once(blocks: nn.ModuleList) -> None:
    for s, fwd in enumerate(_forwards(blocks)):
        assert isinstance(fwd, _BlockForward), f"block {s} not checkpointed"
        assert not isinstance(fwd.own, _BlockForward), f"block {s} wrapped twice"


def _steps(ref: nn.Module, model: nn.Module, trained: nn.Module, batch: Dict[str, Any],
           seeds: range, what: str) -> List[warnings.WarningMessage]:
    """Steps of ``trained`` (``model`` or a wrapper of it) against plain ``ref``: losses and
    gradients bit-identical; the warnings they gave."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for seed in seeds:
            assert_same(ref, model, step(ref, batch, seed), step(trained, batch, seed),
                        f"{what}, step {seed}")
    return list(said)


def _targets(model: nn.Module, outer: nn.Module) -> Dict[str, nn.Module]:
    return {"model": model, "wrapper": outer, "transformer": model.transformer}


def _hooks(on: Dict[str, nn.Module]) -> Dict[str, int]:
    return {k: len(m._forward_pre_hooks) + len(m._forward_hooks) for k, m in on.items()}


@pytest.mark.parametrize("first,second", [("model", "wrapper"), ("model", "transformer"),
                                          ("wrapper", "model"), ("transformer", "model")])
def test_a_second_call_through_another_module_replaces_the_first(first, second):
    """The budget changed by a call on a wrapper of the model, a part of it or a parent of
    the module the first call was made on: one wrapper per block, running the new call's plan
    (every block recomputed at the smallest budget), bit-identical to plain training, the
    first call's runner and tail probe gone, and no block run 'a second time'."""
    ref, batch = make("gpt2")
    model = copy.deepcopy(ref)
    outer = Wrapper(model)
    on = _targets(model, outer)
    hooks = _hooks(on)
    scheduler.checkpoint(on[first], 1 << 40, measure_options=FAST)
    (old,) = checkpointed(on[first]).runners
    _steps(ref, model, outer, batch, range(2), "first call")
    small = budgets("gpt2")[0]
    scheduler.checkpoint(on[second], small, measure_options=FAST)
    blocks = model.transformer.h
    _assert_wrapped_once(blocks)
    (runner,) = checkpointed(on[second]).runners
    assert runner is not old and all(f._runner() is runner for f in _forwards(blocks))
    assert runner.budget == small
    said = _steps(ref, model, outer, batch, range(2, 5), f"{second} after {first}")
    assert runner.last_stats.recomputed_forwards > 0, "the new budget's plan did not run"
    assert not [str(w.message) for w in said if "second time" in str(w.message)]
    undo(on[first])  # wherever it was made, undo through any of the modules removes it
    assert not any(_forwards(blocks)) and checkpointed(on[second]) is None
    assert _hooks(on) == hooks, "a tail probe or KV-cache hook left behind"


def test_undo_and_checkpointed_see_through_a_wrapper():
    """``undo(wrapper)`` removes an installation made on the model inside it (the forwards,
    the tail probe, the KV-cache hooks); ``checkpointed(wrapper)`` finds it, and is None when
    two models inside the wrapper are checkpointed each (which one would be a guess)."""
    _, batch = make("gpt2")
    model, other = make("gpt2")[0], make("gpt2", seed=1)[0]
    outer = Wrapper(model)
    hooks = (len(model._forward_pre_hooks), len(model.transformer._forward_pre_hooks))
    scheduler.checkpoint(model, None, plan_from_checkpoints(4, range(4)))
    assert checkpointed(outer) is checkpointed(model)
    step(outer, batch, 0)
    assert checkpointed(outer).stats()["transformer.h"]["last_recomputed_forwards"] == 4
    pair = nn.ModuleList([model, other])
    scheduler.checkpoint(other, None, plan_from_checkpoints(4, range(4)))
    assert checkpointed(pair) is None
    undo(outer)
    assert not any(_forwards(model.transformer.h)) and checkpointed(model) is None
    assert (len(model._forward_pre_hooks), len(model.transformer._forward_pre_hooks)) == hooks
    assert all(_forwards(other.transformer.h)), "undo(outer) reached a model outside it"


def test_blocks_whose_installation_is_gone_say_so_and_are_unwrapped():
    """The module the call was made on dropped (the model inside it trained on): the first
    step that wants gradients warns once that the plan no longer applies (steps stay plain
    training's); the next call on the model unwraps the dead wrappers instead of nesting on
    them, and ``undo`` removes them."""
    ref, batch = make("gpt2")
    model = copy.deepcopy(ref)
    outer = Wrapper(model)
    scheduler.checkpoint(outer, None, plan_from_checkpoints(4, range(4)))
    _steps(ref, model, outer, batch, range(1), "through the wrapper")
    del outer
    gc.collect()
    blocks = model.transformer.h
    assert all(isinstance(f, _BlockForward) for f in _forwards(blocks))
    assert checkpointed(model) is None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say where no plan would run
        model(**batch)
    said = _steps(ref, model, model, batch, range(1, 3), "the wrapper gone")
    gone = [str(w.message) for w in said if GONE in str(w.message)]
    assert len(gone) == 1 and "'m.transformer.h' of the Wrapper" in gone[0], gone
    assert issubclass(next(w.category for w in said if GONE in str(w.message)), RuntimeWarning)
    scheduler.checkpoint(model, None, plan_from_checkpoints(4, range(4)))
    _assert_wrapped_once(blocks)
    said = _steps(ref, model, model, batch, range(3, 5), "checkpointed again")
    assert not [w for w in said if GONE in str(w.message)]
    assert checkpointed(model).runners[0].last_stats.recomputed_forwards == 4
    # dead wrappers alone: undo removes them too
    outer = Wrapper(model)
    scheduler.checkpoint(outer, None, plan_from_checkpoints(4, range(4)))
    del outer
    gc.collect()
    undo(model)
    assert not any(_forwards(blocks))


# ------------------------------------------------------------------------------ peft
def _lora() -> Tuple[Any, Any]:
    peft = pytest.importorskip("peft")
    return peft, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


@pytest.mark.filterwarnings("ignore:.*(KV cache|is_gradient_checkpointing)")
def test_the_line_again_on_a_peft_model_replaces_the_call_on_its_base():
    """README order: the line, then ``get_peft_model``; then the line again on the peft model
    (a new budget). It replaces the call on the base model: one wrapper per block, the new
    budget's plan, bit-identical to plain LoRA training; ``checkpointed`` and ``undo`` on
    the peft model reach the call on its base."""
    peft, lora = _lora()
    ref, batch = make("llama")
    ref = peft.get_peft_model(ref, lora)
    ref.train()
    base, _ = make("llama")
    scheduler.checkpoint(base, 1 << 40, measure_options=FAST)
    model = peft.get_peft_model(base, lora)
    model.load_state_dict(ref.state_dict())
    model.train()
    assert checkpointed(model) is checkpointed(base) is not None
    _steps(ref, model, model, batch, range(2), "the line, then peft")
    small = budgets("llama")[0]
    scheduler.checkpoint(model, small, measure_options=FAST)
    blocks = base.model.layers
    _assert_wrapped_once(blocks)
    assert checkpointed(base) is None and checkpointed(model).runners[0].budget == small
    said = _steps(ref, model, model, batch, range(2, 5), "the line again on peft")
    assert not [w for w in said if "second time" in str(w.message)]
    assert checkpointed(model).runners[0].last_stats.recomputed_forwards > 0
    scheduler.checkpoint(base, small, measure_options=FAST)  # and back on the base
    _assert_wrapped_once(blocks)
    assert checkpointed(model) is checkpointed(base)
    undo(model)
    assert not any(_forwards(blocks)) and checkpointed(base) is None


@pytest.mark.filterwarnings("ignore:.*(KV cache|is_gradient_checkpointing)")
def test_a_merged_peft_model_says_its_plan_is_gone_and_checkpoints_again():
    """``merge_and_unload()`` of a checkpointed peft model, the peft model dropped: the merged
    model's first training step warns that the plan no longer applies; the line again on it
    checkpoints it afresh (no wrapper on a dead one), and ``undo`` unwraps."""
    peft, lora = _lora()
    ref, batch = make("llama")
    ref = peft.get_peft_model(ref, lora)
    ref.train()
    model = copy.deepcopy(ref)
    scheduler.checkpoint(model, 1 << 40, measure_options=FAST)
    _steps(ref, model, model, batch, range(2), "lora")
    ref = ref.merge_and_unload().requires_grad_(True)
    model = model.merge_and_unload().requires_grad_(True)
    gc.collect()  # the peft model, with its runner
    blocks = model.model.layers
    assert checkpointed(model) is None
    said = _steps(ref, model, model, batch, range(2, 4), "merged")
    assert len([w for w in said if GONE in str(w.message)]) == 1
    scheduler.checkpoint(model, None, plan_from_checkpoints(4, range(4)))
    _assert_wrapped_once(blocks)
    _steps(ref, model, model, batch, range(4, 6), "merged, checkpointed again")
    assert checkpointed(model).runners[0].last_stats.recomputed_forwards == 4
    undo(model)
    assert not any(_forwards(blocks))


def test_a_second_model_sharing_the_blocks_replaces_the_first_call_and_says_so():
    # a multi-task trunk under two heads, each checkpointed: a block runs one plan, so the
    # second call removes the first; the first model's steps change, which must be said
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(x)) + x

    class Head(nn.Module):
        def __init__(self, trunk: nn.ModuleList, out: int) -> None:
            super().__init__()
            self.layers, self.head = trunk, nn.Linear(16, out)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.layers:
                x = b(x)
            return self.head(x)

    trunk = nn.ModuleList([Block() for _ in range(4)])
    a, b = Head(trunk, 3), Head(trunk, 5)
    scheduler.checkpoint(a, "1GiB")
    with pytest.warns(RuntimeWarning, match="shares checkpointed blocks with a Head"):
        scheduler.checkpoint(b, "1GiB")
    assert checkpointed(a) is None and checkpointed(b) is not None
