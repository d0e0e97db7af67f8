"""Mimose's side of the chain runner: collection steps, samples, and plans per input size.

With ``planner="mimose"`` the runner (``chain_runner.ChainRunner``, which mixes
``MimoseSteps`` in) learns per-block memory online and plans per input size: while the
estimator cannot answer a size, a step checkpoints every block and the shuttling collector
(``mimose_collector``) measures each block (a collection step); its sample, with the model's
tail when that is measured (``tail.TailProbe``), teaches the Mimose of the step's setting
(``mimose_setting``: what changes the bytes per element), one Mimose per setting.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
from torch import nn

from vmalloc import user_warning
from ..chain import Chain
from ..errors import InfeasibleError
from ..plan import Plan, checkpoint_plan
from ..plan_cache import PlanCache
from ..planners.mimose import (OUTSIDE_FIELDS, TAIL_FIELDS, Estimate, Mimose,
                               chain_from_estimate)
from ..profile.shared_grads import shared_grad_bytes
from . import accounting, distributed, rng
from .block_calls import tensor_leaves, weights_dtype
from .chain_exec import ChainStep
from .compiled_plan import CompiledPlan
from .input_shapes import InputShapes
from .mimose_collector import ShuttlingCollector
from .options import default_input_size
from .outside import with_outside

MIMOSE_SAMPLE = "mimose-sample"  # the key of a Mimose collection step whose tail is measured
MIMOSE_SETTINGS = 8  # Mimose settings whose samples are kept (the least recently used goes)
FIRST_SAMPLE_TRIES = 3  # first Mimose samples with a failed measurement dropped before learning
REACH_TRIES = 3  # failed collections beyond the fit's reach before such sizes are extrapolated


def mimose_setting(args: Sequence[Any], kwargs: Dict[str, Any], training: bool,
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


def with_weights(setting: Hashable, weights: Optional[str]) -> Hashable:
    """A ``mimose_setting`` pickled before it held the weights' dtype, with ``weights``."""
    if isinstance(setting, tuple) and len(setting) == 4:
        return (setting[0], weights, *setting[1:])
    return setting


def describe_setting(setting: Hashable) -> str:
    """``mimose_setting`` in words (warnings)."""
    floats, weights, grad, training, autocast = setting  # type: ignore[misc]
    tensors = ", ".join(f"{dtype} on {dev}" for dtype, dev in floats) or "no float tensors"
    if weights is not None:
        tensors += f", {weights} weights"
    casts = ", ".join(f"{dev} autocast to {str(dtype).replace('torch.', '')}"
                      for dev, on, dtype in autocast if on) or "no autocast"
    return (f"{tensors}, {'train' if training else 'eval'} mode, {casts}, input "
            f"{'with' if grad else 'without'} gradient")


def collected(step: ChainStep) -> Estimate:
    """What a step's collector measured (per block: saved bytes, output bytes, forward time,
    and the transients if it measured them; the chain's input bytes)."""
    c = step.collector
    tmp = c.tmp()
    return Estimate(accounting.tensors_bytes(step.frames[0].call.x), np.array(c.xbar, float),
                    np.array(c.out, float), np.array(c.fw, float),
                    tmp=None if tmp is None else {k: np.array(v, float) for k, v in tmp.items()})

class MimoseSteps:
    """The Mimose half of ``ChainRunner`` (a mixin: it reads the runner's blocks, budget, plan
    cache and names, and keeps its Mimose state in the runner's ``__dict__``, so pickles of
    runners load as they are)."""

    name: str
    list_name: str
    blocks: List[nn.Module]
    L: int
    cache: PlanCache[CompiledPlan]
    mimose: Optional[Mimose]
    _mimoses: Dict[Hashable, Mimose]
    _shapes: InputShapes
    _collecting_into: Optional[Mimose]
    _mimose_tails: Optional[bool]
    _mimose_tmp: Optional[bool]
    _first_failures: int
    collections: int
    tail: Any
    _budget: Optional[int]
    _said_profiling: bool
    # the last collection step's input in words, for _observe_sample's warning (None: not yet)
    _collecting_input: Optional[str] = None
    input_size: Callable[[Sequence[Any]], float]
    # and the runner's methods: _compile, _in_share, _for_input, _key, _sharded, _under_fsdp,
    # _say_profiling_peak, _block0_tensors
    _compile: Callable[[Plan], CompiledPlan]
    _in_share: Callable[[InfeasibleError], InfeasibleError]
    _for_input: Callable[[InfeasibleError, Any, Any], InfeasibleError]
    _key: Callable[[Sequence[Any], Dict[str, Any]], Any]
    _sharded: Callable[[], bool]
    _under_fsdp: Callable[[], bool]
    _say_profiling_peak: Callable[..., None]
    _block0_tensors: Callable[[Hashable], str]

    def _init_mimose(self, mimose: Optional[Mimose], on: bool, samples: int,
                     cache_size: int) -> None:
        """The Mimose state of a runner (``on``: planner="mimose"; ``mimose``: the one given
        as mimose=, checked here)."""
        if mimose is not None and (not isinstance(mimose, Mimose) or mimose.n != self.L):
            got = f"one for {mimose.n} blocks" if isinstance(mimose, Mimose) else repr(mimose)
            raise ValueError(f"{self.name}: mimose= must be a scheduler.planners.mimose.Mimose "
                             f"for {self.L} blocks, got {got}")
        # the Mimose of the setting (``mimose_setting``) the last step ran under, and each
        # setting's (``_mimose_for``); the first setting's is the one given as mimose=
        self.mimose = (mimose or Mimose(self.L, samples=samples, cache_size=cache_size)) \
            if on else None
        self.__dict__.update(self._fresh_mimose_state())

    def _fresh_mimose_state(self) -> Dict[str, Any]:
        """The rest of the Mimose state as a new runner starts it: the one list of its
        defaults (also for a runner pickled before a field existed)."""
        return {"_mimoses": {},
                "_shapes": InputShapes(f"{self.name}: Mimose on '{self.list_name}'"),
                "_collecting_into": None,  # the collection step's Mimose
                "collections": 0,          # samples learnt
                "_mimose_tails": None,     # whether Mimose's samples carry the tail
                "_mimose_tmp": None,       # ... and the blocks' transients
                "_first_failures": 0}      # first samples dropped: a measurement failed

    def _mimose_unpickled(self) -> None:
        """After ``__setstate__``: the state a runner pickled before it existed gets its
        default. Mimose settings pickled before they held the weights' dtype (4 entries) get
        it at the next plan (``_upgrade_settings``): not here, where a deepcopy may not have
        filled in the blocks yet."""
        for name, value in self._fresh_mimose_state().items():
            self.__dict__.setdefault(name, value)
        self._old_settings = any(len(k) == 4 for k in self._mimoses if isinstance(k, tuple))

    def _end_collection(self, step: ChainStep, out: Any) -> None:
        """A collection step's forward is over: its sample is recorded now, or, where the
        model's tail is measured too, when the model's forward returns
        (``_sample_with_tail``; without the tail if that fails)."""
        est = collected(step)
        sample = (step.input_size, est.input_bytes, tuple(est.xbar), tuple(est.out),
                  tuple(est.fw), step.collector.tmp(), step.collector.failed is not None)
        if self.tail is not None and not self._under_fsdp():
            # (the tail adds the tied gradients it finds). Not under FSDP, as for rotor's
            # forward-only measurement there: the tail's replayed backward would run FSDP's
            # root hooks (FSDP1 reshards the root before the real backward)
            chain = with_outside(chain_from_estimate(est, "mimose-sample"), step.outside)
            if self.tail.begin(self, (MIMOSE_SAMPLE, sample, self._collecting_into),
                               chain, None, tensor_leaves(out), step):
                return
        self._observe_sample(sample, None, None, self._collecting_into)

    def _sample_with_tail(self, key: Tuple[Any, ...], chain: Chain) -> None:
        """Record a collection step's sample (``key``: ``(MIMOSE_SAMPLE, sample, into)``) with
        the tail and the memory outside the chain ``chain`` carries in its meta, if
        measured."""
        tail, out = chain.meta.get("tail"), chain.meta.get("outside")
        measured = isinstance(tail, dict) and all(k in tail for k in TAIL_FIELDS)
        self._observe_sample(key[1], [tail[k] for k in TAIL_FIELDS] if measured else None,
                             [out[k] for k in OUTSIDE_FIELDS]
                             if measured and isinstance(out, dict) else None,
                             key[2] if len(key) > 2 else None,
                             tail_failed=isinstance(tail, dict) and "failed" in tail)

    def _upgrade_settings(self) -> None:
        """Old 4-entry Mimose settings with the weights' dtype now (as when they were saved,
        unless the model was cast since)."""
        self._old_settings = False
        weights = weights_dtype(self.blocks)
        self._mimoses = {with_weights(k, weights): m for k, m in self._mimoses.items()}
        for m in [self.mimose, *self._mimoses.values()]:
            if m is not None and getattr(m, "setting", None) is not None:
                m.setting = with_weights(m.setting, weights)

    def _mimose_for(self, setting: Hashable) -> Mimose:
        """The Mimose that learns and plans the steps run under ``setting``
        (``mimose_setting``), made current (``self.mimose``). Samples learnt under one
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
                was = f"its samples so far were learnt with {describe_setting(bound)}"
            else:  # a shared mimose= another runner bound to its own setting
                was = (f"the Mimose given as mimose= learnt its samples with "
                       f"{describe_setting(bound)}, in another runner")
            m = m.fresh()
            m.setting = setting
            user_warning.warn(
                f"{self.name}: Mimose: block 0 of '{self.list_name}' is called with "
                f"{describe_setting(setting)}, where {was}; the bytes a step holds per input "
                "size depend on that (dtypes, autocast, dropout masks), so those samples do "
                f"not plan these steps: Mimose collects {m.estimator.samples} input sizes for "
                "this setting (steps that checkpoint every block and run each block's forward "
                f"twice), keeping the samples of up to {MIMOSE_SETTINGS} settings for when "
                "theirs comes back")
        self._mimoses[setting] = m
        if len(self._mimoses) > MIMOSE_SETTINGS:
            old = next(iter(self._mimoses))
            gone = self._mimoses.pop(old)
            user_warning.warn(
                f"{self.name}: Mimose: more than {MIMOSE_SETTINGS} settings of dtypes, "
                f"autocast and train mode met on '{self.list_name}'; the samples learnt with "
                f"{describe_setting(old)} ({len(gone.estimator.sizes)} input sizes) are "
                "dropped, and collected again if that setting comes back")
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
        m = self._mimose_for(mimose_setting(args, kwargs, self.blocks[0].training,
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
            if not self._said_profiling:  # the input in words, for _observe_sample's warning
                self._collecting_input = f"input size {size:g} (" + (
                    self._block0_tensors(self._key(args, kwargs)) or "block 0's input") + ")"
            # the blocks' transients too (their backward once more), but not under FSDP,
            # whose backward hooks must fire once per step
            return cplan, ShuttlingCollector(self.L, transients=not self._sharded())
        if self._budget is None:
            return self._compile(checkpoint_plan(self.L, [], planner="none")), None
        try:
            plan = m.plan(size, self._budget)
        except InfeasibleError as e:
            raise self._in_share(self._for_input(e, None, self._key(args, kwargs))) from e
        return self._compile(plan), None

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
                    user_warning.warn(
                        f"{self.name}: measuring {' and '.join(failed)} failed on a Mimose "
                        "collection step before any sample was learnt; its sample is dropped "
                        "(the size is collected again) rather than learning without them for "
                        "the whole run")
                    return
                user_warning.warn(
                    f"{self.name}: measuring {' and '.join(failed)} failed on the first "
                    f"{FIRST_SAMPLE_TRIES} Mimose collection steps; Mimose learns without "
                    "them from now on (their memory is not in its plans)")
            self._mimose_tails, self._mimose_tmp = tail is not None, tmp is not None
        missing = [what for what, carried, got in (
            ("the model's tail", self._mimose_tails, tail),
            ("the blocks' transients", self._mimose_tmp, tmp)) if carried and got is None]
        if missing:
            target = into or self.mimose
            if target is not None and target.ready:  # a size beyond the fit's reach
                failed = target.reach_failures = getattr(target, "reach_failures", 0) + 1
                if failed == REACH_TRIES:
                    user_warning.warn(
                        f"{self.name}: {' and '.join(missing)} not measured on {failed} Mimose "
                        "collection steps of sizes beyond 1.5x the largest learnt; such sizes "
                        "are planned from the fit (extrapolated) from now on")
                    return
            user_warning.warn(f"{self.name}: {' and '.join(missing)} not measured on this Mimose "
                              "collection step; its sample is dropped (the size is collected "
                              "again)")
            return
        if not self._mimose_tails:
            tail = outside = None
        if not self._mimose_tmp:
            tmp = None
        target = into or self.mimose
        target.observe(size, input_bytes, xbar, out, fw, tail, outside, tmp)
        self.collections += 1
        if target is self.mimose:  # (a sample of another setting: not this budget's)
            est = target.estimator.measured(size)
            if est is not None:
                self._say_profiling_peak(target.checked_chain(est), collected=(
                    self._collecting_input or f"input size {size:g}"))
