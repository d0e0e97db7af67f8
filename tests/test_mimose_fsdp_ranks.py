"""Mimose under FSDP2 with each rank padding its own batches (dynamic lengths per rank): a rank
meeting a new size collects (extra forwards of every block, which gather FSDP's parameters)
while another has seen its size and runs a plan. Their collectives paired wrong: a hang until
the process group's timeout. Every rank now collects at the same steps (one all-reduce of a
flag per step, under FSDP only), and each rank's losses and gradients equal plain FSDP2's."""
import json

import pytest

from _subproc import torchrun_two_ranks

WORKER = r'''
import datetime, json, sys, torch, transformers, warnings
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
import scheduler
from scheduler.runtime.distributed import shutdown

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=45))
rank = dist.get_rank()
LENGTHS = [[12, 12, 16, 20], [12, 16, 20, 24]][rank]   # rank 0 sees 12 twice


def run(checkpointed):
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=64, use_cache=False))
    if checkpointed:
        scheduler.checkpoint(m, budget=600000, planner="mimose", samples=3)
    for b in m.transformer.h:
        fully_shard(b)
    fully_shard(m)
    out = []
    for step, t in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randint(1, 64, (2, t), generator=g)
        m.zero_grad(set_to_none=True)
        torch.manual_seed(10 * step + rank)
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        out.append([loss.detach()] + [p.grad.to_local().clone() for p in m.parameters()])
    return out


plain, ours = run(False), run(True)
same = all(torch.equal(a, b) for s, t in zip(plain, ours) for a, b in zip(s, t))
with open(f"rank{rank}.json", "w") as f:   # (the ranks' stdout lines interleave)
    json.dump({"rank": rank, "same": same, "steps": len(ours)}, f)
shutdown(timeout=30)
'''


def test_mimose_collects_on_every_rank_at_once_under_fsdp2(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available():
        pytest.skip("no torch.distributed")
    from torch.distributed import fsdp
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("no FSDP2 (fully_shard) in this torch")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = torchrun_two_ranks(str(script), str(tmp_path))
    err = proc.stderr
    assert proc.returncode == 0, err[-4000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got == [{"rank": r, "same": True, "steps": 4} for r in (0, 1)], err[-3000:]
