"""Blocks compiled before ``scheduler.checkpoint`` on CUDA (``-m gpu``; skipped without a
device): the chain is measured on the compiled blocks (the allocator's statistics, no op
tracer), every run of every block is the compiled one, recomputations included, and each
step matches compiled plain training (to float tolerance: CUDA kernels may add with
atomics, and deterministic mode refuses some ops an HF model runs; the CPU tests hold the
bits)."""
from __future__ import annotations

import copy

import pytest
import torch

import scheduler
from scheduler.planners import rotor
from test_checkpoint_hf import FAST, _compile_blocks, _counting_backend, make, runners, step

pytestmark = pytest.mark.gpu
DEV = "cuda"


def close(ref, model, lr, lm, what: str) -> None:
    torch.testing.assert_close(lm, lr, msg=f"{what}: loss")
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: {n} grad presence"
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=f"{what}: {n} grad")


def test_cuda_blocks_compiled_before_the_call_run_compiled_and_match():
    torch._dynamo.reset()
    ref, batch = make("llama")
    ref.to(DEV)
    batch = {k: v.to(DEV) for k, v in batch.items()}
    model = copy.deepcopy(ref)
    ref_runs, runs = [0], [0]
    _compile_blocks(ref, _counting_backend(ref_runs), "torch.compile")
    _compile_blocks(model, _counting_backend(runs), "torch.compile")
    scheduler.checkpoint(model, "1GiB", "rotor", measure_options=FAST)
    for seed in range(2):   # the profiling step, then its plan (everything kept)
        close(ref, model, step(ref, batch, seed), step(model, batch, seed), f"{seed}")
    chain = runners(model)[0].last_plan.chain   # measured on CUDA, on the compiled blocks
    scheduler.checkpoint(model, int(rotor.min_memory(chain) * 1.1), "rotor", chain=chain)
    for seed in range(2, 5):
        before = runs[0]
        close(ref, model, step(ref, batch, seed), step(model, batch, seed), f"step {seed}")
        (runner,) = runners(model)
        ran = runner.L + runner.last_stats.recomputed_forwards
        assert runs[0] - before == ran, f"step {seed}: {runs[0] - before} compiled of {ran}"
    assert runner.last_stats.recomputed_forwards > 0
    torch._dynamo.reset()
