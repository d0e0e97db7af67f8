"""Mimose learns per input size, and the bytes a step holds per input size depend on the
dtypes, the autocast state and train mode (``mimose_steps.mimose_setting``): samples learnt
under one setting never plan a step of another. A model learnt in bfloat16 and then cast to
float32 (``model.float()``), or learnt under autocast and then trained without it, collects
again and stays within its budget by the runner's own held bytes (``last_peak_bytes``), with
gradients bit-identical to plain training; a setting that comes back finds its samples."""
from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from torch import nn

import scheduler
from scheduler import simulate
from scheduler.planners.mimose import Mimose, chain_from_estimate, plan_from_checkpoints
from scheduler.runtime import mimose_steps
from scheduler.runtime.checkpoint import checkpointed

from test_checkpoint_hf import VOCAB, assert_same, make, step
import wrap_models
from wrap_models import plain_step, wrapped_step

one_thread = wrap_models.one_thread  # the autouse fixture, in this module's namespace

SIZES = (8, 10, 12)       # sequence lengths learnt (samples=3)
LATER = (12, 8, 10, 12, 9, 11)
SETTING_SAID = "Mimose: block 0 of 'transformer.h' is called with"


def batch(seq: int, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def budget() -> int:
    """A float32 budget a fifth of the way from GPT-2's every-block-checkpointed peak to its
    store-all peak at the longest length (from a float32 Mimose's own samples): a plan from
    bfloat16 samples keeps far too much there."""
    model, _ = make("gpt2")
    scheduler.checkpoint(model, 1 << 40, "mimose", samples=3)
    for i, seq in enumerate(SIZES):
        step(model, batch(seq, i), i)
    (r,) = checkpointed(model).runners
    chain = chain_from_estimate(r.mimose.estimator.measured(2 * SIZES[-1] * 32))
    floor = simulate(chain, plan_from_checkpoints(chain.L, range(chain.L))).peak_memory
    top = simulate(chain, plan_from_checkpoints(chain.L, [])).peak_memory
    return int(floor + 0.2 * (top - floor))


def twin(budget: int, dtype: torch.dtype = torch.float32, **options: Any
         ) -> Tuple[nn.Module, nn.Module, Any]:
    """Plain GPT-2 and a copy under ``scheduler.checkpoint(planner="mimose")``, and its runner."""
    ref, _ = make("gpt2")
    ref.to(dtype)
    model = copy.deepcopy(ref)
    if "mimose" not in options:
        options["samples"] = 3
    scheduler.checkpoint(model, budget, "mimose", track_memory=True, **options)
    (r,) = checkpointed(model).runners
    return ref, model, r


def train(ref: nn.Module, model: nn.Module, r: Any, budget: int, seqs: Any, first: int,
          ctx: Any = contextlib.nullcontext, what: str = "") -> List[str]:
    """Steps of both models at these lengths, checked bit-identical and within the budget
    (the runner's held bytes); the setting-change warnings they gave."""
    said: List[str] = []
    for i, seq in enumerate(seqs, start=first):
        b = batch(seq, i)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with ctx():
                lm = step(model, b, i)
        said += [str(x.message) for x in w if SETTING_SAID in str(x.message)]
        with ctx():
            lr = step(ref, b, i)
        assert_same(ref, model, lr, lm, f"{what} seq {seq}")
        peak = r.stats()["last_peak_bytes"]
        assert peak <= budget, (f"{what} seq {seq}: the runner held {peak} B, budget {budget} B "
                                f"({peak / budget:.2f}x)")
    return said


@contextlib.contextmanager
def cpu_autocast() -> Iterator[None]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yield


# ------------------------------------------------------------------------- the settings
def test_the_setting_is_dtypes_grad_mode_and_autocast_not_masks():
    x = torch.randn(2, 3, 4, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    base = mimose_steps.mimose_setting((x,), {"attention_mask": None}, True)
    # an integer or boolean tensor coming and going (dynamic padding's mask) and the shape:
    # the same setting; another dtype, gradient flag, mode or autocast state: another one
    assert mimose_steps.mimose_setting((x,), {"attention_mask": mask}, True) == base
    assert mimose_steps.mimose_setting((torch.randn(5, 7, 4, requires_grad=True),), {},
                                        True) == base
    others = [mimose_steps.mimose_setting((x.detach().bfloat16().requires_grad_(),), {}, True),
              mimose_steps.mimose_setting((x.detach(),), {}, True),
              mimose_steps.mimose_setting((x,), {}, False)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        others.append(mimose_steps.mimose_setting((x,), {}, True))
    assert len({base, *others}) == 5
    said = mimose_steps.describe_setting(others[-1])
    assert "float32 on cpu" in said and "cpu autocast to bfloat16" in said


# ------------------------------------------------------------------------- dtype change
def test_bfloat16_samples_never_plan_float32_steps(budget):
    """The reviewer's case: learnt on a bfloat16 model, then ``model.float()``: before, the
    float32 steps were planned from the bfloat16 samples and held up to 1.3x the budget."""
    ref, model, r = twin(budget, torch.bfloat16)
    assert train(ref, model, r, budget, SIZES, 0, what="bf16") == []
    learnt = r.mimose
    assert learnt.ready and r.collections == 3
    ref.float()
    model.float()
    said = train(ref, model, r, budget, LATER, len(SIZES), what="fp32 after bf16")
    assert len(said) == 1 and "float32 on cpu" in said[0] and "bfloat16 on cpu" in said[0]
    assert "collects 3 input sizes" in said[0]
    assert r.mimose is not learnt and r.mimose.ready and r.collections == 6
    assert r.last_plan.planner == "mimose"  # planned, not collecting, at the end
    assert learnt.ready and len(learnt.estimator.sizes) == 3  # the bfloat16 samples kept
    # back to bfloat16: its samples plan again, nothing collected, nothing said
    ref.to(torch.bfloat16)
    model.to(torch.bfloat16)
    assert train(ref, model, r, budget, (12, 9), 20, what="bf16 again") == []
    assert r.mimose is learnt and r.collections == 6


# ------------------------------------------------------------------------- autocast
def test_autocast_then_none_collects_again_and_back_reuses_the_samples(budget):
    ref, model, r = twin(budget)
    assert train(ref, model, r, budget, SIZES, 0, cpu_autocast, "autocast") == []
    under_autocast = r.mimose
    said = train(ref, model, r, budget, LATER, len(SIZES), what="no autocast after autocast")
    assert len(said) == 1 and "no autocast" in said[0] and "cpu autocast to bfloat16" in said[0]
    assert r.mimose is not under_autocast and r.collections == 6
    assert r.last_plan.planner == "mimose"
    assert train(ref, model, r, budget, (12, 9, 11), 20, cpu_autocast, "autocast again") == []
    assert r.mimose is under_autocast and r.collections == 6 and \
        r.last_plan.planner == "mimose"


# ------------------------------------------------------------- autocast, train mode: wrap
D = 32


class MLP(nn.Module):
    """Linear layers, relu and dropout: under CPU autocast every activation is bfloat16, in
    eval mode no dropout output or mask is kept, so either holds about half the bytes."""

    def __init__(self):
        super().__init__()
        self.up, self.mid, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, 4 * D), \
            nn.Linear(4 * D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.up(x)))
        return x + self.down(self.drop(torch.relu(self.mid(h))))


def mlp_blocks() -> List[nn.Module]:
    torch.manual_seed(0)
    return [MLP() for _ in range(4)]


def x_of(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 128, D, generator=torch.Generator().manual_seed(seed))


MLP_SIZES = (4, 6, 8)   # batch sizes learnt (samples=3)
MLP_LATER = (8, 5, 7, 8, 4, 6)


@pytest.fixture(scope="module")
def mlp_budget() -> int:
    """As ``budget``, for the MLP blocks in train mode without autocast, at batch 8."""
    probe = scheduler.wrap(mlp_blocks(), None, planner="mimose", samples=3)
    for i, n in enumerate(MLP_SIZES):
        wrapped_step(probe, (x_of(n, i),), i)
    chain = chain_from_estimate(probe.mimose.estimator.measured(MLP_SIZES[-1] * 128 * D))
    floor = simulate(chain, plan_from_checkpoints(chain.L, range(chain.L))).peak_memory
    top = simulate(chain, plan_from_checkpoints(chain.L, [])).peak_memory
    return int(floor + 0.2 * (top - floor))


def mlp_train(ref: List[nn.Module], model: Any, budget: int, sizes: Any, first: int,
              ctx: Any = contextlib.nullcontext, what: str = "") -> List[str]:
    """``train`` for the wrapped MLP blocks and their plain twins."""
    said: List[str] = []
    for i, n in enumerate(sizes, start=first):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with ctx():
                got = wrapped_step(model, (x_of(n, i),), seed=i)
        said += [str(x.message) for x in w if "Mimose: block 0 of 'blocks'" in str(x.message)]
        for b in ref:
            b.zero_grad(set_to_none=True)
        with ctx():
            want = plain_step(ref, (x_of(n, i),), seed=i)
        assert torch.equal(got[0], want[0]) and \
            all(torch.equal(a, b) for a, b in zip(got[1], want[1])), f"{what} batch {n}"
        peak = model.stats()["last_peak_bytes"]
        assert peak <= budget, (f"{what} batch {n}: the runner held {peak} B, budget {budget} B "
                                f"({peak / budget:.2f}x)")
    return said


@pytest.mark.parametrize("learnt", ["autocast", "eval"])
def test_samples_learnt_under_autocast_or_in_eval_never_plan_training_steps(mlp_budget,
                                                                            learnt):
    """Before, the training steps held up to 1.6x (learnt under autocast) and 2.1x
    (learnt in eval mode with gradients) the budget."""
    ref = mlp_blocks()
    model = scheduler.wrap(copy.deepcopy(ref), mlp_budget, planner="mimose", samples=3,
                           track_memory=True)
    ctx: Any = cpu_autocast if learnt == "autocast" else contextlib.nullcontext
    if learnt == "eval":
        for b in [*ref, *model.blocks]:
            b.eval()
    assert mlp_train(ref, model, mlp_budget, MLP_SIZES, 0, ctx, learnt) == []
    first = model.mimose
    for b in [*ref, *model.blocks]:
        b.train()
    said = mlp_train(ref, model, mlp_budget, MLP_LATER, len(MLP_SIZES),
                     what=f"train, no autocast after {learnt}")
    assert len(said) == 1 and ("cpu autocast to bfloat16" if learnt == "autocast"
                               else "eval mode") in said[0]
    assert model.mimose is not first and model.stats()["mimose_collections"] == 6
    assert model.last_plan.planner == "mimose"


# ------------------------------------------------------------------------- mimose=
def test_a_shared_mimose_learnt_under_another_setting_is_not_reused(budget):
    shared = Mimose(4, samples=3)
    ref16, model16, r16 = twin(budget, torch.bfloat16, mimose=shared)
    train(ref16, model16, r16, budget, SIZES, 0, what="bf16")
    assert r16.mimose is shared and shared.ready
    ref32, model32, r32 = twin(budget, mimose=shared)
    said = train(ref32, model32, r32, budget, LATER, 0, what="fp32 sharing a bf16 Mimose")
    assert len(said) == 1 and "the Mimose given as mimose= learnt its samples" in said[0]
    assert r32.mimose is not shared and r32.collections == 3
    assert len(shared.estimator.sizes) == 3  # nothing of float32 learnt into it


def test_settings_beyond_the_limit_drop_the_oldest_loudly(budget, monkeypatch):
    monkeypatch.setattr(mimose_steps, "MIMOSE_SETTINGS", 1)
    ref, model, r = twin(budget, torch.bfloat16)
    train(ref, model, r, budget, SIZES, 0, what="bf16")
    ref.float()
    model.float()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step(model, batch(12, 3), 3)
    said = [str(x.message) for x in w]
    assert len(said) == 2 and SETTING_SAID in said[0]
    assert "the samples learnt with bfloat16 on cpu" in said[1] and \
        "(3 input sizes) are dropped, and collected again" in said[1]
    assert len(r._mimoses) == 1


# ------------------------------------------------- block 0 takes token ids only: the weights
@pytest.mark.parametrize("planner", ["rotor", "mimose"])
def test_a_cast_of_the_weights_is_seen_where_block_0_takes_token_ids(planner):
    """An embedding block first: no argument of block 0 shows the dtype, so before, the
    chain measured (rotor) or the samples learnt (Mimose) in bfloat16 planned the float32
    steps after ``model.float()``. The weights' dtype is part of the key and the setting."""
    ids = [wrap_models.token_batch(2, n, seed=i) for i, n in enumerate((12, 16, 20, 20))]
    model = scheduler.wrap(wrap_models.transformer_blocks(), 1 << 30, planner=planner,
                           **({"samples": 3} if planner == "mimose" else {}))
    model.to(torch.bfloat16)
    for i, x in enumerate(ids[:3]):
        wrapped_step(model, (x,), i)
    before = model.stats()
    model.float()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        wrapped_step(model, (ids[3],), 3)
    after = model.stats()
    if planner == "rotor":  # the bfloat16 chain of length 20 is not reused: measured anew
        assert after["chains_measured"] == before["chains_measured"] + 1
    else:
        said = [str(x.message) for x in w if "Mimose: block 0 of 'blocks'" in str(x.message)]
        assert len(said) == 1 and "float32 weights" in said[0] and \
            "bfloat16 weights" in said[0], said
        assert after["mimose_collections"] == before["mimose_collections"] + 1


def test_a_runner_pickled_before_the_weights_dtype_loads_and_keeps_its_samples():
    """``torch.save(model)`` before this change: settings of 4 entries, no ``_shapes``; loading
    one raised AttributeError, then ValueError (unpacking the old settings)."""
    import pickle
    model = scheduler.wrap(wrap_models.transformer_blocks(), 1 << 30, planner="mimose",
                           samples=3)
    ids = [wrap_models.token_batch(2, n, seed=i) for i, n in enumerate((12, 16, 20, 14))]
    for i, x in enumerate(ids[:3]):
        wrapped_step(model, (x,), i)
    r = model.runner
    del r.__dict__["_shapes"]   # as a runner pickled before it
    r._mimoses = {(k[0], *k[2:]): m for k, m in r._mimoses.items()}
    for m in r._mimoses.values():
        m.setting = (m.setting[0], *m.setting[2:])
    back = pickle.loads(pickle.dumps(model))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        wrapped_step(back, (ids[3],), 3)
    assert not [x for x in w if SETTING_SAID[:20] in str(x.message)]
    assert back.stats()["mimose_collections"] == 3 and back.last_plan.planner == "mimose"
