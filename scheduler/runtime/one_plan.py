"""Ranks that must run one plan: when, and the check that they do.

Where a recomputation runs collectives every rank must join (FSDP shards the blocks, a block
holds a ``SyncBatchNorm``), the ranks must follow one plan at every step: each rank's chain
is agreed before planning (``distributed.agree_chain``) and every step checks that the ranks
run the plan of the same key (``check_same_keys``). The chain runner (``chain_runner``) asks
both; under plain DDP each rank plans on its own measurement (see ``ChainRunner._agrees``).
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, Optional, Sequence

import torch
from torch import nn

from . import distributed, fsdp, rng
from .block_calls import describe_arguments, weights_dtype


def needs_one_plan(blocks: Sequence[nn.Module], entries: Optional[Sequence[nn.Module]]
                   ) -> bool:
    """Whether the ranks must run one plan, from the blocks. The runner decides it once, at
    block 0's call of the first step in a process group: the blocks' wrapping does not change
    between steps, FSDP1's flat-parameter views exist there (they are gone at the end of a
    forward, where a profiling step agrees), and the scan (every block's tensors: about 2 ms
    at 32 blocks) stays off each step."""
    return fsdp.sharded(blocks, entries) or any(isinstance(m, nn.SyncBatchNorm)
                                                for b in blocks for m in b.modules())


def check_same_keys(new: bool, key: Hashable, args: Sequence[Any], kwargs: Dict[str, Any],
                    blocks: Sequence[nn.Module], budget: Optional[int], name: str,
                    list_name: str) -> None:
    """Every rank runs the plan of the same key (input signature, budget, mode, autocast) at
    every step, and needs a new plan (``new``: ``key`` is not cached) at the same steps. One
    all-reduce per step finds a rank that plans alone, or ranks that run different cached
    plans (one recomputing from a checkpoint, its collectives paired with another rank's
    gradient reduction), and stops every rank at once, where they would otherwise hang until
    the process group's timeout (30 minutes by default). ``name`` and ``list_name`` (the entry
    point, the block list) are for the message."""
    mixed, differ = distributed.differ(new, key)
    if not (mixed or differ):
        return
    if mixed:
        n = distributed.ranks_with(new)
        what = (f"{n} of {torch.distributed.get_world_size()} ranks meet a new input "
                f"signature for '{list_name}' at this step (this rank: "
                f"{'yes' if new else 'no'})")
        must = "meet new shapes at the same steps"
    else:
        # (not mixed: every rank's ``new`` is this one's)
        known = "new to every rank" if new else "each known from an earlier step"
        what = (f"the ranks call block 0 of '{list_name}' with different input "
                f"signatures at this step, {known}")
        must = "call the blocks with the same signature at the same step"
    raise RuntimeError(
        f"{name}: {what}; where a recomputation runs collectives (FSDP units, "
        f"SyncBatchNorm) every rank must run one plan, so every rank must {must}: pad "
        "each step's batches to the same length on every rank, or use planner='mimose'"
        f"{_differences(args, kwargs, blocks, budget)}")


def _differences(args: Sequence[Any], kwargs: Dict[str, Any], blocks: Sequence[nn.Module],
                 budget: Optional[int]) -> str:
    """What differs between this rank's call of block 0 and the other ranks' (a collective:
    every rank is on this error path at once), for the message."""
    mine = dict(describe_arguments(args, kwargs),
                **{"weights' dtype": repr(weights_dtype(blocks))},
                budget=repr(budget),
                mode="train" if blocks[0].training else "eval",
                autocast=repr(rng.autocast_state()))
    everyone = distributed.gathered(mine)
    me = torch.distributed.get_rank()
    diffs = []
    for name in dict.fromkeys(n for d in everyone for n in d):
        seen = [d.get(name, "absent") for d in everyone]
        if len(set(seen)) > 1:
            diffs.append(f"{name}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(seen)))
    if not diffs:
        return ""
    hint = ""
    if any(v in ("None", "absent") for d in everyone for k, v in d.items()
           if "mask" in k):
        hint = ("; a Hugging Face model passes no attention mask to its layers for a batch "
                "without padding (SDPA attention) and one for a batch with padding: load it "
                "with attn_implementation='eager' (a mask at every step), or use "
                "planner='mimose'")
    return f" (rank {me}; what differs: {'; '.join(diffs)}){hint}"
