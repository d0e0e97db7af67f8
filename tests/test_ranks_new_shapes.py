"""Ranks that meet new input shapes at different steps (per-rank dynamic padding, the default
of Hugging Face's padding collator under a DistributedSampler).

DDP, rotor: each rank profiles and plans on its own measurement, with no collective of the
runner's, so the steps match plain DDP bit for bit. (The runner agreed every measured chain
across ranks before: rank 0's agreement all-reduce paired with rank 1's gradient all-reduce,
and gloo aborted the job.) Under FSDP units the ranks must still run one plan
(tests/test_distributed.py).

FSDP2 on the whole model (``fully_shard(model)`` alone), Mimose (whose plans may differ across
ranks): a collection step measured the model's tail by replaying its backward, which ran the
root's hooks on that rank alone, and the ranks hung until the group's timeout.

FSDP2 on every block, rotor: the ranks must run one plan; a rank meeting a new shape alone
is refused on every rank at once."""

import pytest

from _subproc import torchrun_two_ranks

WORKER = r'''
import datetime, sys
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import scheduler

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
MODE = sys.argv[1]
# rank 0 meets a new length at every step, rank 1 keeps the one it met at step 0
LENGTHS = [[16, 12, 14, 10], [16, 16, 16, 16]][rank]
if MODE == "fsdp2-block-cached":  # both meet 16 then 12 together; then each a length it knows
    LENGTHS = [[16, 12, 12], [16, 12, 16]][rank]
if MODE == "fsdp2-block-first":  # a different length on each rank at the first step
    LENGTHS = [[16], [12]][rank]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.1))
                                    for _ in range(6))
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()   # the tail Mimose measures


def run(checkpointed):
    torch.manual_seed(0)
    net = Net()
    if checkpointed and MODE in ("ddp", "fsdp2-block", "fsdp2-block-cached",
                                 "fsdp2-block-first"):
        scheduler.checkpoint(net, 300_000, "rotor", blocks="blocks", loss="sum")
    elif checkpointed:
        scheduler.checkpoint(net, 300_000, "mimose", blocks="blocks", samples=3)
    if MODE == "ddp":
        model = DDP(net)
    else:
        from torch.distributed.fsdp import fully_shard
        if MODE.startswith("fsdp2-block"):
            for b in net.blocks:
                fully_shard(b)
        model = fully_shard(net)
    grads = []
    for step, n in enumerate(LENGTHS):
        torch.manual_seed(100 * rank + step)
        model.zero_grad()
        model(torch.randn(8, n, 32)).backward()
        grads.append([getattr(p.grad, "_local_tensor", p.grad).clone()
                      for p in net.parameters()])
    return grads, net


plain, _ = run(False)
if MODE.startswith("fsdp2-block"):   # one plan on every rank: a rank planning alone stops them all
    try:
        run(True)
    except RuntimeError as e:
        print(f"rank{rank} refused: {e}", flush=True)
    scheduler.runtime.distributed.shutdown()
    sys.exit(0)
ours, net = run(True)
stats = scheduler.runtime.checkpoint.checkpointed(net).stats()
same = all(torch.equal(a, b) for s, t in zip(plain, ours) for a, b in zip(s, t))
print(f"rank{rank} same={same} stats={stats}", flush=True)
scheduler.runtime.distributed.shutdown()   # not destroy_process_group: README, Several GPUs
sys.exit(0 if same else 3)
'''


def test_under_fsdp_units_a_rank_planning_alone_stops_every_rank(tmp_path):
    """FSDP2 on every block, rotor: the ranks must run one plan, so rank 0's new shape at
    step 1 is refused on both ranks at that step's first block, not a hang until the process
    group's timeout (the agreement at the end of rank 0's forward waited for rank 1)."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    proc = torchrun_two_ranks(str(worker), str(tmp_path), "fsdp2-block")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank, mine in ((0, "yes"), (1, "no")):
        assert f"rank{rank} refused: scheduler.checkpoint: 1 of 2 ranks meet a new input " \
               f"signature for 'blocks' at this step (this rank: {mine})" in out, out[-4000:]


@pytest.mark.parametrize("mode, when, lengths", [
    ("fsdp2-block-cached", "each known from an earlier step", (12, 16)),
    ("fsdp2-block-first", "new to every rank", (16, 12))])
def test_under_fsdp_units_ranks_with_different_signatures_stop_every_rank(tmp_path, mode, when,
                                                                            lengths):
    """FSDP2 on every block, rotor. ``cached``: at step 2 each rank meets a length it planned
    for before (no new plan anywhere), but not the same one: their plans differ (one
    recomputes where the other does not, and their collectives pair wrongly: a hang).
    ``first``: different lengths at the first step, new to both (once said "each known from
    an earlier step"). Refused on both ranks at that step's first block, naming what
    differs."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    proc = torchrun_two_ranks(str(worker), str(tmp_path), mode)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert f"rank{rank} refused: scheduler.checkpoint: the ranks call block 0 of 'blocks' " \
               f"with different input signatures at this step, {when}" in out, out[-4000:]
    assert f"what differs: args[0]: rank 0 a tensor (8, {lengths[0]}, 32) float32, rank 1 a " \
           f"tensor (8, {lengths[1]}, 32) float32" in out, out[-4000:]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2-whole"])
def test_ranks_meet_new_shapes_at_different_steps(tmp_path, mode):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    proc = torchrun_two_ranks(str(worker), str(tmp_path), mode)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank0 same=True" in out and "rank1 same=True" in out, out[-4000:]
