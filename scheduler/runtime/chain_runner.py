"""``scheduler.wrap``: train a chain of blocks under an activation-memory budget by running an
optimal plan (rotor, pofo, periodic, Mimose) instead of plain autograd.

    model = scheduler.wrap(blocks, budget="6GiB", planner="rotor")
    loss = criterion(model(x), y); loss.backward()      # gradients identical to plain training

For each input signature (shapes, dtypes, devices of the inputs) and budget the runner gets
a chain (measured with ``scheduler.profile.measure_chain`` on that input, or given), asks the
planner for a Plan, checks it with the simulator and caches it (``PlanCache``); a new shape
or a new budget (``model.budget = "4GiB"``) plans again. With ``planner="mimose"`` no chain
is measured: the Mimose collector learns per-block memory online and plans per input size.
The plan itself is executed by ``chain_exec`` (forward/backward, recomputation with the
random state kept, offload/prefetch on side streams).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from vmalloc.sizes import parse_size

from ..chain import Chain
from ..plan import Plan
from ..plan_cache import PlanCache
from ..simulate import simulate
from ..planners.mimose import DEFAULT_SAMPLES, Mimose, plan_from_checkpoints
from . import accounting, buffers, distributed, rng
from .chain_exec import ChainExecutor, ChainFunction, CompiledPlan, RunStats
from .mimose_collector import ShuttlingCollector
from .offload import Transfers

PLANNERS = ("rotor", "pofo", "periodic", "mimose", "none")

PlannerArg = Union[str, Plan, Callable[[Chain, Optional[int]], Plan]]
ChainArg = Union[None, Chain, Callable[..., Chain]]


# ------------------------------------------------------------------------------ planning
def make_plan(chain: Chain, budget: Optional[int], planner: PlannerArg = "rotor",
              bandwidth: Optional[float] = None) -> Plan:
    """The Plan the named planner makes for ``chain`` under ``budget`` bytes (``None``: no
    limit, everything saved)."""
    if isinstance(planner, Plan):
        return planner
    if callable(planner):
        return planner(chain, budget)
    if budget is None or planner == "none":
        plan = plan_from_checkpoints(chain.L, [], planner="none")
    elif planner == "rotor":
        from ..planners import rotor
        plan = rotor.solve(chain, budget)
    elif planner == "pofo":
        if bandwidth is None:
            raise ValueError("scheduler.wrap: planner='pofo' needs bandwidth= (bytes/s of the "
                             "host-device link, e.g. 12e9)")
        from ..planners import pofo
        plan = pofo.solve(chain, budget, bandwidth)
    elif planner == "periodic":
        from ..planners import periodic
        plan = periodic.best(chain, budget)
    else:
        raise ValueError(f"scheduler.wrap: planner must be one of {', '.join(PLANNERS)}, a Plan "
                         f"or a callable (chain, budget) -> Plan; got {planner!r}")
    transfers = any(op.kind in ("offload", "prefetch") for op in plan.ops)
    res = simulate(chain, plan, bandwidth=bandwidth)
    if transfers and budget is not None:
        # pofo predicts with the simulator enforcing the budget (prefetches wait for memory):
        # the runtime follows that timing
        from .chain_exec import transfer_timing
        plan.meta["transfer_timing"] = transfer_timing(
            simulate(chain, plan, bandwidth=bandwidth, memory=budget))
    plan.meta["simulated_peak"] = res.peak_memory
    plan.meta["simulated_time"] = res.makespan
    if plan.predicted_peak is None:
        plan.predicted_peak = res.peak_memory
    if plan.predicted_time is None:
        plan.predicted_time = res.makespan
    if plan.chain is None:
        plan.chain = chain
    return plan


# ------------------------------------------------------------------------------ inputs
def signature(args: Sequence[Any]) -> Hashable:
    """What makes two inputs need different plans: shapes, dtypes, devices, grad flags."""
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), str(a.dtype), str(a.device), a.requires_grad))
        else:
            sig.append(("const", type(a).__name__))
    return tuple(sig)


def default_input_size(args: Sequence[Any]) -> int:
    """Mimose's input size: elements of the first input tensor (seed 004, section 3.1)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.numel()
    raise ValueError("scheduler.wrap(planner='mimose'): the input has no tensor to size")


class _PreservedState:
    """Random state, buffers and gradients of the blocks, put back after measuring a chain
    so that measuring does not change training."""

    def __init__(self, blocks: Sequence[nn.Module], args: Sequence[Any]):
        self.rng = rng.capture(rng.cuda_devices_of(args))
        self.bufs = [buffers.snapshot(b) for b in blocks]
        self.grads = [(p, p.grad) for b in blocks for p in b.parameters()]

    def restore(self) -> None:
        rng.restore(self.rng)
        for saved in self.bufs:
            buffers.restore(saved)
        for p, g in self.grads:
            p.grad = g


# ------------------------------------------------------------------------------ module
class CheckpointedChain(nn.Module):
    """The blocks, run under a plan. See ``wrap``."""

    def __init__(self, blocks: Sequence[nn.Module], budget: Any, planner: PlannerArg = "rotor",
                 bandwidth: Any = None, *, chain: ChainArg = None, track_memory: bool = False,
                 cache_size: int = 64, samples: int = DEFAULT_SAMPLES,
                 input_size: Optional[Callable[[Sequence[Any]], float]] = None,
                 mimose: Optional[Mimose] = None, loss: Any = "sum",
                 measure_options: Optional[Dict[str, Any]] = None):
        super().__init__()
        if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
            blocks = list(blocks)
        if not isinstance(blocks, (list, tuple)) or not blocks or \
                not all(isinstance(b, nn.Module) for b in blocks):
            raise TypeError("scheduler.wrap: blocks must be an nn.Sequential, an nn.ModuleList or "
                            f"a non-empty list of nn.Module, got {type(blocks).__name__}")
        if isinstance(planner, str) and planner not in PLANNERS:
            raise ValueError(f"scheduler.wrap: planner must be one of {', '.join(PLANNERS)}, "
                             f"a Plan or a callable (chain, budget) -> Plan; got {planner!r}")
        self.blocks = nn.ModuleList(blocks)
        self.L = len(blocks)
        self.planner = planner
        self.bandwidth = None if bandwidth is None else self._rate(bandwidth)
        self._budget = self._parse_budget(budget)
        self.chain_source = chain
        self.loss = loss
        self.measure_options = dict(measure_options or {})
        self.track_memory = track_memory
        self.cache: PlanCache[CompiledPlan] = PlanCache(cache_size)
        self.input_size = input_size or default_input_size
        if mimose is not None and (not isinstance(mimose, Mimose) or mimose.n != self.L):
            raise ValueError(f"scheduler.wrap: mimose= must be a scheduler.planners.mimose.Mimose "
                             f"for {self.L} blocks, got {mimose!r}")
        self.mimose = (mimose or Mimose(self.L, samples=samples, cache_size=cache_size)) \
            if planner == "mimose" else None
        self._compiled: Dict[int, Tuple[Plan, CompiledPlan]] = {}
        self._transfers: Dict[str, Transfers] = {}
        self.last_stats: Optional[RunStats] = None
        self.last_plan: Optional[Plan] = None
        self.collections = 0

    # -------------------------------------------------------------------------- knobs
    @staticmethod
    def _parse_budget(budget: Any) -> Optional[int]:
        return None if budget is None else parse_size(budget, "budget")

    @staticmethod
    def _rate(bandwidth: Any) -> float:
        if isinstance(bandwidth, str):
            return float(parse_size(bandwidth.removesuffix("/s"), "bandwidth"))
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or \
                not bandwidth > 0:
            raise ValueError(f"scheduler.wrap: bandwidth must be positive bytes/s (e.g. 12e9 or "
                             f"'12GB/s'), got {bandwidth!r}")
        return float(bandwidth)

    @property
    def budget(self) -> Optional[int]:
        return self._budget

    @budget.setter
    def budget(self, value: Any) -> None:
        """A new budget plans again on the next forward (plans are cached per budget)."""
        self._budget = self._parse_budget(value)

    # -------------------------------------------------------------------------- planning
    def _chain_for(self, args: Sequence[Any]) -> Chain:
        src = self.chain_source
        if isinstance(src, Chain):
            chain = src
        elif callable(src):
            chain = src(*args)
        else:
            try:
                from ..profile import measure_chain  # issue 4: rotor's parameter estimation
            except ImportError as e:
                raise RuntimeError("scheduler.wrap: no chain given and scheduler.profile."
                                   "measure_chain is not available in this build") from e
            keep = _PreservedState(self.blocks, args)
            grad_in = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            try:
                chain = measure_chain(list(self.blocks), args[0] if len(args) == 1 else args,
                                      loss=self.loss, input_grad=grad_in,
                                      **self.measure_options)
            finally:
                keep.restore()
        if len(chain) != self.L + 1:
            raise ValueError(f"scheduler.wrap: the chain has {len(chain)} stages but there are "
                             f"{self.L} blocks (a chain has one stage per block plus the loss)")
        # issue 15: ranks plan on one chain (the max over ranks) so they run the same plan
        return chain if src is chain else distributed.agree_chain(chain, key=signature(args))

    def _compile(self, plan: Plan) -> CompiledPlan:
        hit = self._compiled.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        cplan = CompiledPlan.of(plan, self.L)
        if len(self._compiled) > 4 * self.cache.capacity:
            self._compiled.clear()
        self._compiled[id(plan)] = (plan, cplan)
        return cplan

    def _plan_chain(self, args: Sequence[Any]) -> CompiledPlan:
        if isinstance(self.planner, Plan):
            return self._compile(self.planner)
        chain = None if self._budget is None and not callable(self.planner) \
            else self._chain_for(args)
        if chain is None:
            return self._compile(plan_from_checkpoints(self.L, [], planner="none"))
        return self._compile(make_plan(chain, self._budget, self.planner, self.bandwidth))

    def _plan_mimose(self, args: Sequence[Any]) -> Tuple[CompiledPlan, Optional[ShuttlingCollector]]:
        size = self.input_size(args)
        m = self.mimose
        if not m.ready and not m.estimator.has(size):  # sheltered execution: shuttle
            key = ("shuttle", self.L)
            cplan = self.cache.get_or_plan(key, lambda: self._compile(
                plan_from_checkpoints(self.L, range(self.L), planner="mimose-collect")))
            return cplan, ShuttlingCollector(self.L)
        if self._budget is None:
            return self._compile(plan_from_checkpoints(self.L, [], planner="none")), None
        return self._compile(m.plan(size, self._budget)), None

    def plan_for(self, *args: Any) -> Plan:
        """The plan the next forward on ``args`` will run (planned and cached if new)."""
        if self.mimose is not None:
            return self._plan_mimose(args)[0].plan
        key = (signature(args), self._budget)
        return self.cache.get_or_plan(key, lambda: self._plan_chain(args)).plan

    # -------------------------------------------------------------------------- forward
    def _params(self) -> List[List[nn.Parameter]]:
        return [[p for p in b.parameters() if p.requires_grad] for b in self.blocks]

    def _plain(self, args: Sequence[Any]) -> Any:
        value: Any = args if len(args) > 1 else args[0]
        for b in self.blocks:
            value = b(*value) if isinstance(value, tuple) else b(value)
        return value

    def _transfers_for(self, args: Sequence[Any]) -> Transfers:
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)),
                   next((p.device for p in self.parameters()), torch.device("cpu")))
        if str(dev) not in self._transfers:
            self._transfers[str(dev)] = Transfers(dev)
        return self._transfers[str(dev)]

    def forward(self, *args: Any) -> Any:
        if not args:
            raise TypeError("scheduler.wrap: the wrapped chain needs at least one input")
        params = self._params()
        needs_grad = any(params) or any(isinstance(a, torch.Tensor) and a.requires_grad
                                        for a in args)
        if not torch.is_grad_enabled() or not needs_grad:
            return self._plain(args)  # nothing to differentiate: no plan needed
        if self.mimose is not None:
            cplan, collector = self._plan_mimose(args)
        else:
            key = (signature(args), self._budget)
            cplan = self.cache.get_or_plan(key, lambda: self._plan_chain(args))
            collector = None
        needs_transfers = any(k in ("offload", "prefetch") for _, k, _ in
                              cplan.forward_ops + cplan.backward_ops)
        storages = accounting.parameter_storages(self) \
            if (self.track_memory or collector is not None) else set()
        ex = ChainExecutor(list(self.blocks), cplan, params, track_memory=self.track_memory,
                           transfers=self._transfers_for(args) if needs_transfers else None,
                           collector=collector, param_storages=storages)
        ex.x0_is_tuple = len(args) > 1
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        dummy = torch.empty(0, device=dev, requires_grad=True)
        outs = ChainFunction.apply(ex, len(args), *args, dummy)
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        if collector is not None:
            self.mimose.observe(self.input_size(args),
                                accounting.tensors_bytes(args), collector.xbar,
                                collector.out, collector.fw)
            self.collections += 1
        self.last_stats = ex.stats
        self.last_plan = cplan.plan
        it = iter(outs)
        comps = [next(it) if k in ex.out_layout else c for k, c in enumerate(ex.out_template)]
        ex.out_template = ()  # the output now belongs to the caller
        return tuple(comps) if ex.out_is_tuple else comps[0]

    # -------------------------------------------------------------------------- report
    def stats(self) -> Dict[str, Any]:
        """Plan cache figures, planning time, and the last run's peak (tracked runs)."""
        cache = self.mimose.cache if self.mimose is not None else self.cache
        out: Dict[str, Any] = {"planner": self.planner if isinstance(self.planner, str)
                               else type(self.planner).__name__, "budget": self._budget}
        out.update(cache.stats())
        if self.last_stats is not None:
            out.update(last_peak_bytes=self.last_stats.peak_bytes,
                       last_recomputed_forwards=self.last_stats.recomputed_forwards,
                       last_offloads=self.last_stats.offloaded)
        if self.last_plan is not None:
            out["last_predicted_peak"] = self.last_plan.predicted_peak
        if self.mimose is not None:
            out.update(mimose_sizes_collected=len(self.mimose.estimator.sizes),
                       mimose_ready=self.mimose.ready, mimose_collections=self.collections)
        for t in self._transfers.values():
            out["offloaded_bytes"] = out.get("offloaded_bytes", 0) + t.offloaded_bytes
            out["prefetched_bytes"] = out.get("prefetched_bytes", 0) + t.prefetched_bytes
        return out


def wrap(blocks: Union[nn.Module, Sequence[nn.Module]], budget: Any, planner: PlannerArg = "rotor",
         bandwidth: Any = None, sample_input: Any = None, **options: Any) -> CheckpointedChain:
    """Run ``blocks`` (an ``nn.Sequential``, ``nn.ModuleList`` or list of modules: a chain)
    under an activation-memory ``budget`` (bytes or a size string such as ``"6GiB"``; ``None``:
    no limit) with the plans of ``planner``:

    - ``"rotor"`` (default): optimal checkpointing (seed 002);
    - ``"pofo"``: checkpointing + offloading (seed 001), needs ``bandwidth`` (bytes/s);
    - ``"periodic"``: ``checkpoint_sequential`` with the fastest segment count that fits;
    - ``"mimose"``: input-aware checkpointing learnt online (seed 004), for dynamic shapes;
    - ``"none"``: plain training (everything saved);
    - a ``Plan`` (run as is) or a callable ``(chain, budget) -> Plan``.

    ``sample_input`` (a tensor or a tuple of the block-0 arguments) plans right away, so an
    infeasible budget raises ``InfeasibleError`` here rather than on the first step.

    Options: ``chain`` (a ``Chain``, or a callable taking the inputs and returning one,
    instead of measuring), ``track_memory`` (count activation bytes held, see ``stats()``;
    default False), ``cache_size`` (plans kept, default 64), ``samples`` (Mimose: distinct
    input sizes collected before fitting, default 10), ``input_size`` (Mimose: callable from
    the inputs to the size the estimator uses; default the first tensor's element count),
    ``mimose`` (a ``scheduler.planners.mimose.Mimose`` to use, e.g. one shared with another
    runtime; default a new one), ``loss`` (the loss stage ``measure_chain`` profiles: "sum"
    (default), "mse", "cross_entropy" or a callable on the chain's output),
    ``measure_options`` (more keyword arguments for ``measure_chain``, e.g. ``{"repeat": 1}``).
    """
    unknown = set(options) - {"chain", "track_memory", "cache_size", "samples", "input_size",
                              "mimose", "loss", "measure_options"}
    if unknown:
        raise TypeError(f"scheduler.wrap: unknown option(s) {sorted(unknown)}")
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        raise TypeError("scheduler.wrap: pass the model as an nn.Sequential or a list of blocks "
                        f"(got a single {type(blocks).__name__})")
    model = CheckpointedChain(list(blocks), budget, planner, bandwidth, **options)
    if sample_input is not None and planner != "mimose":
        args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
        model.plan_for(*args)
    return model
