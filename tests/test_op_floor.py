"""scheduler.profile.op_floor: the largest operator of a training step, on the meta device, and
bench/e2e.py's use of it (jobs below the floor are reported infeasible, not run)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from scheduler.profile.op_floor import op_floor

GiB = 1 << 30


def test_a_batchnorm_step_is_its_backward_exactly():
    """native_batch_norm_backward holds grad_out, input and grad_in (3 N C H W floats) and four
    per-channel vectors (saved mean and inverse std, the weight's and bias's gradients); the
    weight and running statistics are the model's and are left out. (loss "mse": its gradient
    is dense; "sum"'s is one broadcast element.)"""
    n, c, h, w = 8, 16, 32, 32
    blocks = [nn.BatchNorm2d(c, device="meta")]
    f = op_floor(blocks, (n, c, h, w), loss="mse")
    assert f.op == "native_batch_norm_backward"
    assert f.bytes == 3 * n * c * h * w * 4 + 4 * c * 4
    assert f.param_bytes == 2 * c * 4


def test_a_linear_chain_names_its_largest_op():
    blocks = [nn.Linear(64, 4096, device="meta"), nn.ReLU(), nn.Linear(4096, 10, device="meta")]
    f = op_floor(blocks, (32, 64))
    # the largest tensors are the 32 x 4096 hidden activations and their gradients
    assert f.bytes >= 2 * 32 * 4096 * 4
    assert f.param_bytes == (64 * 4096 + 4096 + 4096 * 10 + 10) * 4
    assert all(isinstance(s, tuple) for s in f.shapes)


def test_a_model_off_the_meta_device_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model_blocks\[0\]\.weight is on cpu"):
        op_floor([nn.Linear(4, 4)], (2, 4))


def test_resnet50_fits_16_gib_at_1440_not_at_2048():
    """The e2e goal's arithmetic: the first bottleneck's BatchNorm backward at 256 x 56 x 56
    per image needs 18.4 GiB at batch 2048 (more than 16 GiB by itself), 12.9 GiB at 1440."""
    from bench.e2e import op_floor_note

    assert op_floor_note("resnet50", 1440, 16 * GiB) == ""
    note = op_floor_note("resnet50", 2048, 16 * GiB)
    assert note.startswith("no method fits: its largest op (native_batch_norm_backward) holds 18.38 GiB")
    assert op_floor_note("resnet50", 2048, None) == ""


def test_jobs_below_the_floor_are_reported_not_run():
    from bench import e2e

    asked = []

    def floor(model: str, batch: int, budget) -> str:
        asked.append((model, batch, budget))
        return "no method fits: test" if batch == 4 else ""

    grid = e2e.Grid({"gpt2-s32": [2, 4]}, [e2e.BY_NAME["native"]], None, 1, 0)
    rows, _ = e2e.run_grid(grid, grid.methods, torch.device("cpu"), floor=floor)
    got = {r.batch_size: (r.status, r.note) for r in rows}
    assert got[4] == ("infeasible", "no method fits: test")
    assert got[2][0] == "ok"
    assert sorted(asked) == [("gpt2-s32", 2, None), ("gpt2-s32", 4, None)]
