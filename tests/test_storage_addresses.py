"""A storage's key is its address (``scheduler.profile.storage``): it names the storage only
while the storage lives. Weights whose storage is replaced during the step (FSDP1 with
use_orig_params gives a parameter a new ``.data`` at each unshard and frees the empty one it
had) and values that die mid-step free addresses a new activation can take: a key kept from
before would leave that activation out of what is measured (different Mimose samples, so
different plans, on two ranks), or protect it from the plan's offload."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

import scheduler

from wrap_models import one_thread  # noqa: F401  (autouse fixture)
from wrap_models import token_batch, transformer_blocks, wrapped_step


def _swap_like_fsdp1(block: nn.Module) -> Callable[[], None]:
    """Each parameter's values live in a buffer (the 'flat parameter', a weight), and the
    parameter holds an empty tensor of its own between steps, as FSDP1's orig params on a
    rank that does not own them; a forward pre-hook points it at the values (freeing the
    empty storage). Returns what empties them again (after the step's backward)."""
    params = [(m, n, p) for m in block.modules() for n, p in m.named_parameters(recurse=False)]
    for i, (m, n, p) in enumerate(params):
        block.register_buffer(f"_flat{i}", p.detach().clone())

    def gather(mod: nn.Module, args: object) -> None:
        for i, (m, n, p) in enumerate(params):
            p.data = getattr(block, f"_flat{i}")

    def release() -> None:
        for i, (m, n, p) in enumerate(params):
            getattr(block, f"_flat{i}").copy_(p.detach())  # (values of an optimizer step)
            p.data = torch.empty(0)

    block.register_forward_pre_hook(gather)
    release()
    return release


def test_mimose_samples_ignore_addresses_freed_during_the_step():
    plain = transformer_blocks(2, 32)
    swapped = transformer_blocks(2, 32)
    releases = [_swap_like_fsdp1(b) for b in swapped]
    got = []
    for blocks in (plain, swapped):
        model = scheduler.wrap(blocks, None, planner="mimose")
        ids = token_batch(4, 16)
        wrapped_step(model, (ids,))   # a collection step
        if blocks is swapped:
            for release in releases:
                release()
        got.append(model.mimose.estimator.measured(ids.numel()).xbar.tolist())
    assert got[0] == got[1]


def test_measured_chain_ignores_addresses_freed_during_a_stage():
    from scheduler.profile import measure_chain
    plain = transformer_blocks(2, 32)
    swapped = transformer_blocks(2, 32)
    for b in swapped:
        _swap_like_fsdp1(b)
    ids = token_batch(4, 16)
    chains = [measure_chain(blocks, ids, loss="sum", repeat=1, warmup=0, input_grad=False)
              for blocks in (plain, swapped)]
    for field in ("xbar", "fw_tmp", "bw_tmp", "fck_tmp"):
        assert list(getattr(chains[0], field)) == list(getattr(chains[1], field)), field


def test_a_dead_passed_through_storage_is_no_longer_protected():
    from scheduler.runtime.block_calls import BlockCall
    from scheduler.runtime.chain_exec import ChainStep
    from scheduler.runtime.compiled_plan import CompiledPlan
    from scheduler.planners.mimose import plan_from_checkpoints
    blocks = [nn.Identity(), nn.Identity()]
    step = ChainStep(blocks, CompiledPlan.of(plan_from_checkpoints(2, []), 2), lambda *a: None)
    x = torch.randn(16)
    step.offloader.note_passed([x], BlockCall((x,), {}, None))  # block 0 returned its argument
    assert step.offloader.passed_through() == {x.untyped_storage()._cdata}
    del x   # the value died: its address may be a new activation's
    taken = [torch.empty(16).untyped_storage()._cdata for _ in range(8)]
    assert not step.offloader.passed_through() & set(taken)
    assert step.offloader.passed_through() == set()
