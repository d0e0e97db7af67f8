"""Mimose: input-aware checkpointing (seed 004). No torch here; the shuttling collector that
feeds it lives in ``scheduler.runtime.mimose_collector``.

- ``greedy_checkpoints``: Algorithm 1, the greedy bucket scheduler: blocks whose estimated
  activation sizes are within 10% share a bucket, a bucket lists its blocks earliest first,
  and blocks are picked until the excess memory is covered (the nearest-size bucket when one
  block can cover the rest, the largest bucket otherwise).
- ``Mimose``: the planner: estimator + greedy + a ``PlanCache`` keyed by (input size, budget),
  returning a ``scheduler.Plan`` (checkpointed blocks run ``F_ck`` forward and ``F_all, B``
  in the backward, as ``torch.utils.checkpoint`` does: ``scheduler.plan.checkpoint_plan``,
  also importable from here as ``plan_from_checkpoints``; the others ``F_all``).

The estimator (``Estimator``, ``ChainEstimator``, ``chain_from_estimate`` and their fields)
lives in :mod:`~scheduler.planners.mimose_estimator` and is re-exported here.

Budget: Algorithm 1 compares the sum of activation bytes with the budget. Our budget is the
plan's peak in the chain model (DESIGN.md), which also counts the network input, the
gradients and the recomputation of a checkpointed block in the backward, so after Algorithm 1
the plan is simulated and, while its peak is over the budget, Algorithm 1 runs again with
the target lowered by the overshoot (a few rounds at most; the paper instead keeps 0.5-1 GB
of slack for fragmentation).

Hook for other runtimes (the swap runtime's per-signature plan cache): build one ``Mimose``
per model, ``observe(size, ...)`` the per-block measurements, then ``plan(size, budget)``
(cached) or ``estimate_activation_bytes(size)``; both need only the input size.
"""
from __future__ import annotations

import numbers
from typing import Dict, Hashable, List, Optional, Sequence, Tuple, Union

from ..chain import Chain
from ..errors import InfeasibleError
from ..plan import Plan, checkpoint_plan
from ..plan_cache import PlanCache, capacity_arg
from ..simulate import simulate_checkpointed
from ..units import exact_number, float_or_none, format_bytes, shown
# the estimator, re-exported: the runtimes, tests and benchmarks import it from here
from .mimose_estimator import (BACKWARD_OVER_FORWARD, BLOCK_TMP_FIELDS, DEFAULT_SAMPLES, ORDER,
                               OUTSIDE_FIELDS, TAIL_FIELDS, ChainEstimator, Estimate, Estimator,
                               PolyFit, chain_from_estimate, size_arg)

__all__ = ["BUCKET_RATIO", "buckets_of", "greedy_checkpoints", "Mimose", "plan_from_checkpoints",
           "DEFAULT_SAMPLES", "ORDER", "BACKWARD_OVER_FORWARD", "TAIL_FIELDS", "OUTSIDE_FIELDS",
           "BLOCK_TMP_FIELDS", "Estimate", "PolyFit", "Estimator", "ChainEstimator",
           "chain_from_estimate"]

BUCKET_RATIO = 0.1     # seed 004 section 4.4: "+-10% in our implementation"
# plans tried between the last target over the budget and the first that fits (bisecting the
# target) when Algorithm 1's own plan was over: each costs a greedy pass and, for a plan not
# tried yet, the simulator's check (about 10 us at 12 blocks), against planning's 0.1 ms goal
SEARCH_ROUNDS = 3

# the plan torch.utils.checkpoint runs (its old name here; scheduler.plan has it now)
plan_from_checkpoints = checkpoint_plan


# ---------------------------------------------------------------------------- Algorithm 1
def buckets_of(est_mem: Sequence[float], ratio: float = BUCKET_RATIO) -> List[List[int]]:
    """Algorithm 1, lines 2-14: blocks sorted by size (descending); a bucket takes the largest
    remaining block l and every next block whose size exceeds size(l) * (1 - ratio); each
    bucket lists its blocks in forward order."""
    order = sorted(range(len(est_mem)), key=lambda i: (-est_mem[i], i))
    out: List[List[int]] = []
    k = 0
    while k < len(order):
        head = order[k]
        bucket = [head]
        k += 1
        while k < len(order) and est_mem[order[k]] > est_mem[head] * (1 - ratio):
            bucket.append(order[k])
            k += 1
        out.append(sorted(bucket))
    return out


def greedy_checkpoints(est_mem: Sequence[float], budget: float,
                       ratio: float = BUCKET_RATIO) -> List[int]:
    """Algorithm 1: the blocks to checkpoint (drop and recompute) so that the estimated
    activation bytes fit ``budget``; in the order picked. Returns every block when even that
    does not cover the excess (the caller decides it is infeasible)."""
    buckets = buckets_of(est_mem, ratio)
    excess = float(sum(est_mem)) - budget                      # line 15
    chosen: List[int] = []
    while excess > 0 and buckets:                              # line 16
        # line 17: buckets holding a block larger than the excess. The converted text reads
        # "max(est_mem[b] > excess_mem"; the prose says the layer "nearest to the excess" is
        # taken, so among those buckets the one with the smallest size wins (line 21).
        cands = [b for b in buckets if max(est_mem[i] for i in b) > excess]
        if cands:
            bucket = min(cands, key=lambda b: max(est_mem[i] for i in b))
        else:
            bucket = buckets[0]                                # line 19: the largest bucket
        layer = bucket.pop(0)                                  # earliest block of the bucket
        if not bucket:
            buckets.remove(bucket)
        chosen.append(layer)                                   # line 23
        excess -= est_mem[layer]                               # line 24
    return chosen


class Mimose:
    """The planner: estimator + Algorithm 1 + plan cache keyed by (input size, budget)."""

    def __init__(self, n_blocks: int, samples: int = DEFAULT_SAMPLES,
                 bucket_ratio: float = BUCKET_RATIO, cache_size: int = 256, rounds: int = 8,
                 verify: bool = True):
        # rounds=0: no Algorithm 1 round checked, straight to every block checkpointed
        for name, value, least in (("n_blocks", n_blocks, 1), ("rounds", rounds, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Mimose: {name} must be an int >= {least}, got {value!r}")
        if isinstance(bucket_ratio, bool) or not isinstance(bucket_ratio, numbers.Real) or \
                not 0 <= bucket_ratio < 1:
            raise ValueError(f"Mimose: bucket_ratio must be in [0, 1), got {bucket_ratio!r}")
        if not isinstance(verify, bool):  # "no" would read as true
            raise ValueError(f"Mimose: verify must be True or False, got {verify!r}")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < ORDER + 1:
            raise ValueError(f"Mimose: samples must be an int >= {ORDER + 1} (an order-{ORDER} "
                             f"fit needs that many distinct sizes), got {samples!r}")
        self.n = n_blocks
        self.estimator = Estimator(n_blocks, samples)
        self.bucket_ratio = bucket_ratio
        self.cache: PlanCache[Plan] = PlanCache(capacity_arg(cache_size, "Mimose"))
        self.rounds = rounds
        self.verify = verify  # simulate each plan and tighten until its peak fits the budget
        # what the samples were learnt under besides the input size, as the runtime that
        # feeds this Mimose names it (the chain runner: block 0's floating dtypes and devices,
        # gradients, train mode, autocast), so a Mimose shared between runtimes is never
        # read for another one; None until a runtime binds it
        self.setting: Optional[Hashable] = None
        # bytes each stage's backward holds beyond what the samples measure, per stage 0..L:
        # the gradients of weights several blocks share, which wait in autograd's buffer from
        # the last user's backward down to the first's (a block's measurement runs it alone:
        # ``scheduler.profile.shared_grads``); set by the runtime that feeds this Mimose
        self.extra_bw_tmp: Optional[List[float]] = None
        # collections of sizes beyond the fit's reach whose measurement failed (the runtime
        # counts them, and extrapolates past a few)
        self.reach_failures = 0

    def fresh(self) -> "Mimose":
        """A Mimose with the same options and nothing learnt (for another setting)."""
        return Mimose(self.n, samples=self.estimator.samples, bucket_ratio=self.bucket_ratio,
                      cache_size=self.cache.capacity, rounds=self.rounds, verify=self.verify)

    # the collector's entry point
    def observe(self, input_size: float, input_bytes: float, xbar: Sequence[float],
                out: Sequence[float], fw: Sequence[float],
                tail: Optional[Sequence[float]] = None,
                outside: Optional[Sequence[float]] = None,
                tmp: Optional[Dict[str, Sequence[float]]] = None) -> None:
        """``Estimator.observe``: the positional form (size, input bytes, xbar, out, fw) of
        the swap runtime's use still works; ``tail``, ``outside``, ``tmp`` are optional.
        The plans cached so far go: a new sample (a size beyond the fit's reach, measured
        after it was ready) changes the fit they came from."""
        self.estimator.observe(input_size, input_bytes, xbar, out, fw, tail, outside, tmp)
        self.cache.clear()

    @property
    def ready(self) -> bool:
        return self.estimator.ready

    def estimate_activation_bytes(self, input_size: float) -> float:
        """Predicted activation bytes of the whole chain without checkpointing (``input_size``
        a positive number, as for ``plan``; else ``ValueError``)."""
        size_arg(input_size, "Mimose.estimate_activation_bytes")
        return float(self.estimator.predict(input_size).sum())

    @staticmethod
    def cache_key(input_size: float, budget: float) -> Hashable:
        return (float(input_size), float(budget))

    def plan(self, input_size: float, budget: Union[float, str]) -> Plan:
        """The plan for this input size and budget (bytes or a size string, ``"6GiB"``), from
        the cache when seen before."""
        size_arg(input_size, "Mimose.plan")
        if isinstance(budget, str):
            from vmalloc.sizes import parse_size  # torch-free; lazily, as the planners do
            budget = parse_size(budget, "Mimose.plan: budget")
        if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not budget > 0 \
                or float_or_none(budget) is None:
            raise ValueError(f"Mimose.plan: budget must be a positive number of bytes or a size "
                             f"string ('6GiB'), got {shown(budget)}")
        return self.cache.get_or_plan(self.cache_key(input_size, budget),
                                      lambda: self._plan(input_size, budget))

    def checked_chain(self, est: Estimate) -> Chain:
        """The chain an estimate's plans are checked on: ``chain_from_estimate``, with the
        gradients of weights several blocks share (``extra_bw_tmp``, set by the runtime)."""
        chain = chain_from_estimate(est)
        if self.extra_bw_tmp and any(self.extra_bw_tmp):
            chain = chain.replace(bw_tmp=[b + e for b, e in zip(chain.bw_tmp, self.extra_bw_tmp)])
        return chain

    def _tightened(self, chain: Chain, est: Estimate, budget: float) -> Optional[Plan]:
        """The fastest plan found whose simulated peak fits ``budget``, or None. Algorithm
        1's target is the activation bytes that may stay. First as the paper tightens it:
        while the plan is over the budget, the target goes down by the excess (``rounds``
        plans at most). That can stop short (the same plan again, round after round: every
        block checkpointed then) or skip past plans with fewer recomputations; so where the
        first plan was over, up to ``rounds`` more: the target down to at least one more
        block checkpointed until a plan fits, then ``SEARCH_ROUNDS`` bisections between the
        largest target known to fit and the smallest known not to, the fastest plan tried
        kept. Each plan is simulated once."""
        L = self.n
        tried: Dict[Tuple[int, ...], Tuple[float, float]] = {}   # blocks -> (time, peak)

        def peak_at(target: float) -> Tuple[Tuple[int, ...], float]:
            ck = tuple(greedy_checkpoints(est.xbar, target, self.bucket_ratio))
            if ck not in tried:
                tried[ck] = simulate_checkpointed(chain, ck)
            return ck, tried[ck][1]

        target, over = budget - est.input_bytes, None   # ``over``: the last target over
        for i in range(2 * self.rounds):   # down until a plan fits
            ck, peak = peak_at(target)
            if peak <= budget:
                break
            if len(ck) == L:
                return None   # every block checkpointed is over: nothing fits
            over = target
            target -= peak - budget   # by the excess (the paper)
            if i + 1 >= self.rounds:   # past its rounds: below what this plan keeps
                target = min(target, float(sum(est.xbar)) - sum(est.xbar[k] for k in ck) - 1)
        else:
            return None
        if over is not None:   # Algorithm 1's own plan was over: search between
            fits = target
            for _ in range(SEARCH_ROUNDS):
                if over - fits < 1:
                    break
                middle = (fits + over) / 2
                if peak_at(middle)[1] <= budget:
                    fits = middle
                else:
                    over = middle
            ck = min((c for c, (_, p) in tried.items() if p <= budget), key=lambda c: tried[c][0])
        plan = checkpoint_plan(L, ck)
        plan.predicted_time, plan.predicted_peak = tried[ck]
        return plan

    def _plan(self, input_size: float, budget: float) -> Plan:
        # a size measured by the collector is planned from its measurement, others from the fit
        est = self.estimator.measured(input_size) or self.estimator.estimate(input_size)
        L = self.n
        if not self.verify:  # Algorithm 1 alone, its own memory notion (sum of activations)
            ck = greedy_checkpoints(est.xbar, budget - est.input_bytes, self.bucket_ratio)
            plan = checkpoint_plan(L, ck)
            plan.meta["input_size"] = float(input_size)
            return plan
        chain = self.checked_chain(est)  # checked on the one memory model, the simulator
        best = self._tightened(chain, est, budget)
        if best is None:
            floor = checkpoint_plan(L, range(L))
            floor.predicted_time, floor.predicted_peak = simulate_checkpointed(chain, range(L))
            if floor.predicted_peak <= budget:  # the rounds ran out before reaching it
                best = floor
            else:
                raise InfeasibleError(
                    f"Mimose: budget {format_bytes(budget)} is below the estimated peak with "
                    f"every block checkpointed ({format_bytes(floor.predicted_peak)}) for input "
                    f"size {exact_number(input_size)}",
                    floor.predicted_peak)
        best.chain = chain
        best.memory_limit = budget   # verified under the simulator above
        best.meta["input_size"] = float(input_size)
        return best
