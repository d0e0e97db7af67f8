"""The chain runner: plans for a list of blocks, and the steps that run them.

One runner serves both entry points: ``scheduler.checkpoint(model, ...)`` (the model's own
loop calls the blocks, see ``checkpoint``) and ``scheduler.wrap(blocks, ...)`` (a bare chain:
``wrap.CheckpointedChain``'s loop calls them). For each input signature (shapes, dtypes,
devices, grad flags of block 0's arguments), budget and train/eval mode the runner gets a
chain (``_chain_for``: given, measured, or measured at the end of a first forward that
checkpoints every block), asks the planner for a Plan (``planning.make_plan``: its predicted
peak and time are the simulator's own) and caches it (``PlanCache``); a new shape or a new
budget plans again. With ``planner="mimose"`` the Mimose collector learns per-block memory
online and plans per input size (``mimose_steps.MimoseSteps``, mixed in). Each forward +
backward is a ``chain_exec.ChainStep`` (non-reentrant), following the plan as
``compiled_plan.CompiledPlan`` splits it. Ranks that must run one plan are checked at each
step (``one_plan``).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from vmalloc import user_warning
from ..chain import Chain, add_outside
from ..errors import InfeasibleError
from ..plan import Plan, checkpoint_plan
from ..plan_cache import PlanCache, capacity_arg
from ..planners.mimose import DEFAULT_SAMPLES, Mimose, chain_from_estimate
from ..profile.storage import grad_bytes
from ..simulate import simulate_checkpointed
from ..units import format_bytes
from . import distributed, first_run, fsdp, one_plan, rng
from .bandwidth import default_bandwidth
from .block_calls import signature, tensor_leaves, weights_dtype
from .chain_exec import ChainStep, RunStats
from .chain_transfers import ChainTransfers
from .compiled_plan import CompiledPlan
from .hf_outputs import outputs_not_captured
from .input_aware import InputAwareChain
from .measuring import BoundBlock, measure_preserved
from .mimose_collector import ShuttlingCollector
from .mimose_steps import MIMOSE_SAMPLE, MimoseSteps, collected
from .options import (ChainArg, PlannerArg, check_bool, check_callable, check_measure,
                      check_planner, default_input_size, parse_budget, parse_rate)
from .outside import with_outside
from .planning import make_plan, profiling_peak
from .weak import gone
from .tail import TAIL_TRIES
from .tail_outputs import OutputsBook, shape_of as _shape_of

MEASUREMENTS_SAID = 8  # input shapes measured (a chain each) before saying how to avoid it


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


# ------------------------------------------------------------------------------ runner
class ChainRunner(MimoseSteps):
    """Plans and steps for one list of blocks (see the module doc). ``call`` is what each
    block call goes through; ``name`` prefixes errors (the entry point the user called)."""

    OPTIONS = ("chain", "track_memory", "cache_size", "samples", "input_size", "mimose",
               "loss", "measure_options", "on_chain", "outputs")
    OUTPUTS = ("watch", "dropped", "held")   # ``outputs=``: ``tail_outputs``

    def __init__(self, blocks: Sequence[nn.Module], budget: Any, planner: PlannerArg = "rotor",
                 bandwidth: Any = None, *, chain: ChainArg = None, track_memory: bool = False,
                 cache_size: int = 64, samples: int = DEFAULT_SAMPLES,
                 input_size: Optional[Callable[[Sequence[Any]], float]] = None,
                 mimose: Optional[Mimose] = None, loss: Any = "sum",
                 measure_options: Optional[Dict[str, Any]] = None,
                 on_chain: Optional[Callable[[Chain], Chain]] = None,
                 outputs: Optional[str] = None,
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
        if outputs is not None and outputs not in self.OUTPUTS:
            raise ValueError(f"{name}: outputs must be one of {', '.join(map(repr, self.OUTPUTS))}"
                             f" (what the caller does with the model's outputs), got {outputs!r}")
        self.outputs = outputs or "watch"
        self.loss = "sum" if loss is None else loss  # (None: the default, as for every option)
        # checked here: measure_chain would see them only at the first step, deep inside it
        self.measure_options = check_measure(self.loss, measure_options, name)
        self.track_memory = check_bool(track_memory, "track_memory", name)
        self.sequential = sequential
        self.cache: PlanCache[CompiledPlan] = PlanCache(capacity_arg(cache_size, name))
        check_callable(input_size, "input_size", name, "a callable from block 0's arguments "
                       "to a number (the input size)")
        self.input_size = input_size or default_input_size
        self._init_mimose(mimose, planner == "mimose", samples, cache_size)
        self._compiled: Dict[int, Tuple[Plan, CompiledPlan]] = {}
        self._transfers: Dict[str, ChainTransfers] = {}
        self.current: Optional[ChainStep] = None
        self.passthrough = False   # recomputing or measuring: block calls go straight through
        self.last_stats: Optional[RunStats] = None
        self.last_plan: Optional[Plan] = None
        self.profiling_steps = 0
        self.measurements = 0  # chains measured (measure_chain), one per new shape
        self._measured: Dict[Hashable, Chain] = {}  # measured chains by shape (_shape_of)
        # how each shape's plans count the model's outputs, and what backwards saw the
        # caller do with them since (``tail_outputs``)
        self.outputs_book = OutputsBook(name)
        # profiling steps whose chain an InputAwareChain learns: profile key -> input size
        self._learning: Dict[Hashable, float] = {}
        # profiling steps whose tail measurement failed, by shape (``_tail_failed``)
        self._tail_failures: Dict[Hashable, int] = {}
        self._said_shapes = False  # MEASUREMENTS_SAID's warning, given once
        self.calls = 0  # block calls through the runner (a list its model never calls: 0)
        self.said_uncalled = False  # tail.TailProbe's warning that they never were, given
        self._said_unplanned = False  # _unplanned's warning, given once
        self._in_place = first_run.InPlaceBuffers()  # buffers the blocks change in place
        # scheduler.checkpoint's measurement of the model's tail (stage L), or None: the
        # chain's loss stage is measure_chain's ``loss`` (scheduler.wrap, or loss= given)
        self.tail = None
        # the model's forward (tail.forward_number) the step in flight began in, and the one
        # the last whole pass over the list ended in: a second pass or a repeated block 0 in
        # one forward is told apart from a new forward after one that raised
        self._step_in: Optional[int] = None
        self._pass_in: Optional[int] = None
        self._said_passes = False  # _several_passes's warning, given once
        self._said_profiling = False  # _say_profiling_peak's warning, given once
        self._block0_out: Any = None  # weakref to the step's block 0 output (a repeated block 0)
        # the last step whose forward ended (weakly: its graph's holders keep it alive) and
        # _stacked_forwards's warning, given once
        self._ended: Any = None
        self._said_stacked = False
        self._said_compiled = False  # _say_compiled_around's warning, given once
        self._one_plan: Optional[bool] = None  # whether the ranks must run one plan (_agrees),
        # decided at the first step in a process group

    # ---------------------------------------------------------------- copies and pickles
    def __getstate__(self) -> Dict[str, Any]:
        """A copy or a pickle (``copy.deepcopy(model)``, ``torch.save(model)``) keeps the
        options, the measured chains and the plans (keyed by the devices they were measured
        on: another device measures again); not what lives on this process's devices or is
        under way: the copy engines' streams, a step in flight, the plans compiled by id."""
        state = self.__dict__.copy()
        state.update(_compiled={}, _transfers={}, current=None, passthrough=False,
                     _learning={}, _block0_out=None, _ended=None, _one_plan=None,
                     _collecting_into=None,
                     _tail=self.tail)  # (the copy's probe, in a copy of the model)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        tail = state.pop("_tail", None) or state.pop("tail", None)  # (pickled strongly once)
        self.__dict__.update(state)
        self.tail = tail
        for name, value in (("_learning", {}), ("_said_profiling", False),
                            ("_tail_failures", {}), ("_ended", None), ("_said_stacked", False),
                            ("_said_compiled", False), ("outputs", "watch")):
            self.__dict__.setdefault(name, value)  # (a runner pickled before they existed)
        self.__dict__.pop("_tail_unverified", None)   # (its guesses: measured again)
        if "outputs_book" not in self.__dict__:
            self.outputs_book = OutputsBook(self.name)
        self._mimose_unpickled()

    # -------------------------------------------------------------------------- knobs
    @property
    def tail(self) -> Any:
        """The model's ``tail.TailProbe`` (``scheduler.checkpoint``), or None. Held weakly:
        a recording in progress holds the profiling step's graph, whose holders reach this
        runner (``ChainStep.run_again``): held strongly, a Ctrl-C in the model's tail would
        leave a cycle through autograd's C++ nodes, which the garbage collector cannot see
        (the probe, its recording, the step and the blocks, never freed). The model holds the
        probe (its hooks)."""
        return self._tail()

    @tail.setter
    def tail(self, probe: Any) -> None:
        self._tail = gone if probe is None else weakref.ref(probe)

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
        chain = self._with_casts(with_outside(self._measure(stages, x0), step.outside))
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
            self._sample_with_tail(key, chain)
            return
        size = self._learning.pop(key, None)
        tail = chain.meta.get("tail")  # (``tail.TailProbe``'s; a Mimose estimate's is a word)
        failed = isinstance(tail, dict) and bool(tail.get("failed"))
        if self._measure_again(key, failed):
            return  # at the shape's next step (this step's forward is over: it needs no plan)
        if size is not None and not failed:  # InputAwareChain learns the chain agreed, before
            if agree_on is not None and self._agrees():  # on_chain
                chain = distributed.agree_chain(chain, key=agree_on)
            agree_on = None
            self.chain_source.learn(size, chain)
        chain = self._check_chain(chain, agree_on=agree_on)
        if self.chain_source is None and not failed:
            self._remember(key, chain)
        self.cache.get_or_plan(key, lambda: self._plan_on(chain, device, key))
        self._say_profiling_peak(chain)

    def _measure_again(self, key: Hashable, failed: bool) -> bool:
        """Whether the chain of a profiling step is dropped because measuring the model's tail
        ``failed`` on it (an exception or a Ctrl-C in the tail, an out-of-memory in its
        replay): its stage L is the stand-in loss (the tail costs nothing), and remembered,
        cached or taught to an ``InputAwareChain`` it would plan the shape without the tail's
        memory for good. The shape is measured again at its next step, up to ``TAIL_TRIES``
        failures; then it is planned on the stand-in for this key (not remembered, not
        learnt), with a warning. Where the ranks must run one plan (``_agrees``) it is
        planned at once (a rank measuring again alone would leave the others' agreement
        unmatched)."""
        shape = _shape_of(key)
        if not failed:
            self._tail_failures.pop(shape, None)
            return False
        if len(self._tail_failures) > 4 * self.cache.capacity:  # (shapes never seen again)
            self._tail_failures.clear()
        tries = self._tail_failures[shape] = self._tail_failures.get(shape, 0) + 1
        if tries < TAIL_TRIES and not self._agrees():
            return True
        self._tail_failures.pop(shape, None)
        user_warning.warn(
            f"{self.name}: measuring the model's tail (what runs after the last block of "
            f"'{self.list_name}': final norm, head, loss) failed on {tries} profiling step(s) "
            "of this input shape; it is planned on measure_chain's stand-in loss stage, which "
            "counts none of the tail's memory: the budget may not hold for it")
        return False

    def _say_profiling_peak(self, chain: Chain, collected: Optional[str] = None) -> None:
        """Say once that the first step of each new shape (every block checkpointed while
        its chain is measured), or a Mimose collection step (``collected``: its input in
        words, ``chain`` its sample's), holds more than the budget, where it does: planned
        steps hold the budget, but those steps do not, and a budget chosen to fit a device
        would fail there without a word of why. The figure is the chain model's, with the
        measurement's own copies: an estimate (the CPU's kernels' scratch buffers are not in
        it; a few percent on the models tested)."""
        if self._said_profiling or not isinstance(self._budget, int) or \
                isinstance(self.planner, Plan) or callable(self.planner):
            return
        every = self.profiling_peak(chain)
        if every <= self._budget:
            return
        self._said_profiling = True
        budget, need = f"the budget {format_bytes(self._budget)}", int(every)
        if self.budget_share is not None:  # this list's share: say it in the user's terms
            n, n_all = self.budget_share
            budget = (f"'{self.list_name}''s share of the budget ({n}/{n_all} of it, by block "
                      f"count: {format_bytes(self._budget)})")
            need = self._whole_budget(need)
        held = (f"{format_bytes(int(every))} by the chain's model (that step's, with the "
                "measurement's own copies and gradients of one block)")
        if collected is None:
            said = (f"the first step of each new input shape of '{self.list_name}' checkpoints "
                    f"every block while its chain is measured, and holds about {held}, above "
                    f"{budget}; the planned steps after it hold the budget. Where that first "
                    f"step must fit too, give a budget of at least about {format_bytes(need)}, "
                    "or the chain (chain=, measured beforehand with "
                    "scheduler.profile.measure_chain)")
        else:
            said = (f"Mimose's collection steps of '{self.list_name}' (new input sizes while "
                    "it learns, and sizes beyond 1.5x the largest learnt) checkpoint every "
                    f"block while each is measured; the one of {collected} holds about "
                    f"{held}, above {budget}; the planned steps after them hold the budget. "
                    "Where the collection steps must fit too, give a budget of at least about "
                    f"{format_bytes(need)} (for that input: larger inputs need more)")
        user_warning.warn(f"{self.name}: {said}")

    def _say_compiled_around(self) -> None:
        """Say once that a ``torch.compile`` directive around the blocks' calls compiles
        nothing of them (``fsdp.compiled_around``): a training run otherwise as fast as eager,
        without a word, where the user asked for compiled blocks."""
        found = fsdp.compiled_around(self.blocks, self.entries)
        if not found:
            return
        self._said_compiled = True
        user_warning.warn(
            f"{self.name}: block(s) {found} of '{self.list_name}' are compiled around the "
            "call the runner intercepts (block.compile(), or torch.compile(block) put in the "
            "list after scheduler.checkpoint): the runner calls each block's own forward "
            "outside the compiled region, so nothing of theirs is compiled. Compile the blocks "
            "as the list's entries first, then call scheduler.checkpoint (again): "
            "layers[i] = torch.compile(layers[i]); the runner runs those compiled, first runs "
            "and recomputations alike")

    def profiling_peak(self, chain: Chain) -> float:
        """``planning.profiling_peak`` of ``chain``, with these blocks' weight gradients."""
        return profiling_peak(chain, [grad_bytes(b.parameters()) for b in self.blocks])

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

    def _plan_on(self, chain: Chain, device: Optional[torch.device],
                 key: Hashable = None) -> CompiledPlan:
        """The compiled plan the planner makes on ``chain`` for plan key ``key`` (an
        infeasible budget names the input and what the step holds without checkpointing; a
        share's, what the whole budget would need)."""
        try:
            plan = make_plan(chain, self._budget, self.planner,
                             self._rate(device) if self._transfers_planned else self.bandwidth)
        except InfeasibleError as e:
            raise self._in_share(self._for_input(e, chain, key)) from e
        return self._compile(plan)

    def _for_input(self, e: InfeasibleError, chain: Optional[Chain], key: Hashable
                   ) -> InfeasibleError:
        """``e`` with the input it was planned for (a new shape can be the first that does
        not fit, many steps into training) and, given the ``chain``, the other end of the
        budget's range."""
        where = self._block0_tensors(key)
        where = f"{where} of " if where else ""
        held = "" if chain is None else \
            f"; without checkpointing the step holds " \
            f"{format_bytes(int(simulate_checkpointed(chain, ())[1]))}"
        return InfeasibleError(f"{e} ({where}'{self.list_name}'{held})", e.min_memory)

    @staticmethod
    def _block0_tensors(key: Hashable) -> str:
        """Block 0's tensors in words (``block 0's tensors (2, 12, 32), (1, 12)``), from the
        plan key ``key`` (``_key``); empty without a key or tensors."""
        shapes = [] if key is None else \
            [str(leaf[0]) for leaf in key[0][0][1] if leaf[0] != "const"]  # (see ``_key``)
        return f"block 0's tensors {', '.join(shapes)}" if shapes else ""

    def _in_share(self, e: InfeasibleError) -> InfeasibleError:
        """A planner's ``InfeasibleError`` for this list's share of the budget, in terms of the
        whole budget the user gave (the error as it is without a share)."""
        if self.budget_share is None or self._budget is None:
            return e
        n, n_all = self.budget_share
        need = None if e.min_memory is None else self._whole_budget(int(e.min_memory))
        return InfeasibleError(
            f"{self.name}: '{self.list_name}' gets {n}/{n_all} of the budget, a share of "
            f"{format_bytes(self._budget)} (the model's block lists share the budget by block "
            f"count), and {e}" + ("" if need is None else
                                 f"; for that share to fit, the whole budget must be at "
                                 f"least {format_bytes(need)}"), need)

    def _whole_budget(self, share: int) -> int:
        """The whole budget that gives this list a share of at least ``share`` bytes (the
        lists share it by block count, ``budget_share``)."""
        n, n_all = self.budget_share  # type: ignore[misc]
        return -(-share * n_all // n)

    @property
    def _transfers_planned(self) -> bool:
        """Whether the planner plans transfers (its bandwidth depends on the device)."""
        return self.planner == "pofo"

    def _plan(self, args: Sequence[Any], kwargs: Dict[str, Any], step: bool = False
              ) -> Tuple[CompiledPlan, Any, Any]:
        """The compiled plan for this forward; the cache key to fill after it if the chain
        must first be measured on it (a profiling step), else ``None``; and the plan's key
        (None: a plan given, or no budget). ``step`` (a step, not a query: every rank calls
        it at once): the ranks check they plan together."""
        if isinstance(self.planner, Plan):
            return self._compile(self.planner), None, None
        if self._budget is None and not callable(self.planner):
            return self._compile(checkpoint_plan(self.L, [], planner="none")), None, None
        key = self._key(args, kwargs)
        if step and distributed.active():  # before any measurement (``_chain_for`` agrees)
            if self._one_plan is None:
                self._one_plan = one_plan.needs_one_plan(self.blocks, self.entries)
            if self._one_plan:
                one_plan.check_same_keys(key not in self.cache, key, args, kwargs, self.blocks,
                                         self._budget, self.name, self.list_name)
        _, budget, _, _ = key
        for shape, chain in self.outputs_book.take(key, step, self._measured,
                                                   self._peak_at(key), budget):
            self._replan(shape, chain)
        cached = self.cache.get(key)
        if cached is not None:
            return cached, None, key
        # a new budget for a shape measured before plans on that chain (no measurement)
        chain = self._measured.get(_shape_of(key)) if self.chain_source is None else None
        if chain is None:
            chain = self._chain_for(args, kwargs)
            if chain is not None and self.chain_source is None:  # measured (a bare chain)
                self._remember(key, chain)
        if chain is None:  # checkpoint every block while the chain is measured on this step
            return self._compile(checkpoint_plan(self.L, range(self.L), planner="profile")), \
                key, key
        dev = _device_of(args, kwargs) if self._transfers_planned else None  # (a tree walk)
        shape = _shape_of(key)

        def plan() -> CompiledPlan:   # (on the chain measured now: ``settle`` may go back)
            on = self._measured.get(shape, chain) if self.chain_source is None else chain
            return self.cache.get_or_plan(key, lambda: self._plan_on(on, dev, key))
        return self.outputs_book.settle(key, plan, self._replan), None, key

    def _peak_at(self, key: Hashable) -> Callable[[Hashable], Optional[float]]:
        """A shape's plan's predicted peak at ``key``'s budget, if planned (for
        ``OutputsBook.take``)."""
        def peak(shape: Hashable) -> Optional[float]:
            cached = self.cache.peek(key) if shape == _shape_of(key) else None
            return cached.plan.predicted_peak if cached is not None else None
        return peak

    def outputs_mode(self, key: Hashable) -> Optional[str]:
        """How a profiling step's plan for ``key`` counts the model's outputs
        (``tail_outputs``): ``outputs=`` as given ("dropped", "held"), "watch" (by what the
        caller does at that step), or None: through the tail's backward only, as before. Only
        a chain this runner measured (not Mimose's, an ``InputAwareChain``'s); watched only
        where the caller's code is not run on it (``on_chain``) and there is no process group
        (DDP hands the caller copies of the outputs, ``_DDPSink``: those seen would always
        look dropped)."""
        if self.chain_source is not None or self.mimose is not None or \
                (isinstance(key, tuple) and key and key[0] == MIMOSE_SAMPLE):
            return None
        if self.outputs != "watch":
            return self.outputs
        if self.on_chain is not None or (torch.distributed.is_available()
                                         and torch.distributed.is_initialized()):
            return None
        return "watch"

    def _replan(self, shape: Hashable, chain: Chain) -> None:
        """Plan ``shape``, at any budget, on ``chain`` from now on (its plans made again)."""
        self._measured[shape] = chain
        self.cache.drop_if(lambda k: _shape_of(k) == shape)

    def _remember(self, key: Hashable, chain: Chain) -> None:
        """Keep a measured chain for its shape (the plan key less the budget); at the
        MEASUREMENTS_SAID-th input signature, say how to avoid a measurement per shape."""
        if len(self._measured) >= 4 * self.cache.capacity:
            self._measured.clear()
            # (the shapes' watches go too, and those shapes count the outputs as planned
            # without a check; the shape just profiled registered its watch before this)
            watches = self.outputs_book.watches
            watch = watches.get(_shape_of(key))
            watches.clear()
            if watch is not None:
                watches[_shape_of(key)] = watch
        self._measured[_shape_of(key)] = chain
        if not self._said_shapes and \
                len({shape[0] for shape in self._measured}) >= MEASUREMENTS_SAID:
            self._said_shapes = True
            user_warning.warn(
                f"{self.name}: chains measured for {MEASUREMENTS_SAID} input shapes so far, "
                "each an extra forward and backward of every block. For inputs whose shape "
                "changes from step to step (dynamic padding), use planner='mimose' or "
                "chain=scheduler.runtime.input_aware.InputAwareChain(blocks), which predict "
                "new shapes from a few measured ones, or pad to a few fixed lengths")

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

    def _transfers_for(self, dev: torch.device) -> ChainTransfers:
        """The copy streams and pinned pool of ``dev``: one per device a moved storage lives
        on (blocks spread over GPUs, a ``device_map``, copy on their own device's streams)."""
        if str(dev) not in self._transfers:
            self._transfers[str(dev)] = ChainTransfers(dev)
        return self._transfers[str(dev)]

    def _begin(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> ChainStep:
        collector, profile_key, key = None, None, None
        if self.mimose is not None:
            cplan, collector = self._plan_mimose(args, kwargs, agree=True)
            # the collection's samples go to the Mimose of the setting it ran under
            self._collecting_into = self.mimose if collector is not None else None
        else:
            cplan, profile_key, key = self._plan(args, kwargs, step=True)
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
        if profile_key is None and key is not None and self.outputs_book.watches:
            watch = self.outputs_book.watches.get(_shape_of(key))
            if watch is not None and watch.assumed and self.outputs_mode(key) == "watch":
                step.watch = watch   # (``_end_forward`` hands it to the model's probe)
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
                chain = with_outside(chain_from_estimate(collected(step),
                                                         name="forward-measured"), step.outside)
                self._plan_measured(key, chain, key, dev)
                return
            chain, agree_on = self._measure_step(step)
            if self.tail is not None and \
                    self.tail.begin(self, key, chain, agree_on, tensor_leaves(out), step):
                return  # planned when the model's forward returns, with its tail as stage L
            self._plan_measured(key, chain, agree_on, dev)
        elif step.collector is not None:  # a Mimose collection step
            self._end_collection(step, out)
        elif step.watch is not None and self.tail is not None:
            self.tail.watch_outputs(self, step.watch, out, step)

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
            user_warning.warn(
                f"{self.name}: block {s} of '{self.list_name}' returned a tensor that needs a "
                "gradient, but neither block 0's arguments nor the blocks' weights needed one "
                "when the forward began (a trainable tensor reaches the blocks another way: a "
                "forward hook, a KV cache holding a trained prefix, ...): such forwards run "
                "without a plan, keeping every activation; the budget does not hold for them")

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
        ranks, ``distributed.agree_chain``) before planning: where a recomputation runs
        collectives every rank must join: FSDP shards the blocks (a unit gathers its
        parameters), or a block holds a ``SyncBatchNorm`` (its training forward all-reduces
        statistics). Otherwise, under DDP, each rank plans on its own measurement: a plan
        changes no gradient, and an agreement, a collective of its own at each rank's profiling
        steps, would pair with another rank's gradient all-reduce when ranks meet new shapes at
        different steps (per-rank dynamic padding): a crash with gloo, undefined with NCCL.
        (Other collectives inside blocks, tensor parallelism by hand, MoE all-to-alls, cannot be
        seen: ``on_chain=agree_chain``.)"""
        if not distributed.active():
            return False
        if self._one_plan is None:  # before the first step (a query): as the blocks are now
            return one_plan.needs_one_plan(self.blocks, self.entries)
        return self._one_plan

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
            elif step_now:
                self._stacked_forwards()
            self._step_in = forward
            if step_now:  # a checkpoint/offload wrapper put on the blocks since the call
                fsdp.refuse_wrapped(self.blocks, self.entries, self.name, at_step=True)
                if not self.sequential and not self._said_compiled:
                    self._say_compiled_around()
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
            self._ended = weakref.ref(step)
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
        user_warning.warn(
            f"{self.name}: the blocks of '{self.list_name}' ran a second time in one forward "
            "of the model (shared layers run in a loop, as ALBERT's and Perceiver's are, or "
            "one block list called twice): each pass is planned with the whole budget and "
            "all of them hold their activations until the backward, so the budget does not "
            "hold (the gradients are exact)")

    def _stacked_forwards(self) -> None:
        """A step begins while the last one's graph is alive and its backward has not begun:
        two forwards and one backward (``(model(a).loss + model(b).loss).backward()``), or
        outputs with their graphs kept across forwards (an evaluation without ``no_grad``
        collecting outputs, a traceback holding a failed step's). Each step is planned with the
        whole budget and holds its activations until its backward, so together they hold more
        than the budget. Gradients stay exact; the budget does not hold, which must not go
        unsaid: once per model (its lists share the tail probe), once per list without one.
        (A graph kept by ``backward(retain_graph=True)`` is not seen here: the README says it
        keeps the recomputed tensors.)"""
        last = self._ended() if self._ended is not None else None
        if self._said_stacked or last is None or last.backward_began:
            return
        self._said_stacked = True
        message = (
            f"{self.name}: the blocks of '{self.list_name}' began a forward while the last "
            "forward's graph was still waiting for its backward (two forwards before one "
            "backward; an output or loss kept with its graph: an evaluation without "
            "torch.no_grad(), a skipped backward whose loss is still referenced, an exception's "
            "traceback): each forward is planned with the whole budget and holds its "
            "activations until its backward, so together they hold more than the budget (the "
            "gradients are exact). Run backward after each forward (gradients accumulate in "
            ".grad), del a loss whose backward is skipped, or give each forward a share of the "
            "budget")
        if self.tail is not None:
            self.tail.warn_once("stacked forwards", message)
        else:
            user_warning.warn(message)

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
            if self.last_plan.chain is not None:  # the other end of the budget's range
                out["last_store_all_peak"] = simulate_checkpointed(self.last_plan.chain, ())[1]
        if self.mimose is not None:
            out.update(mimose_sizes_collected=len(self.mimose.estimator.sizes),
                       mimose_ready=self.mimose.ready, mimose_collections=self.collections)
        for t in self._transfers.values():
            out["offloaded_bytes"] = out.get("offloaded_bytes", 0) + t.offloaded_bytes
            out["prefetched_bytes"] = out.get("prefetched_bytes", 0) + t.prefetched_bytes
        return out


def _device_of(args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[torch.device]:
    return next((t.device for t in tensor_leaves((tuple(args), kwargs))), None)


