"""The chain runner: plans for a list of blocks, and the steps that run them.

One runner serves both entry points: ``scheduler.checkpoint(model, ...)`` (the model's own
loop calls the blocks, see ``checkpoint``) and ``scheduler.wrap(blocks, ...)`` (a bare chain:
``wrap.CheckpointedChain``'s loop calls them). For each input signature (shapes, dtypes,
devices, grad flags of block 0's arguments), budget and train/eval mode the runner gets a
chain (``_chain_for``: given, measured, or measured at the end of a first forward that
checkpoints every block), asks the planner for a Plan (``planning.make_plan``: its predicted
peak and time are the simulator's own) and caches it (``PlanCache``); a new shape or a new
budget plans again. With ``planner="mimose"`` the Mimose collector learns per-block memory
online and plans per input size, one Mimose per setting of what changes the bytes per element
(``_mimose_setting``: dtypes, autocast, train mode, as the plan key holds them). Each
forward + backward is a ``chain_exec.ChainStep`` (non-reentrant), following the plan as
``compiled_plan.CompiledPlan`` splits it.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ..chain import Chain, add_outside
from ..errors import InfeasibleError
from ..plan import Plan, checkpoint_plan
from ..plan_cache import PlanCache, capacity_arg
from ..planners.mimose import (DEFAULT_SAMPLES, OUTSIDE_FIELDS, TAIL_FIELDS, Estimate, Mimose,
                               chain_from_estimate)
from ..profile.shared_grads import shared_grad_bytes
from ..units import format_bytes
from . import accounting, distributed, first_run, fsdp, rng
from .bandwidth import default_bandwidth
from .block_calls import describe_arguments, signature, tensor_leaves, weights_dtype
from .chain_exec import ChainStep, RunStats
from .chain_transfers import Transfers
from .compiled_plan import CompiledPlan
from .hf_outputs import outputs_not_captured
from .input_aware import InputAwareChain
from .input_shapes import InputShapes
from .measuring import BoundBlock, measure_preserved
from .planning import make_plan
from .mimose_collector import ShuttlingCollector
from .options import (ChainArg, PlannerArg, check_bool, check_callable, check_measure,
                      check_planner, default_input_size, parse_budget, parse_rate)

MIMOSE_SAMPLE = "mimose-sample"  # the key of a Mimose collection step whose tail is measured
MEASUREMENTS_SAID = 8  # input shapes measured (a chain each) before saying how to avoid it
MIMOSE_SETTINGS = 8  # Mimose settings whose samples are kept (the least recently used goes)
FIRST_SAMPLE_TRIES = 3  # first Mimose samples with a failed measurement dropped before learning
REACH_TRIES = 3  # failed collections beyond the fit's reach before such sizes are extrapolated


def _shape_of(key: Hashable) -> Hashable:
    """A plan key (``ChainRunner._key``: signature, budget, train mode, autocast state) less
    its budget: what a measured chain depends on."""
    signature_, _budget, training, autocast = key  # type: ignore[misc]
    return signature_, training, autocast


def _mimose_setting(args: Sequence[Any], kwargs: Dict[str, Any], training: bool,
                    weights: Optional[str] = None) -> Hashable:
    """What Mimose's samples depend on besides the input size: what rotor's plan key
    (``ChainRunner._key``) holds besides shapes and the budget, less what changes no byte
    count. Kept: the dtypes and devices of block 0's floating-point tensors (``model.float()``
    after learning in bfloat16 doubles every activation), the weights' dtype (``weights``,
    ``block_calls.weights_dtype``: the same where block 0 takes only token ids), whether any
    input needs a gradient, train mode (dropout's masks) and the autocast state (its
    low-precision activations and weight copies). Left out: integer and boolean tensors and
    constant arguments, whose presence changes from step to step under dynamic padding (an
    attention mask that is None for a batch without padding) and would split the samples, and
    shapes (the input size's job)."""
    leaves = list(tensor_leaves((tuple(args), kwargs)))
    floats = sorted({(str(t.dtype).replace("torch.", ""), str(t.device)) for t in leaves
                     if t.is_floating_point() or t.is_complex()})
    return (tuple(floats), weights, any(t.requires_grad for t in leaves), training,
            rng.autocast_state())


def _with_weights(setting: Hashable, weights: Optional[str]) -> Hashable:
    """A ``_mimose_setting`` pickled before it held the weights' dtype, with ``weights``."""
    if isinstance(setting, tuple) and len(setting) == 4:
        return (setting[0], weights, *setting[1:])
    return setting


def _describe_setting(setting: Hashable) -> str:
    """``_mimose_setting`` in words (warnings)."""
    floats, weights, grad, training, autocast = setting  # type: ignore[misc]
    tensors = ", ".join(f"{dtype} on {dev}" for dtype, dev in floats) or "no float tensors"
    if weights is not None:
        tensors += f", {weights} weights"
    casts = ", ".join(f"{dev} autocast to {str(dtype).replace('torch.', '')}"
                      for dev, on, dtype in autocast if on) or "no autocast"
    return (f"{tensors}, {'train' if training else 'eval'} mode, {casts}, input "
            f"{'with' if grad else 'without'} gradient")


def needs_grad(blocks: Sequence[nn.Module], args: Sequence[Any],
               kwargs: Dict[str, Any]) -> bool:
    """Whether a call of ``blocks`` with ``(args, kwargs)`` is a training step (planned):
    gradients on, and a block's weight or an argument that wants one."""
    if not torch.is_grad_enabled():
        return False
    if fsdp.trains(blocks):
        return True
    return any(isinstance(v, torch.Tensor) and v.requires_grad
               for v in tensor_leaves((tuple(args), kwargs)))


def _collected(step: ChainStep) -> Estimate:
    """What a step's collector measured (per block: saved bytes, output bytes, forward time,
    and the transients if it measured them; the chain's input bytes)."""
    c = step.collector
    tmp = c.tmp()
    return Estimate(accounting.tensors_bytes(step.frames[0].call.x), np.array(c.xbar, float),
                    np.array(c.out, float), np.array(c.fw, float),
                    tmp=None if tmp is None else {k: np.array(v, float) for k, v in tmp.items()})


def _with_outside(chain: Chain, step: ChainStep) -> Chain:
    """``chain`` with what ``step`` held outside it (masks, the head's saved tensors, random
    states: ``tail.outside`` at block 0 of a profiling or collection step), when measured."""
    return chain if step.outside is None else add_outside(chain, step.outside.bytes)


# ------------------------------------------------------------------------------ runner
class ChainRunner:
    """Plans and steps for one list of blocks (see the module doc). ``call`` is what each
    block call goes through; ``name`` prefixes errors (the entry point the user called)."""

    OPTIONS = ("chain", "track_memory", "cache_size", "samples", "input_size", "mimose",
               "loss", "measure_options", "on_chain")

    def __init__(self, blocks: Sequence[nn.Module], budget: Any, planner: PlannerArg = "rotor",
                 bandwidth: Any = None, *, chain: ChainArg = None, track_memory: bool = False,
                 cache_size: int = 64, samples: int = DEFAULT_SAMPLES,
                 input_size: Optional[Callable[[Sequence[Any]], float]] = None,
                 mimose: Optional[Mimose] = None, loss: Any = "sum",
                 measure_options: Optional[Dict[str, Any]] = None,
                 on_chain: Optional[Callable[[Chain], Chain]] = None,
                 sequential: bool = False, entries: Optional[Sequence[nn.Module]] = None,
                 name: str = "scheduler.wrap", list_name: str = "blocks"):
        self.name = name
        self.list_name = list_name  # the block list's dotted path in its model (messages)
        # (its blocks, all lists' blocks) when the budget is this list's share of a total
        self.budget_share: Optional[Tuple[int, int]] = None
        check_planner(planner, name)
        self.blocks = list(blocks)
        # the list the model's loop calls the blocks through: an FSDP1 unit that replaces a
        # block there later is what runs it again (``fsdp.unit_of``)
        self.entries = entries
        fsdp.refuse_wrapped(self.blocks, entries, name)
        self.L = len(self.blocks)
        self.planner = planner
        self.bandwidth = parse_rate(bandwidth, name)
        self._budget = parse_budget(budget, name)
        if chain is not None and not isinstance(chain, Chain) and not callable(chain):
            raise TypeError(f"{name}: chain= must be a Chain or a callable returning one, "
                            f"got {type(chain).__name__}")
        if isinstance(chain, InputAwareChain) and (
                chain.L != len(self.blocks) or any(
                    fsdp.unwrapped(a) is not fsdp.unwrapped(b)
                    for a, b in zip(chain.blocks, self.blocks))):
            # its estimator would learn this list's chains too, and plan one list on the
            # other's (T5's decoder on its encoder's chain), without a word
            raise ValueError(f"{name}: chain= is an InputAwareChain of other blocks than "
                             f"'{list_name}' ({chain.L} blocks); it learns the chains of the "
                             "list it was made on only: make one on this list, or, for a model "
                             "with several lists (scheduler.checkpoint gives each a runner), "
                             "leave chain= out or use planner='mimose' (one Mimose per list)")
        self.chain_source = chain
        if on_chain is not None and not callable(on_chain):
            raise TypeError(f"{name}: on_chain= must be a callable Chain -> Chain, got "
                            f"{type(on_chain).__name__}")
        self.on_chain = on_chain
        self.loss = "sum" if loss is None else loss  # (None: the default, as for every option)
        # checked here: measure_chain would see them only at the first step, deep inside it
        self.measure_options = check_measure(self.loss, measure_options, name)
        self.track_memory = check_bool(track_memory, "track_memory", name)
        self.sequential = sequential
        self.cache: PlanCache[CompiledPlan] = PlanCache(capacity_arg(cache_size, name))
        check_callable(input_size, "input_size", name, "a callable from block 0's arguments "
                       "to a number (the input size)")
        self.input_size = input_size or default_input_size
        if mimose is not None and (not isinstance(mimose, Mimose) or mimose.n != self.L):
            got = f"one for {mimose.n} blocks" if isinstance(mimose, Mimose) else repr(mimose)
            raise ValueError(f"{name}: mimose= must be a scheduler.planners.mimose.Mimose "
                             f"for {self.L} blocks, got {got}")
        # the Mimose of the setting (``_mimose_setting``) the last step ran under, and each
        # setting's (``_mimose_for``); the first setting's is the one given as mimose=
        self.mimose = (mimose or Mimose(self.L, samples=samples, cache_size=cache_size)) \
            if planner == "mimose" else None
        self._mimoses: Dict[Hashable, Mimose] = {}
        self._shapes = InputShapes(f"{name}: Mimose on '{list_name}'")
        self._collecting_into: Optional[Mimose] = None  # the collection step's Mimose
        self._compiled: Dict[int, Tuple[Plan, CompiledPlan]] = {}
        self._transfers: Dict[str, Transfers] = {}
        self.current: Optional[ChainStep] = None
        self.passthrough = False   # recomputing or measuring: block calls go straight through
        self.last_stats: Optional[RunStats] = None
        self.last_plan: Optional[Plan] = None
        self.collections = 0
        self.profiling_steps = 0
        self.measurements = 0  # chains measured (measure_chain), one per new shape
        self._measured: Dict[Hashable, Chain] = {}  # measured chains by shape (_shape_of)
        # profiling steps whose chain an InputAwareChain learns: profile key -> input size
        self._learning: Dict[Hashable, float] = {}
        self._said_shapes = False  # MEASUREMENTS_SAID's warning, given once
        self.calls = 0  # block calls through the runner (a list its model never calls: 0)
        self.said_uncalled = False  # tail.TailProbe's warning that they never were, given
        self._said_unplanned = False  # _unplanned's warning, given once
        self._in_place = first_run.InPlaceBuffers()  # buffers the blocks change in place
        # scheduler.checkpoint's measurement of the model's tail (stage L), or None: the
        # chain's loss stage is measure_chain's ``loss`` (scheduler.wrap, or loss= given)
        self.tail: Any = None
        # the model's forward (tail.forward_number) the step in flight began in, and the one
        # the last whole pass over the list ended in: a second pass or a repeated block 0 in
        # one forward is told apart from a new forward after one that raised
        self._step_in: Optional[int] = None
        self._pass_in: Optional[int] = None
        self._said_passes = False  # _several_passes's warning, given once
        self._block0_out: Any = None  # weakref to the step's block 0 output (a repeated block 0)
        self._one_plan: Optional[bool] = None  # whether the ranks must run one plan (_agrees),
        # decided at the first step in a process group
        self._mimose_tails: Optional[bool] = None  # whether Mimose's samples carry the tail
        self._mimose_tmp: Optional[bool] = None    # ... and the blocks' transients
        self._first_failures = 0  # first samples dropped because a measurement failed

    # ---------------------------------------------------------------- copies and pickles
    def __getstate__(self) -> Dict[str, Any]:
        """A copy or a pickle (``copy.deepcopy(model)``, ``torch.save(model)``) keeps the
        options, the measured chains and the plans (keyed by the devices they were measured
        on: another device measures again); not what lives on this process's devices or is
        under way: the copy engines' streams, a step in flight, the plans compiled by id."""
        state = self.__dict__.copy()
        state.update(_compiled={}, _transfers={}, current=None, passthrough=False,
                     _learning={}, _block0_out=None, _one_plan=None, _collecting_into=None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name, value in (("_learning", {}), ("_mimoses", {}), ("_collecting_into", None),
                            ("_first_failures", 0),
                            ("_shapes", InputShapes(f"{self.name}: Mimose on "
                                                    f"'{self.list_name}'"))):
            self.__dict__.setdefault(name, value)  # (a runner pickled before they existed)
        # Mimose settings pickled before they held the weights' dtype (4 entries) get it at the
        # next plan (``_upgrade_settings``): not here, where a deepcopy may not have filled in
        # the blocks yet
        self._old_settings = any(len(k) == 4 for k in self._mimoses if isinstance(k, tuple))

    def _upgrade_settings(self) -> None:
        """Old 4-entry Mimose settings with the weights' dtype now (as when they were saved,
        unless the model was cast since)."""
        self._old_settings = False
        weights = weights_dtype(self.blocks)
        self._mimoses = {_with_weights(k, weights): m for k, m in self._mimoses.items()}
        for m in [self.mimose, *self._mimoses.values()]:
            if m is not None and getattr(m, "setting", None) is not None:
                m.setting = _with_weights(m.setting, weights)

    # -------------------------------------------------------------------------- knobs
    @property
    def budget(self) -> Optional[int]:
        return self._budget

    @budget.setter
    def budget(self, value: Any) -> None:
        """A new budget plans again on the next forward (plans are cached per budget)."""
        self._budget = parse_budget(value, self.name)
        self.budget_share = None  # set for this list alone: no longer a share of a total

    def _rate(self, device: Optional[torch.device]) -> float:
        return self.bandwidth if self.bandwidth is not None else default_bandwidth(device)

    # -------------------------------------------------------------------------- planning
    def _chain_for(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[Chain]:
        """The chain to plan on for a call of block 0 with these arguments: ``chain=`` (a Chain,
        or a callable given block 0's arguments: the hook input-aware prediction plugs into),
        else measured on a bare chain, else ``None`` (measured after a profiling forward)."""
        src = self.chain_source
        if isinstance(src, Chain):
            chain = src
        elif isinstance(src, InputAwareChain) and not self.sequential:
            # blocks the model's loop calls (scheduler.checkpoint: keyword arguments, the
            # model's tail as the loss stage): a size still to learn is measured on a
            # profiling step, as without chain=, and taught to the source at its end
            # (``_plan_measured``); a known size or a fitted estimator answers now
            chain = src.known(args)
            if chain is None:
                return None
        elif callable(src):
            if isinstance(src, InputAwareChain) and src.collecting and \
                    fsdp.units(self.blocks, self.entries):
                raise RuntimeError(
                    f"{self.name}: InputAwareChain measures the blocks by running each forward "
                    "and backward outside the model's step, which FSDP1 units do not allow (a "
                    "unit gathers its block's parameters only inside its own forward, and a "
                    "backward there would fire its gradient reduction); use planner='mimose', "
                    "which measures inside the step, or FSDP2 (fully_shard)")
            chain = src(*args, **kwargs)
            if isinstance(src, InputAwareChain):  # measured by the source, as at block 0
                chain = self._with_casts(chain)
        elif self.sequential and not fsdp.fsdp1(self.blocks, self.entries):
            # (under FSDP1 measured forward-only on the step, see fsdp)
            return self._check_chain(self._with_casts(self._measure(list(self.blocks),
                                                                    tuple(args))),
                                     agree_on=signature(args, {}))
        else:
            return None
        return self._check_chain(chain)

    def _check_chain(self, chain: Chain, agree_on: Hashable = None) -> Chain:
        """Every chain passes here before planning (given, measured, or from a profiling
        step). A chain this runner measured (``agree_on``: what it was measured for) is first
        agreed across ranks where they must run one plan (``_agrees``); a given chain, or one
        from a ``chain=`` callable, is the caller's (``InputAwareChain`` agrees its own
        measurements likewise). Then ``on_chain`` sees it."""
        if agree_on is not None and self._agrees():
            chain = distributed.agree_chain(chain, key=agree_on)
        if self.on_chain is not None:
            chain = self.on_chain(chain)
        if not isinstance(chain, Chain):
            raise TypeError(f"{self.name}: chain= returned {type(chain).__name__}, not a Chain")
        if len(chain) != self.L + 1:
            raise ValueError(f"{self.name}: the chain has {len(chain)} stages but there are "
                             f"{self.L} blocks (a chain has one stage per block plus the loss)")
        return chain

    def _measure(self, stages: List[nn.Module], x0: Tuple[Any, ...]) -> Chain:
        """The chain of ``stages`` measured on ``x0``, block calls going straight through."""
        self.measurements += 1
        was, self.passthrough = self.passthrough, True
        try:
            return measure_preserved(self.blocks, stages, x0, self.loss, self.measure_options)
        finally:
            self.passthrough = was

    def _measure_step(self, step: ChainStep) -> Tuple[Chain, Hashable]:
        """The chain measured on the calls of a forward that just ran (a profiling step), not
        yet checked, and what it was measured for (``_check_chain``'s ``agree_on``)."""
        calls = [f.call for f in step.frames]
        stages = [BoundBlock(b, c, c.anchored and s > 0, step.outside is not None)
                  for s, (b, c) in enumerate(zip(self.blocks, calls))]
        x0 = tuple(t.detach().requires_grad_(r) for t, r in zip(calls[0].x, calls[0].rg))
        chain = self._with_casts(_with_outside(self._measure(stages, x0), step))
        return chain, signature(x0, {})

    def _with_casts(self, chain: Chain) -> Chain:
        """``chain`` with autocast's cast cache beside it: under autocast the cache holds the
        blocks' weights' low-precision copies until the region ends, and no measurement sees
        them (its casts hit the cache). Every measured chain passes here (a bare chain
        measured at block 0 ran at 2.9x its budget without them)."""
        casts = rng.cast_cache_bytes(p for b in self.blocks for p in b.parameters())
        if not casts:
            return chain
        chain = add_outside(chain, casts)
        return chain.replace(meta=dict(chain.meta, autocast_cast_bytes=casts))

    def _plan_measured(self, key: Hashable, chain: Chain, agree_on: Hashable,
                       device: Optional[torch.device]) -> None:
        """Plan (and cache for ``key``) on a chain a profiling step measured: at the end of
        its forward, or once the model's tail was measured (``tail.TailProbe``). A Mimose
        collection step's key (``MIMOSE_SAMPLE``) records its sample instead."""
        if isinstance(key, tuple) and key and key[0] == MIMOSE_SAMPLE:
            tail, out = chain.meta.get("tail"), chain.meta.get("outside")
            measured = isinstance(tail, dict) and all(k in tail for k in TAIL_FIELDS)
            self._observe_sample(key[1], [tail[k] for k in TAIL_FIELDS] if measured else None,
                                 [out[k] for k in OUTSIDE_FIELDS]
                                 if measured and isinstance(out, dict) else None,
                                 key[2] if len(key) > 2 else None,
                                 tail_failed=isinstance(tail, dict) and "failed" in tail)
            return
        size = self._learning.pop(key, None)
        if size is not None:  # InputAwareChain learns the chain agreed, before on_chain
            if agree_on is not None and self._agrees():
                chain = distributed.agree_chain(chain, key=agree_on)
            agree_on = None
            self.chain_source.learn(size, chain)
        chain = self._check_chain(chain, agree_on=agree_on)
        if self.chain_source is None:
            self._remember(key, chain)
        self.cache.get_or_plan(key, lambda: self._plan_on(chain, device))

    def _compile(self, plan: Plan) -> CompiledPlan:
        hit = self._compiled.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        cplan = CompiledPlan.of(plan, self.L)
        if len(self._compiled) > 4 * self.cache.capacity:
            self._compiled.clear()
        self._compiled[id(plan)] = (plan, cplan)
        return cplan

    def _key(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Hashable:
        # the weights' dtype with the signature: a chain measured in bfloat16 does not plan
        # float32 steps (block 0's arguments may be token ids, which show no dtype)
        return ((signature(args, kwargs), weights_dtype(self.blocks)), self._budget,
                self.blocks[0].training, rng.autocast_state())

    def _plan_on(self, chain: Chain, device: Optional[torch.device]) -> CompiledPlan:
        """The compiled plan the planner makes on ``chain`` (a share's infeasibility says
        what the whole budget would need)."""
        try:
            plan = make_plan(chain, self._budget, self.planner,
                             self._rate(device) if self._transfers_planned else self.bandwidth)
        except InfeasibleError as e:
            raise self._in_share(e) from e
        return self._compile(plan)

    def _in_share(self, e: InfeasibleError) -> InfeasibleError:
        """A planner's ``InfeasibleError`` for this list's share of the budget, in terms of the
        whole budget the user gave (the error as it is without a share)."""
        if self.budget_share is None or self._budget is None:
            return e
        n, n_all = self.budget_share
        need = None if e.min_memory is None else -(-int(e.min_memory) * n_all // n)
        return InfeasibleError(
            f"{self.name}: '{self.list_name}' gets {n}/{n_all} of the budget, a share of "
            f"{format_bytes(self._budget)} (the model's block lists share the budget by block "
            f"count), and {e}" + ("" if need is None else
                                 f"; for that share to fit, the whole budget must be at "
                                 f"least {format_bytes(need)}"), need)

    @property
    def _transfers_planned(self) -> bool:
        """Whether the planner plans transfers (its bandwidth depends on the device)."""
        return self.planner == "pofo"

    def _plan(self, args: Sequence[Any], kwargs: Dict[str, Any], step: bool = False
              ) -> Tuple[CompiledPlan, Any]:
        """The compiled plan for this forward, and the cache key to fill after it if the
        chain must first be measured on it (a profiling step), else ``None``. ``step`` (a
        step, not a query: every rank calls it at once): the ranks check they plan together."""
        if isinstance(self.planner, Plan):
            return self._compile(self.planner), None
        if self._budget is None and not callable(self.planner):
            return self._compile(checkpoint_plan(self.L, [], planner="none")), None
        key = self._key(args, kwargs)
        if step and distributed.active():  # before any measurement (``_chain_for`` agrees)
            if self._one_plan is None:
                self._one_plan = self._needs_one_plan()
            if self._one_plan:
                self._same_plan_keys(key, args, kwargs)
        if key in self.cache:
            return self.cache.get_or_plan(key, lambda: None), None  # type: ignore[arg-type]
        # a new budget for a shape measured before plans on that chain (no measurement)
        chain = self._measured.get(_shape_of(key)) if self.chain_source is None else None
        if chain is None:
            chain = self._chain_for(args, kwargs)
            if chain is not None and self.chain_source is None:  # measured (a bare chain)
                self._remember(key, chain)
        if chain is None:  # checkpoint every block while the chain is measured on this step
            return self._compile(checkpoint_plan(self.L, range(self.L), planner="profile")), key
        dev = _device_of(args, kwargs) if self._transfers_planned else None  # (a tree walk)
        return self.cache.get_or_plan(key, lambda: self._plan_on(chain, dev)), None

    def _remember(self, key: Hashable, chain: Chain) -> None:
        """Keep a measured chain for its shape (the plan key less the budget); at the
        MEASUREMENTS_SAID-th input signature, say how to avoid a measurement per shape."""
        if len(self._measured) >= 4 * self.cache.capacity:
            self._measured.clear()
        self._measured[_shape_of(key)] = chain
        if not self._said_shapes and \
                len({shape[0] for shape in self._measured}) >= MEASUREMENTS_SAID:
            self._said_shapes = True
            warnings.warn(
                f"{self.name}: chains measured for {MEASUREMENTS_SAID} input shapes so far, "
                "each an extra forward and backward of every block. For inputs whose shape "
                "changes from step to step (dynamic padding), use planner='mimose' or "
                "chain=scheduler.runtime.input_aware.InputAwareChain(blocks), which predict "
                "new shapes from a few measured ones, or pad to a few fixed lengths",
                stacklevel=2)

    def _mimose_for(self, setting: Hashable) -> Mimose:
        """The Mimose that learns and plans the steps run under ``setting``
        (``_mimose_setting``), made current (``self.mimose``). Samples learnt under one
        setting never plan a step of another: with another dtype or autocast state the same
        input size holds other bytes (a float32 step planned from bfloat16 samples ran at
        1.29x its budget). One Mimose per setting, kept side by side, rather than collecting
        again over the old samples: a model that switches back (autocast on for training, off
        for an evaluation with gradients) finds its samples again, for a few arrays each. A
        new setting after the first collects again, said once per setting; beyond
        MIMOSE_SETTINGS the least recently used setting's samples are dropped, said too.
        A Mimose given as mimose= serves the setting it was first bound to (by this runner or
        another that shares it), never another one."""
        m = self._mimoses.get(setting)
        if m is not None:
            self._mimoses[setting] = self._mimoses.pop(setting)  # most recently used last
            self.mimose = m
            return m
        m = self.mimose
        bound = getattr(m, "setting", None)
        if not self._mimoses and bound in (None, setting):  # the first setting
            m.setting = setting
        else:
            if self._mimoses:
                was = f"its samples so far were learnt with {_describe_setting(bound)}"
            else:  # a shared mimose= another runner bound to its own setting
                was = (f"the Mimose given as mimose= learnt its samples with "
                       f"{_describe_setting(bound)}, in another runner")
            m = m.fresh()
            m.setting = setting
            warnings.warn(
                f"{self.name}: Mimose: block 0 of '{self.list_name}' is called with "
                f"{_describe_setting(setting)}, where {was}; the bytes a step holds per input "
                "size depend on that (dtypes, autocast, dropout masks), so those samples do "
                f"not plan these steps: Mimose collects {m.estimator.samples} input sizes for "
                "this setting (steps that checkpoint every block and run each block's forward "
                f"twice), keeping the samples of up to {MIMOSE_SETTINGS} settings for when "
                "theirs comes back", stacklevel=5)
        self._mimoses[setting] = m
        if len(self._mimoses) > MIMOSE_SETTINGS:
            old = next(iter(self._mimoses))
            gone = self._mimoses.pop(old)
            warnings.warn(
                f"{self.name}: Mimose: more than {MIMOSE_SETTINGS} settings of dtypes, "
                f"autocast and train mode met on '{self.list_name}'; the samples learnt with "
                f"{_describe_setting(old)} ({len(gone.estimator.sizes)} input sizes) are "
                "dropped, and collected again if that setting comes back", stacklevel=5)
        self.mimose = m
        return m

    def _plan_mimose(self, args: Sequence[Any], kwargs: Dict[str, Any], agree: bool = False
                     ) -> Tuple[CompiledPlan, Optional[ShuttlingCollector]]:
        """``agree`` (a step, not a query): under FSDP every rank collects at the same steps;
        a collection's extra forwards gather parameters, and one rank collecting alone pairs
        its collectives with another's backward (a hang until the group's timeout)."""
        if self.__dict__.get("_old_settings"):
            self._upgrade_settings()
        size, exact = self.input_size(args), True
        fsdp_ranks = agree and self._under_fsdp()
        if self.input_size is default_input_size:
            # (a smaller last batch: planned as the learnt batch; under FSDP every rank must
            # collect at once, so there it is learnt as it is)
            bound, exact = self._shapes.size_for(args, size)
            size, exact = (size, True) if fsdp_ranks else (bound, exact)
        m = self._mimose_for(_mimose_setting(args, kwargs, self.blocks[0].training,
                                             weights_dtype(self.blocks)))
        if getattr(m, "extra_bw_tmp", None) is None:
            # weights several blocks share (one block object repeated): their gradient waits
            # through the backwards between its users, which no block's sample sees
            m.extra_bw_tmp = shared_grad_bytes(self.blocks)
        collect = not m.estimator.covers(size)  # (beyond the fit's reach: collected too)
        if collect and m.ready and getattr(m, "reach_failures", 0) >= REACH_TRIES:
            collect = False  # measuring beyond the reach keeps failing: extrapolated (said)
        if fsdp_ranks:
            collect = distributed.any_rank(collect)
        if collect:  # sheltered execution: shuttle
            key = ("shuttle", self.L)
            cplan = self.cache.get_or_plan(key, lambda: self._compile(
                checkpoint_plan(self.L, range(self.L), planner="mimose-collect")))
            if not exact:  # every block checkpointed, nothing learnt from a bound
                return cplan, None
            # the blocks' transients too (their backward once more), but not under FSDP,
            # whose backward hooks must fire once per step
            return cplan, ShuttlingCollector(self.L, transients=not self._sharded())
        if self._budget is None:
            return self._compile(checkpoint_plan(self.L, [], planner="none")), None
        try:
            plan = m.plan(size, self._budget)
        except InfeasibleError as e:
            raise self._in_share(e) from e
        return self._compile(plan), None

    def plan_for(self, args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None) -> Plan:
        """The plan the next forward with block 0 called on ``args`` will run (planned and
        cached if new; on a model whose chain is measured in a profiling forward, the
        profiling plan until then)."""
        kwargs = kwargs or {}
        if self.mimose is not None:
            return self._plan_mimose(args, kwargs)[0].plan
        return self._plan(args, kwargs)[0].plan

    # -------------------------------------------------------------------------- steps
    def _needs_grad(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
        return needs_grad(self.blocks, args, kwargs)

    def _transfers_for(self, dev: torch.device) -> Transfers:
        """The copy streams and pinned pool of ``dev``: one per device a moved storage lives
        on (blocks spread over GPUs, a ``device_map``, copy on their own device's streams)."""
        if str(dev) not in self._transfers:
            self._transfers[str(dev)] = Transfers(dev)
        return self._transfers[str(dev)]

    def _begin(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> ChainStep:
        collector, profile_key = None, None
        if self.mimose is not None:
            cplan, collector = self._plan_mimose(args, kwargs, agree=True)
            # the collection's samples go to the Mimose of the setting it ran under
            self._collecting_into = self.mimose if collector is not None else None
        else:
            cplan, profile_key = self._plan(args, kwargs, step=True)
        needs_transfers = any(k in ("offload", "prefetch") for _, k, _ in
                              cplan.forward_ops + cplan.backward_ops)
        held: List[torch.Tensor] = []
        if self.track_memory or collector is not None or needs_transfers:
            held = [t for b in self.blocks for t in fsdp.block_tensors(b)]
        step = ChainStep(self.blocks, cplan, self._run_again, track_memory=self.track_memory,
                         transfers=self._transfers_for if needs_transfers else None,
                         collector=collector, state_tensors=held, name=self.name,
                         in_place=self._in_place)
        if profile_key is not None and self._sharded():
            # FSDP: measure_chain's own backward passes would fire FSDP's backward hooks;
            # measure forward-only during this step instead (as Mimose's collector does)
            step.collector = ShuttlingCollector(self.L)
        for t in self._transfers.values():  # copies a failed step dropped: their buffers go
            t.drain_orphans()
        step.profile_key = profile_key
        step.input_size = self.input_size(args) if collector is not None else None
        if profile_key is not None and isinstance(self.chain_source, InputAwareChain):
            if len(self._learning) > self.cache.capacity:  # (steps that never ended)
                self._learning.clear()
            size = self.chain_source.size_to_learn(args)
            if size is not None:
                self._learning[profile_key] = size
        self.last_stats = step.stats
        self.last_plan = cplan.plan
        return step

    def _end_forward(self, step: ChainStep, out: Any) -> None:
        key = step.profile_key
        if key is not None:
            self.profiling_steps += 1
            dev = _device_of(step.frames[0].call.x, {})
            if step.collector is not None:  # FSDP: measured forward-only (``_begin``)
                self.measurements += 1
                chain = _with_outside(chain_from_estimate(_collected(step),
                                                          name="forward-measured"), step)
                self._plan_measured(key, chain, key, dev)
                return
            chain, agree_on = self._measure_step(step)
            if self.tail is not None and \
                    self.tail.begin(self, key, chain, agree_on, tensor_leaves(out), step):
                return  # planned when the model's forward returns, with its tail as stage L
            self._plan_measured(key, chain, agree_on, dev)
        elif step.collector is not None:
            est = _collected(step)
            sample = (step.input_size, est.input_bytes, tuple(est.xbar), tuple(est.out),
                      tuple(est.fw), step.collector.tmp(), step.collector.failed is not None)
            if self.tail is not None and not self._under_fsdp():
                # the model's tail is measured too, and the sample recorded with it when the
                # model's forward returns (``_plan_measured``; without it if that fails)
                # (the tail adds the tied gradients it finds). Not under FSDP, as for rotor's
                # forward-only measurement there: the tail's replayed backward would run FSDP's
                # root hooks (FSDP1 reshards the root before the real backward)
                chain = _with_outside(chain_from_estimate(est, "mimose-sample"), step)
                if self.tail.begin(self, (MIMOSE_SAMPLE, sample, self._collecting_into),
                                   chain, None, tensor_leaves(out), step):
                    return
            self._observe_sample(sample, None, None, self._collecting_into)

    def _observe_sample(self, sample: Tuple[Any, ...], tail: Optional[List[float]],
                        outside: Optional[List[float]], into: Optional[Mimose] = None,
                        tail_failed: bool = False) -> None:
        """One Mimose collection step's measurements (``sample``: size, input bytes, xbar,
        out, fw, the blocks' transients or None, and whether measuring those failed), with
        the model's tail and what the step held outside the chain, if measured
        (``tail_failed``: its measurement failed, or the step raised in it), for ``into``
        (the Mimose of the setting the step ran under; None: the current one). All or
        nothing, for the tail and for the transients alike: the estimator fits every column
        on every sample, so a sample without them (their measurement failed) among samples
        with them would teach it zeros. Such a sample is dropped (the size is collected again
        on its next step); once the first sample had no tail (no transients), none is learnt.
        A first sample without them because their measurement failed (an out-of-memory in the
        tail, a step interrupted) does not decide that for the run: it is dropped too, up to
        ``FIRST_SAMPLE_TRIES`` times, since learning without the tail plans every later step
        without the tail's memory."""
        size, input_bytes, xbar, out, fw, tmp, tmp_failed = sample
        if self._mimose_tails is None:
            failed = [what for what, got, broke in (
                ("the model's tail", tail, tail_failed),
                ("the blocks' transients", tmp, tmp_failed)) if got is None and broke]
            if failed:
                self._first_failures += 1
                if self._first_failures < FIRST_SAMPLE_TRIES:
                    warnings.warn(
                        f"{self.name}: measuring {' and '.join(failed)} failed on a Mimose "
                        "collection step before any sample was learnt; its sample is dropped "
                        "(the size is collected again) rather than learning without them for "
                        "the whole run", stacklevel=2)
                    return
                warnings.warn(
                    f"{self.name}: measuring {' and '.join(failed)} failed on the first "
                    f"{FIRST_SAMPLE_TRIES} Mimose collection steps; Mimose learns without "
                    "them from now on (their memory is not in its plans)", stacklevel=2)
            self._mimose_tails, self._mimose_tmp = tail is not None, tmp is not None
        missing = [what for what, carried, got in (
            ("the model's tail", self._mimose_tails, tail),
            ("the blocks' transients", self._mimose_tmp, tmp)) if carried and got is None]
        if missing:
            target = into or self.mimose
            if target is not None and target.ready:  # a size beyond the fit's reach
                failed = target.reach_failures = getattr(target, "reach_failures", 0) + 1
                if failed == REACH_TRIES:
                    warnings.warn(
                        f"{self.name}: {' and '.join(missing)} not measured on {failed} Mimose "
                        "collection steps of sizes beyond 1.5x the largest learnt; such sizes "
                        "are planned from the fit (extrapolated) from now on", stacklevel=2)
                    return
            warnings.warn(f"{self.name}: {' and '.join(missing)} not measured on this Mimose "
                          "collection step; its sample is dropped (the size is collected "
                          "again)", stacklevel=2)
            return
        if not self._mimose_tails:
            tail = outside = None
        if not self._mimose_tmp:
            tmp = None
        (into or self.mimose).observe(size, input_bytes, xbar, out, fw, tail, outside, tmp)
        self.collections += 1

    def _rng_bytes(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> int:
        """Host bytes of the random states a step keeps: one per block it may recompute
        (``ChainStep``'s frames), one more while a recomputation replays a state. They are
        in the CPU allocator's memory, so they count only where the step runs on the CPU."""
        dev = _device_of(args, kwargs)
        if dev is not None and dev.type != "cpu":
            return 0
        return (self.L + 1) * torch.get_rng_state().numel()

    def _unplanned(self, s: int, out: Any) -> None:
        """Block ``s`` ran outside a step (block 0's arguments and the blocks' weights wanted
        no gradient) yet its output wants one: a trainable tensor reached the blocks another
        way, and the forward keeps every activation with no plan. Said once."""
        if any(t.requires_grad for t in tensor_leaves(out)):
            self._said_unplanned = True
            warnings.warn(
                f"{self.name}: block {s} of '{self.list_name}' returned a tensor that needs a "
                "gradient, but neither block 0's arguments nor the blocks' weights needed one "
                "when the forward began (a trainable tensor reaches the blocks another way: a "
                "forward hook, a KV cache holding a trained prefix, ...): such forwards run "
                "without a plan, keeping every activation; the budget does not hold for them",
                stacklevel=4)

    def _sharded(self) -> bool:
        """Whether FSDP (1 or 2) manages the blocks' parameters."""
        return fsdp.sharded(self.blocks, self.entries)

    def _under_fsdp(self) -> bool:
        """``_sharded``, or the model is an FSDP2 module as a whole (``fully_shard(model)``
        alone: inside its forward the blocks' parameters are plain tensors, gathered), whose
        root hooks a replay of the tail's backward would run on one rank alone."""
        return self._sharded() or (self.tail is not None and
                                   "FSDP" in type(self.tail.model).__name__)

    def _agrees(self) -> bool:
        """Whether the ranks must run one plan, so a measured chain is agreed (the max over
        ranks, issue 15) before planning: where a recomputation runs collectives every rank
        must join: FSDP shards the blocks (a unit gathers its parameters), or a block holds a
        ``SyncBatchNorm`` (its training forward all-reduces statistics). Otherwise, under DDP,
        each rank plans on its own measurement: a plan changes no gradient, and an agreement,
        a collective of its own at each rank's profiling steps, would pair with another rank's
        gradient all-reduce when ranks meet new shapes at different steps (per-rank dynamic
        padding): a crash with gloo, undefined with NCCL. (Other collectives inside blocks,
        tensor parallelism by hand, MoE all-to-alls, cannot be seen: ``on_chain=agree_chain``.)"""
        if not distributed.active():
            return False
        if self._one_plan is None:  # before the first step (a query): as the blocks are now
            return self._needs_one_plan()
        return self._one_plan

    def _needs_one_plan(self) -> bool:
        """``_agrees``'s answer from the blocks. Decided once, at block 0's call of the first
        step in a process group (``_plan``): the blocks' wrapping does not change between
        steps, FSDP1's flat-parameter views exist there (they are gone at the end of a
        forward, where a profiling step agrees), and the scan (every block's tensors: about
        2 ms at 32 blocks) stays off each step."""
        return self._sharded() or any(isinstance(m, nn.SyncBatchNorm)
                                      for b in self.blocks for m in b.modules())

    def _same_plan_keys(self, key: Hashable, args: Sequence[Any],
                        kwargs: Dict[str, Any]) -> None:
        """Where the ranks must run one plan (``_agrees``), every rank runs the plan of the same
        key (input signature, budget, mode, autocast) at every step, and needs a new plan at
        the same steps. One all-reduce per step finds a rank that plans alone, or ranks that
        run different cached plans (one recomputing from a checkpoint, its collectives paired
        with another rank's gradient reduction), and stops every rank at once, where they
        would otherwise hang until the process group's timeout (30 minutes by default)."""
        new = key not in self.cache
        mixed, differ = distributed.differ(new, key)
        if not (mixed or differ):
            return
        if mixed:
            n = distributed.ranks_with(new)
            what = (f"{n} of {torch.distributed.get_world_size()} ranks meet a new input "
                    f"signature for '{self.list_name}' at this step (this rank: "
                    f"{'yes' if new else 'no'})")
            must = "meet new shapes at the same steps"
        else:
            what = (f"the ranks call block 0 of '{self.list_name}' with different input "
                    "signatures at this step, each known from an earlier step")
            must = "call the blocks with the same signature at the same step"
        raise RuntimeError(
            f"{self.name}: {what}; where a recomputation runs collectives (FSDP units, "
            f"SyncBatchNorm) every rank must run one plan, so every rank must {must}: pad "
            "each step's batches to the same length on every rank, or use planner='mimose'"
            f"{self._differences(args, kwargs)}")

    def _differences(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
        """What differs between this rank's call of block 0 and the other ranks' (a collective:
        every rank is on this error path at once), for the message."""
        mine = dict(describe_arguments(args, kwargs),
                    **{"weights' dtype": repr(weights_dtype(self.blocks))},
                    budget=repr(self._budget),
                    mode="train" if self.blocks[0].training else "eval",
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

    def _run_again(self, s: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        was, self.passthrough = self.passthrough, True
        try:
            with outputs_not_captured():
                return (fsdp.unit_of(self.entries, s, self.blocks[s]) or self.blocks[s])(
                    *args, **kwargs)
        finally:
            self.passthrough = was

    def call(self, s: int, args: Tuple[Any, ...], kwargs: Dict[str, Any],
             run_first: Callable[[Tuple[Any, ...], Dict[str, Any]], Any],
             all_inputs: bool = False) -> Any:
        """Block ``s`` called with ``(args, kwargs)``; ``run_first`` runs it (first run)."""
        if self.passthrough:
            return run_first(args, kwargs)
        self.calls += 1
        if s == 0:
            forward = self.tail.forward_number() if self.tail is not None else None
            if self.tail is not None:  # a tail measured since the last block is over
                self.tail.block_zero()
            if self.current is not None:  # the last forward stopped between blocks (raised)
                stale = self.current
                self.abandon_step()
                # ... or block 0 runs twice in a row in one forward, on its own output
                # (Funnel's block_repeats); a pass the model's own code broke off and began
                # again (a retry) goes on
                prev = self._block0_out() if self._block0_out is not None else None
                if stale.next == 1 and forward is not None and forward == self._step_in and \
                        prev is not None and any(t is prev for t in tensor_leaves((args, kwargs))):
                    raise RuntimeError(
                        f"{self.name}: block 0 of '{self.list_name}' was called again before "
                        f"block {stale.next}, in the same forward of the model: the model must "
                        f"call each of its {self.L} blocks once, in order, per forward (a "
                        "model that repeats each block, as Funnel's block_repeats does, can "
                        "name one of its blocks' own lists with blocks=)")
            step_now = self._needs_grad(args, kwargs)
            if step_now and forward is not None and forward == self._pass_in:
                self._several_passes()
            self._step_in = forward
            if step_now:  # a checkpoint/offload wrapper put on the blocks since the call
                fsdp.refuse_wrapped(self.blocks, self.entries, self.name, at_step=True)
                if self.sequential:  # scheduler.wrap's loop calls FSDP1 units itself
                    fsdp.refuse_units_in_mixed_precision(self.blocks, self.entries,
                                                         self.name)
            self.current = self._begin(args, kwargs) if step_now else None
            if self.current is not None and self.tail is not None and \
                    (self.current.profile_key is not None or
                     self.current.collector is not None):  # profiling / Mimose collection
                # what the step holds outside the chain (masks, the head's saved tensors)
                self.current.outside = self.tail.outside(
                    args, kwargs, self._rng_bytes(args, kwargs))
                if self.mimose is not None:  # a collection step: the masks counted there
                    self.current.collector.outside_counted = self.current.outside is not None
        step = self.current
        if step is None:  # no gradient wanted (no_grad, eval loops, frozen model): plain
            out = run_first(args, kwargs)
            if not self._said_unplanned and torch.is_grad_enabled():
                self._unplanned(s, out)
            return out
        try:
            out = step.forward_block(s, args, kwargs, lambda a, k: run_first(a, k), all_inputs)
        except BaseException:
            # the forward is over (an OOM, an interrupt): what the step holds (checkpoints)
            # must not stay allocated until the next forward, e.g. a retry with a smaller batch
            self.current = None
            step.abandon()
            raise
        if s == 0:
            first = next(iter(tensor_leaves(out)), None)
            self._block0_out = weakref.ref(first) if first is not None else None
        if s == self.L - 1:
            self.current = None
            self._pass_in = self._step_in
            self._end_forward(step, out)
        return out

    def abandon_step(self) -> None:
        """The model's forward stopped (raised) with a step begun: the step lets go of what it
        holds (checkpoints, the partial graph) now, not when the next forward begins. (Else
        its holders/graph cycle would never be freed.)"""
        step, self.current = self.current, None
        if step is not None:
            step.abandon()

    def _several_passes(self) -> None:
        """The list ran whole a second time in one forward of the model (ALBERT's shared
        layers, Perceiver's num_blocks, one encoder called twice): each pass is planned as a
        step of its own with the whole budget, and all passes hold their activations until
        the backward, so the forward can hold a multiple of the budget. Gradients stay exact;
        the budget does not hold, which must not go unsaid."""
        if self._said_passes:
            return
        self._said_passes = True
        warnings.warn(
            f"{self.name}: the blocks of '{self.list_name}' ran a second time in one forward "
            "of the model (shared layers run in a loop, as ALBERT's and Perceiver's are, or "
            "one block list called twice): each pass is planned with the whole budget and "
            "all of them hold their activations until the backward, so the budget does not "
            "hold (the gradients are exact)", stacklevel=4)

    # -------------------------------------------------------------------------- report
    def stats(self) -> Dict[str, Any]:
        """Plan cache figures, planning time, and the last run's peak (tracked runs)."""
        cache = self.mimose.cache if self.mimose is not None else self.cache
        out: Dict[str, Any] = {"planner": self.planner if isinstance(self.planner, str)
                               else type(self.planner).__name__, "budget": self._budget,
                               "profiling_steps": self.profiling_steps,
                               "chains_measured": self.measurements}
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


def _device_of(args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[torch.device]:
    return next((t.device for t in tensor_leaves((tuple(args), kwargs))), None)


