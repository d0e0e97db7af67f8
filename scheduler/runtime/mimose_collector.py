"""Mimose's shuttling online collector (seed 004, section 4.2), the torch half of Mimose.

While the estimator is still learning, every block is checkpointed and its forward runs
twice: first with autograd on, to measure what it saves for backward (bytes, output
included) and how long it takes, after which that output and everything it holds is
dropped; then again as the plan's checkpointed training run. The random state is put back
between the two runs and the block's buffers restored after the first, so the second run
(the one training uses) draws the same numbers plain training would: training is unchanged.
Memory stays that of checkpointing every block plus one block's activations.

With ``transients`` (Mimose's collection steps; not FSDP's profiling step, whose backward
hooks must not fire), each block's transients (``fw_tmp``, ``bw_tmp``, ``fck_tmp``: what
the chain model adds to what is stored during its forwards and its backward) are measured
too, by the profiler's own per-stage measurement (``profile.measure.stage_memory``, as
rotor's chains get them): one more saving forward of the block and its backward, under the
op tracer on the CPU (on CUDA, the allocator's peaks: three forwards and a backward more).
Nothing accumulates into ``.grad``; random state and buffers are put back the same way.
Not on a block with module backward hooks (they would run once more; as the tail's replay).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from vmalloc import user_warning
from ..planners.mimose import BLOCK_TMP_FIELDS as TMP_FIELDS  # the estimator's, in its order
from ..profile.autograd_graph import hooks_silenced
from ..profile.measure import sync
from . import accounting, buffers, rng
from .block_calls import tensor_leaves


def _sync(comps: Sequence[Any]) -> None:
    """``measure.sync`` on the device of the first CUDA tensor among ``comps``."""
    for c in comps:
        if isinstance(c, torch.Tensor) and c.device.type == "cuda":
            sync(c.device)
            return


class ShuttlingCollector:
    """Measures each block during one forward phase; ``tmp()`` gives its transients (or
    None when not measured)."""

    def __init__(self, n_blocks: int, transients: bool = False):
        self.n = n_blocks
        self.xbar = [0] * n_blocks
        self.out = [0] * n_blocks
        self.fw = [0.0] * n_blocks
        self.seen = [False] * n_blocks
        self.transients: Dict[str, List[int]] = \
            {k: [0] * n_blocks for k in TMP_FIELDS} if transients else {}
        self.failed: Optional[str] = None  # why the transients could not be measured
        # the step's memory outside the chain is measured (``chain_runner``): the tensors
        # every block is called with besides the chain's value (masks) are counted there
        # once, so, as in ``measure_chain`` (``held_outside``), not in a block's xbar
        self.outside_counted = False

    def measure(self, s: int, block: nn.Module, run: Callable[[Tuple[Any, ...]], Any],
                inp: Tuple[Any, ...], rg: Sequence[bool], state: Optional["rng.RngState"],
                exclude: Set[int], shared: Sequence[torch.Tensor] = ()) -> None:
        """The measuring run of block ``s`` (``run`` calls it on the given chain value); the
        random state is put back afterwards, so the training run that follows draws what
        plain training draws. ``exclude``: storages that are not activations (weights);
        ``shared``: the call's other tensors (masks, rotary embeddings)."""
        if state is None:
            state = rng.capture(rng.cuda_devices_of(inp))
        held = {accounting.storage_key(t) for t in accounting.tensors_of(shared)}
        if self.outside_counted:
            exclude = exclude | held
        leaves = tuple(c.detach().requires_grad_(r) if isinstance(c, torch.Tensor) else c
                       for c, r in zip(inp, rg))
        with buffers.frozen_buffers(block):
            _sync(inp)
            t0 = time.perf_counter()
            with torch.enable_grad(), accounting.SavedTensors() as rec:
                out1 = tensor_leaves(run(leaves))
            _sync(out1)
            self.fw[s] = time.perf_counter() - t0
        self.xbar[s] = accounting.xbar_bytes(rec.tensors, out1, leaves, exclude)
        in_keys = {accounting.storage_key(t) for t in accounting.tensors_of(leaves)}
        self.out[s] = accounting.tensors_bytes(out1, in_keys)
        self.seen[s] = True
        del out1, rec, leaves  # drop the first run's graph: its activations go with it
        if self.transients and self.failed is None:
            rng.restore(state)
            # what the block's backward frees is never the model's masks: not credited
            self._measure_transients(s, block, run, inp, rg, exclude | held)
        rng.restore(state)

    def _measure_transients(self, s: int, block: nn.Module,
                            run: Callable[[Tuple[Any, ...]], Any], inp: Tuple[Any, ...],
                            rg: Sequence[bool], state_keys: Set[int]) -> None:
        from ..profile.measure import stage_memory  # the profiler's one measurement
        leaves = tuple(c.detach().requires_grad_(r) for c, r in zip(inp, rg)
                       if isinstance(c, torch.Tensor))
        if len(leaves) != len(inp):  # (a chain value is tensors: never seen)
            self.failed = f"block {s}'s chain value holds non-tensors"
            return
        params = [p for p in block.parameters() if p.requires_grad]
        device = leaves[0].device if leaves else \
            next((p.device for p in params), torch.device("cpu"))
        try:
            # (the block's gradient and backward hooks fire once, in the step itself)
            with buffers.frozen_buffers(block), hooks_silenced(block):
                _, r = stage_memory(lambda xs: tensor_leaves(run(xs)), leaves, params,
                                    state_keys, device)
        except Exception as e:  # measuring must not break training: say so, learn without
            self.failed = f"block {s}: {e!r}"
            user_warning.warn(f"Mimose: measuring the transients of block {s} on a collection "
                              f"step failed ({e!r}); this step's sample has none (dropped if "
                              "earlier samples have them, or if none was learnt yet)")
            return
        for k in TMP_FIELDS:
            self.transients[k][s] = int(r[k])

    def tmp(self) -> Optional[Dict[str, Tuple[int, ...]]]:
        """The blocks' transients as ``Estimator.observe`` takes them (``TMP_FIELDS`` -> one
        entry per block), or None when they were not measured (not asked for, or the
        measurement failed)."""
        if not self.transients or self.failed is not None:
            return None
        return {k: tuple(self.transients[k]) for k in TMP_FIELDS}

    def complete(self) -> bool:
        return all(self.seen)
