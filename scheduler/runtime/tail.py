"""The model's tail as the chain's loss stage ``L`` (so plans count its memory), measured on a
profiling step (and on each of Mimose's collection steps, whose estimator learns it:
``chain_runner``).

Under ``scheduler.checkpoint`` the blocks run inside the model's own forward; what runs after
the last block returns (a final norm, the LM head, the loss: logits and the log-softmax that
cross-entropy saves) and its backward, down to the gradient of the last block's output, is
the chain's stage ``L``. ``measure_chain``'s stand-in loss ("sum") says it costs nothing, so
plans would peak where, in reality, the tail's memory is live too.

``TailProbe`` (one per checkpointed model) measures it on the real step, in the caller's
thread, between two points of one call of the model (both balanced, so no hook or mode
outlives the call; ``nn.Module`` forward pre-hook and an ``always_call`` forward hook):

- when the last block of a profiling step returns (``begin``): saved-tensor pack hooks (what
  autograd saves in the tail) and, on the CPU, the op tracer ``op_tracer.OpTracer`` (which
  storages the tail creates, and their eager-free peak) are pushed; on CUDA the allocator's
  ``memory_allocated`` is read and its peak statistics reset;
- when the model's forward returns (``finish``): they are popped (only if on top of their
  stacks: a context the model opened and left open would otherwise lose its entry; then they
  turn inert and are popped at the next chance, with a warning). ``xbar[L]`` = what the tail
  saved and returned that it created (CPU: storages the tracer saw born, parameters and the
  last block's output aside; CUDA: ``memory_allocated`` now minus at ``begin``, the truth),
  ``fw_tmp[L]`` = the forward's peak above that (tracer / ``max_memory_allocated``), ``fw[L]``
  its time. Then the tail's backward is replayed once (``torch.autograd.grad`` from the
  model's loss, or from its outputs, to those of the last block's outputs the tail reads
  itself (``read_by_tail``), ``retain_graph=True``:
  nothing accumulates, the user's backward later runs on the same graph): ``bw[L]`` its time,
  ``bw_tmp[L]`` its peak less the gradients it makes (counted from when they are made), plus
  the largest of the tail's weight gradients (transient) or, for weights tied to the head's,
  all of theirs in every backward op (``outside``). ``x[L]`` and ``delta[L]`` are the
  measured chain's (the last block's output and its gradient).

Not measured (the chain keeps ``measure_chain``'s loss stage, with a one-time warning): blocks
called outside the model's forward, saved-tensor hooks or dispatch modes already active at the
model's call, a model whose output does not depend on the last block's output with a gradient,
module backward hooks in the model (the replay would call them), a forward that raised. A loss
computed *after* the model returns (no ``labels=``) is outside the tail measured here.

The stacks' side (what is pushed, popped, left stale) is ``hook_stack``'s; the questions about
the tail's autograd graph before the replay are ``tail_graph``'s; what the tail returns and
the caller drops or holds through the backward (the logits) is ``tail_outputs``'.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from vmalloc import user_warning
from ..chain import Chain, add_outside
from ..profile.autograd_graph import differentiable
from ..profile.measure import sync
from ..profile.op_tracer import OpTracer, _mark_nodes
from ..profile.storage import dense_bytes, storage_bytes, storage_key
from ..units import format_bytes
from .block_calls import tensor_leaves
from .hook_stack import (Hooks, TailTracer, Within, let_go, module_call_frame, pop_hooks,
                         pop_tracer, retire, stacks_clean, sweep)
from .not_compiled import not_compiled
from .outside import Outside, head_census
from .tail_graph import has_backward_hooks, read_by_tail, tail_graph
from .tail_outputs import created_outputs, planned
from .weak import WeakFields

# profiling steps of one shape whose tail measurement failed before the shape is planned on
# the stand-in loss stage (``ChainRunner._measure_again``): a failure is that step's (a bad
# batch, a Ctrl-C), not the shape's
TAIL_TRIES = 3
# what Dynamo's fullgraph=True error quotes at the probe's hooks on the model's forward
HOOKS_EAGER = ("scheduler's hooks on the model's forward (the checkpointed model's tail probe) "
               "run eagerly", "the blocks before scheduler.checkpoint")


class _Recording:
    """One tail being measured: the runner's pending chain and what was pushed for it."""

    def __init__(self, runner: Any, key: Hashable, chain: Chain, agree_on: Hashable,
                 device: torch.device, lasts: Sequence[torch.Tensor], depth: int, step: Any):
        self.runner = runner
        self.key = key
        self.chain = chain
        self.agree_on = agree_on
        self.device = device
        self.lasts = list(lasts)
        self.depth = depth
        self.step = step  # the profiling ChainStep: the replay must not enter its blocks
        self.thread = threading.get_ident()
        self.hooks = Hooks()
        self.tracer: Optional[TailTracer] = None
        self.m0 = 0
        self.t0 = 0.0
        self.pushed = False
        self.outside: Optional[Outside] = getattr(step, "outside", None)


class TailProbe(WeakFields):
    """Measures the tail of ``model`` around the runners of its block lists (module doc); a
    copied or pickled model's probe measures the copy (``WeakFields``)."""

    WEAK = ("_model",)

    def __init__(self, model: nn.Module, name: str,
                 runners: Optional[Callable[[nn.Module], Sequence[Any]]] = None,
                 measures: bool = True):
        # weakly: the model holds this probe (its hooks), and a cycle would keep a model the
        # user deleted, weights and all, until the garbage collector runs
        self._model = weakref.ref(model)
        self.name = name
        self.runners = runners  # the model's runners, looked up (no reference to them), or None
        # False (loss= given: the chain's loss stage is that stand-in): it only numbers the
        # model's forwards and says when they never called the blocks; nothing is measured
        self.measures = measures
        self.depth = 0
        self.clean: List[bool] = []   # per nested call of the model: stacks clean at entry
        self.handling: List[Optional[BaseException]] = []  # ... and the exception in handling
        self.rec: Optional[_Recording] = None
        self.given: Set[int] = set()  # storages of the outermost call's tensor arguments
        self.calls = 0  # outermost calls of the model so far: which forward a block runs in
        # the outermost call while it runs (known by its frame's place on its thread's stack):
        # an interrupt ends the call without the forward hook (``_enter`` and the recording's
        # entries tell by it)
        self._call: Optional[Within] = None
        # the entries ``begin`` pushed, until popped or queued: a Ctrl-C in the tail leaves
        # them pushed, and if the model is never called again they go with this probe
        self._live: List[Any] = []
        self._let_go_with_me()
        self._warned: Set[Hashable] = set()  # this probe's warnings given (``warn_once``)
        # positions in the model's output of what the tail made and the caller had dropped
        # when the last profiling step's backward began (``tail_outputs``); None: not seen yet
        self.dropped: Optional[Set[int]] = None
        # a later step's outputs to watch once the model's forward returns them, per runner
        # (``watch_outputs``): what its plan counts of them, and where they go
        self._watch_next: List[Tuple[Any, List[Any]]] = []
        self.handles = [model.register_forward_pre_hook(self._enter, with_kwargs=True),
                        model.register_forward_hook(self._exit, always_call=True)]

    def warn_once(self, reason: Hashable, message: str) -> None:
        """Say ``message`` once per ``reason`` for this probe's model (another model's
        measurement failing the same way is said too)."""
        if reason not in self._warned:
            self._warned.add(reason)
            user_warning.warn(message)

    @property
    def model(self) -> nn.Module:
        model = self._model()
        assert model is not None, "the hooks of a freed model do not run"
        return model

    def remove(self) -> None:
        """Undo: drop a recording in progress (nothing is planned for it), unhook, and pop
        what is left stale on top of the stacks (an interrupted tail's entries)."""
        self._abort(None, plan=False)
        for h in self.handles:
            h.remove()
        self.handles = []
        let_go(self._live)

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.update(_live=[], rec=None, _call=None, depth=0, clean=[], handling=[],
                     _watch_next=[])
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._let_go_with_me()  # (the copy's own)

    def _let_go_with_me(self) -> None:
        """``hook_stack.let_go`` this probe's live entries when it is freed (with its model);
        nothing at the process's exit."""
        weakref.finalize(self, let_go, self._live).atexit = False

    # ------------------------------------------------------------------------ model hooks
    # (never traced by torch.compile: they read the autograd and dispatch stacks and push hooks)
    @not_compiled(*HOOKS_EAGER)
    def _enter(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        here = module_call_frame()
        if self.depth > 0 and self._call is not None and self._call.over(entering=here):
            # the last call ended without its forward hook (a KeyboardInterrupt: PyTorch
            # runs ``always_call`` hooks on Exception only): not a call inside it
            self._abort("was interrupted")
            self._abandon_steps()
            self.depth, self.clean, self.handling = 0, [], []
        if self.rec is not None:
            # a call that ended without its forward hook (an interrupt: ``always_call`` hooks
            # run on Exception only), or the model called again inside its own tail
            self._abort("was interrupted or called itself")
            self.depth, self.clean, self.handling = 0, [], []
        if self.depth == 0:
            self.calls += 1
            self.clean, self.handling = [], []
            self._watch_next = []   # (a call that ended without its forward hook)
            self._call = Within(here)
            # the caller's tensors existed before the step: never counted as its memory
            self.given = {storage_key(t) for t in tensor_leaves((args, kwargs))}
        sweep()
        self.depth += 1
        self.clean.append(stacks_clean())
        # the exception being handled around this call, if any (a retry inside ``except``):
        # only a new one at the forward hook means the forward raised
        self.handling.append(sys.exc_info()[1])

    @not_compiled(*HOOKS_EAGER)
    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            self._call = None
            self._check_blocks_called(output)
        if self.clean:
            self.clean.pop()
        before = self.handling.pop() if self.handling else None
        if self.depth == 0 and sys.exc_info()[1] not in (None, before):
            self._abandon_steps()  # it raised between blocks: no backward will come
            self._watch_next = []
        elif self.depth == 0 and self._watch_next and output is not None:
            pending, self._watch_next = self._watch_next, []
            for watch, box in pending:
                try:
                    watch.see(output, box)
                except Exception as e:  # noqa: BLE001 - watching must not break training
                    self.warn_once(("watch", type(e)), f"{self.name}: watching the model's "
                                   f"outputs failed ({e!r}); the plans stand as they are")
        rec = self.rec
        if rec is None or rec.depth != self.depth + 1 or rec.thread != threading.get_ident():
            return
        if sys.exc_info()[1] not in (None, before) or output is None:
            self._abort("raised")
            return
        self._finish(output)

    def _abandon_steps(self) -> None:
        """The model's forward raised: the steps its runners began let go of what they hold
        (checkpoints) now, not when the next forward begins (a retry with a smaller batch
        would find that memory taken)."""
        for runner in (self.runners(self.model) if self.runners is not None else ()):
            runner.abandon_step()

    def _check_blocks_called(self, output: Any) -> None:
        """A training forward of the model that never called the blocks of any of its lists,
        ever (not the list its forward walks; a list of lists, which it loops through): nothing
        is checkpointed and the budget does not hold, which must not go unsaid. (One list
        unused while another runs may be on purpose: T5 trained from encoder outputs.)"""
        runners = list(self.runners(self.model)) if self.runners is not None else []
        if not runners or runners[0].said_uncalled or any(r.calls for r in runners):
            return
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensor_leaves(output)):
            runners[0].said_uncalled = True
            names = ", ".join(f"'{r.list_name}'" for r in runners)
            user_warning.warn(
                f"{self.name}: {type(self.model).__name__}'s forward ran with gradients but "
                f"never called the blocks of {names}: nothing is checkpointed and the budget "
                "does not hold; name the list its forward loops over with blocks=")

    # ------------------------------------------------------------------------ the runner's side
    def outside(self, args: Sequence[Any], kwargs: Dict[str, Any],
                runner_bytes: int = 0) -> Optional["Outside"]:
        """At block 0's call of a profiling step: what the step holds outside the chain
        while the blocks run (``Outside``; ``runner_bytes``: what the runner itself keeps),
        or None outside the model's forward or with saved-tensor hooks or a dispatch mode
        around it (reading what the head saved would run their unpack hooks)."""
        if not self.measures or self.depth == 0 or \
                not (self.clean and self.clean[-1] and stacks_clean()):
            return None
        state = {storage_key(t) for t in
                 list(self.model.parameters()) + list(self.model.buffers())}
        out = head_census(args, kwargs, state | self.given)
        out.bytes += runner_bytes
        return out

    def watch_outputs(self, runner: Any, watch: Any, last_outs: Any, step: Any) -> None:
        """A later step of a shape whose profiling step watched the model's outputs: watch
        this step's too (``tail_outputs.ShapeWatch``): the backward's arrival at the last
        block's outputs ``last_outs`` hooked now, while they live; the outputs when the
        model's forward returns them."""
        if self.depth == 0:
            return   # (the blocks ran outside the model's forward: nothing returns them)
        try:
            lasts = _last_outputs(step, tensor_leaves(last_outs))
            if lasts:
                self._watch_next.append((watch, watch.start(lasts, runner)))
        except Exception as e:  # noqa: BLE001 - watching must not break training
            self.warn_once(("watch", type(e)), f"{self.name}: watching the model's outputs "
                           f"failed ({e!r}); the plans stand as they are")

    def forward_number(self) -> Optional[int]:
        """Which outermost call of the model is running (``calls``), or None outside one: two
        block calls with the same number ran in one forward of the model."""
        return self.calls if self.depth > 0 else None

    def block_zero(self) -> None:
        """A runner's block 0 is called: a tail being measured is over (T5: the encoder's
        'tail' is the decoder, planned in its own chain), its runner plans without it."""
        if self.rec is not None:
            self._abort(None)

    def begin(self, runner: Any, key: Hashable, chain: Chain, agree_on: Hashable,
              last_outs: Sequence[torch.Tensor], step: Any) -> bool:
        """Start measuring the tail after the last block of a profiling ``step`` returned;
        False if it cannot be (the runner then plans at once on ``chain``, as before). The
        replay's gradients are taken at the last block's own outputs (what it passed through
        unchanged, T5's position bias, comes from further down the chain)."""
        if not self.measures:
            return False
        if self.rec is not None:
            self._abort(None)
        if self.depth == 0:
            self.warn_once("outside", f"{self.name}: the blocks ran outside "
                           f"{type(self.model).__name__}'s forward; the chain's loss stage is "
                           "measure_chain's stand-in, not the model's tail")
            return False
        if not (self.clean[-1] and stacks_clean()):
            self.warn_once("hooks", f"{self.name}: saved-tensor hooks or a dispatch mode are "
                           "active around the model's forward; its tail (stage L) is not "
                           "measured, the chain keeps measure_chain's stand-in loss stage")
            return False
        lasts = _last_outputs(step, last_outs)
        if not lasts:
            self.warn_once("nograd", f"{self.name}: the last block's output needs no gradient; "
                           "the model's tail (stage L) is not measured")
            return False
        # the tail's own device (where its memory is read and its time synchronised), not
        # block 0's: blocks spread over GPUs (a device_map) end on another one
        dev = lasts[0].device
        rec = _Recording(runner, key, chain, agree_on, dev, lasts, self.depth, step)
        if dev.type == "cuda":
            sync(dev)
            rec.m0 = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        else:
            rec.tracer = TailTracer(self._call)
        rec.hooks.within = self._call
        if self._call is not None:  # made inert by it if the call ends without saying so
            self._call.entries = [e for e in (rec.tracer, rec.hooks) if e is not None]
        self._live[:] = [e for e in (rec.tracer, rec.hooks) if e is not None]
        torch._C._autograd._push_saved_tensors_default_hooks(rec.hooks.pack, rec.hooks.unpack)
        if rec.tracer is not None:
            rec.tracer.__enter__()
        rec.pushed = True
        self.rec = rec
        rec.t0 = time.perf_counter()
        return True

    # ------------------------------------------------------------------------ ending
    def _release(self, rec: _Recording) -> None:
        """Pop what ``begin`` pushed (tracer first: pushed last), or leave it inert and queued
        (``hook_stack.retire``; already so if its call ended without saying so)."""
        rec.hooks.recording = False
        rec.hooks.within = None
        if rec.tracer is not None:
            rec.tracer.active, rec.tracer.within = False, None
        if not rec.pushed:
            return
        rec.pushed = False
        self._live.clear()  # (popped now, or queued: ``sweep``'s)
        stale = False
        for entry, pop in ((rec.tracer, pop_tracer), (rec.hooks, pop_hooks)):
            if entry is None or entry.queued:
                continue
            if pop(entry):
                entry.queued = True  # (popped: never queued again)
            else:
                retire(entry)
                stale = True
        if stale:
            self.warn_once("stale", f"{self.name}: a saved-tensor hook or dispatch mode opened "
                           "during the model's forward was still open when it returned; the tail "
                           "measurement's own entries are inert and popped when they can be")

    def _abort(self, reason: Optional[str], plan: bool = True) -> None:
        """End a recording without a tail: its runner plans on the chain as measured."""
        rec, self.rec = self.rec, None
        if rec is None:
            return
        self._release(rec)
        rec.hooks.saved.clear()
        rec.tracer, rec.lasts, rec.step = None, [], None
        chain = rec.chain
        if reason is not None:
            self.warn_once(reason, f"{self.name}: the model's forward {reason} after its last "
                           "block; the tail (stage L) was not measured on this step: its shape "
                           f"is measured again at its next step (up to {TAIL_TRIES} tries)")
            # (a failure, not a tail that cannot be measured: Mimose does not learn from it)
            chain = chain.replace(meta={**chain.meta, "tail": {"failed": reason}})
        if plan:
            rec.runner._plan_measured(rec.key, chain, rec.agree_on, rec.device)

    def _finish(self, output: Any) -> None:
        rec, self.rec = self.rec, None
        sync(rec.device)
        fw = time.perf_counter() - rec.t0
        cuda = rec.device.type == "cuda"
        if cuda:
            held = torch.cuda.memory_allocated(rec.device) - rec.m0
            peak = torch.cuda.max_memory_allocated(rec.device) - rec.m0
        self._release(rec)
        chain = rec.chain
        try:
            chain = self._tail_chain(rec, output, fw, held if cuda else 0,
                                     peak if cuda else 0)
        except Exception as e:  # measuring must not break training: say so, plan as before
            self.warn_once(("failed", type(e)), f"{self.name}: measuring the model's tail "
                           f"failed ({e!r}); its shape is measured again at its next step (up "
                           f"to {TAIL_TRIES} tries)")
            chain = chain.replace(meta={**chain.meta, "tail": {"failed": repr(e)}})
        finally:
            rec.tracer, lasts, rec.lasts, rec.step = None, rec.lasts, [], None
            rec.hooks.saved.clear()
        rec.runner._plan_measured(rec.key, chain, rec.agree_on, rec.device)
        self._say_caller_loss(output, lasts, rec.runner.budget)   # (a filter may raise it)

    def _tail_chain(self, rec: _Recording, output: Any, fw: float, held: int,
                    peak: int) -> Chain:
        """``rec.chain`` with its stage L replaced by the tail's numbers (or as it is, with a
        warning, if the model's output does not reach the last block's output)."""
        chain, L = rec.chain, rec.chain.L
        cuda = rec.device.type == "cuda"
        outs = list(tensor_leaves(output))
        if cuda:  # the allocator's view: all the tail allocated and still holds, its peak
            xbar, fw_tmp = max(held, 0), max(peak - held, 0)
        else:
            state = {storage_key(t) for t in
                     list(self.model.parameters()) + list(self.model.buffers())}
            xbar, fw_tmp = _cpu_forward(rec, outs, state | {storage_key(t) for t in rec.lasts})
        # what the tail saved, bar what outlives its backward (weights, the last block's
        # output, what the model returned): the real backward frees it node by node
        weights = {storage_key(t) for t in list(self.model.parameters()) +
                   list(self.model.buffers()) + rec.lasts}
        kept = weights | {storage_key(t) for t in outs}
        saved = {storage_key(t) for t in rec.hooks.saved} - kept
        # the outputs the tail made that its backward does not read: maybe dropped before it
        mode = rec.runner.outputs_mode(rec.key)
        returned = created_outputs(outs, rec.lasts, weights | {
            storage_key(t) for t in rec.hooks.saved}) if mode is not None else []
        rec.tracer = None  # the trace's tensors go before the replay
        rec.hooks.saved.clear()
        bw = _replay(self.model, outs, rec, self.warn_once, saved)
        if bw is None:
            self.warn_once("unreached", f"{self.name}: the model's output does not depend on its "
                           "last block's output through a gradient; the tail (stage L) is not "
                           "measured, the plan uses measure_chain's stand-in loss stage")
            return chain
        bw_time, bw_tmp, tied = bw
        tail = {"fw": fw, "bw": bw_time, "xbar": int(xbar), "fw_tmp": int(fw_tmp),
                "bw_tmp": int(bw_tmp), "fck_tmp": int(fw_tmp)}  # the loss runs as F_all
        cols = {}
        for k, v in tail.items():
            col = list(getattr(chain, k)) or [0] * (L + 1)  # a chain without tmp columns
            col[L] = v
            cols[k] = col
        meta = dict(chain.meta)
        meta["tail"] = dict(tail, measured="cuda allocator statistics" if cuda else
                            "op-tracer estimate", replaced_loss=meta.get("loss"))
        # the chain's other stages carry what the step holds outside the chain
        # (``outside.add_outside``, in ``meta``): stage L too, and the gradients of tail
        # weights tied to the head's from B L on
        fwd = meta.get("outside", {}).get("forward", 0)
        for k in ("fw_tmp", "fck_tmp", "bw_tmp"):
            cols[k][L] += fwd
        chain = chain.replace(meta=meta, **cols)  # other fields as measured
        chain = add_outside(chain, 0, tied) if tied else chain
        return planned(self, rec.runner, rec.key, rec.lasts, chain, returned, mode) \
            if returned else chain

    def _say_caller_loss(self, output: Any, lasts: Sequence[torch.Tensor],
                         budget: Optional[int]) -> None:
        """A training forward that returned no loss (no ``labels=``): the caller computes it
        from the outputs, saving what no measurement sees (cross-entropy's log-softmax of the
        logits: GPT-2 on the CPU at its least budget peaked at 1.31x it). Said once, where the
        largest output the tail made that needs a gradient (the logits, not the blocks'
        hidden states) is 1% of ``budget`` or more (a classifier's few logits are not)."""
        model = self.model
        outs = list(tensor_leaves(output))
        if not model.training or any(t.numel() == 1 and t.grad_fn is not None for t in outs):
            return
        # (the last block's outputs are the chain's; the largest of the rest is most often the
        # logits: a classifier's hidden states, with output_hidden_states, can be larger)
        chain = {storage_key(t) for t in lasts}
        made = [storage_bytes([t]) for t in outs if t.requires_grad and
                storage_key(t) not in chain]
        largest = max(made, default=0)
        if not largest or (isinstance(budget, int) and 100 * largest < budget):
            return
        try:
            takes = "labels" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):   # (a forward without a signature to read)
            takes = False
        self.warn_once("caller_loss", (
            f"{self.name}: {type(model).__name__}'s forward returned no loss, only outputs (the "
            f"largest that needs a gradient: {format_bytes(largest)}): the loss your code "
            "computes from them saves memory no plan counts (cross-entropy keeps a "
            "log-softmax the size of the logits: GPT-2 at its least budget peaked at 1.31x "
            "it), so the budget may not hold. " +
            ("Pass labels= so the model computes its loss, or leave that room in the budget"
             if takes else "Leave that room in the budget")))


def _last_outputs(step: Any, last_outs: Any) -> List[torch.Tensor]:
    """The last block's outputs the tail's backward reaches them through: those that want a
    gradient, less what the blocks passed through unchanged (T5's position bias comes from
    further down the chain)."""
    passed = step.offloader.passed_through()
    return [t for t in last_outs if isinstance(t, torch.Tensor) and t.requires_grad and
            storage_key(t) not in passed]


def _born(tracer: OpTracer) -> Set[int]:
    """Storages the traced ops created (first seen as an op's output, not as an input)."""
    known: Set[int] = set()
    born: Set[int] = set()
    for reads, writes in tracer.ops:
        known.update(reads)
        for k in writes:
            if k not in known:
                known.add(k)
                born.add(k)
    return born


def _cpu_forward(rec: _Recording, outs: Sequence[torch.Tensor], skip: Set[int]
                 ) -> Tuple[int, int]:
    """``xbar[L]``, ``fw_tmp[L]`` from the tracer: what the tail created and keeps (saved for
    backward, or returned), and its eager-free peak above that."""
    tr = rec.tracer
    born = _born(tr) - skip
    kept = [t for t in list(rec.hooks.saved) + list(outs) if storage_key(t) in born]
    xbar = storage_bytes(kept)
    peak = tr.peak_live(skip=skip, keep={storage_key(t) for t in kept})
    return xbar, max(peak - xbar, 0)


def _replay(model: nn.Module, outs: Sequence[torch.Tensor], rec: _Recording,
            warn: Callable[[Hashable, str], None], saved: Set[int] = frozenset()
            ) -> Optional[Tuple[float, int, int]]:
    """Time and transient peak of the tail's backward, replayed from the model's loss (a
    one-element output with a gradient; else every output with a gradient, seeded with ones)
    to the last block's output, and the bytes of the gradients of the tail's weights tied to
    a weight the head uses (held until the head's backward). ``None`` if no output reaches
    the last block's output. ``saved``: storages the tail saved that its real backward frees
    once the node that reads them has run (the replay keeps the graph: on the CPU, the
    estimate credits them as ``measure_chain`` does; on CUDA the allocator cannot). ``warn``:
    the probe's ``warn_once``."""
    roots = [t for t in outs if t.requires_grad and differentiable(t)]
    losses = [t for t in roots if t.numel() == 1]
    roots = losses or roots
    lasts = read_by_tail(roots, rec.lasts)
    if not roots or not lasts:
        return None
    params, custom = tail_graph(roots, lasts)
    if custom or has_backward_hooks(model):
        warn("bwhooks", "scheduler.checkpoint: the model's tail has module backward hooks or "
             "custom autograd Functions, which a replay of its backward would run a second "
             "time; the tail's backward is not measured (bw[L], bw_tmp[L] stay "
             "measure_chain's)")
        c, L = rec.chain, rec.chain.L
        outside = c.meta.get("outside", {}).get("forward", 0)  # added back by the caller
        return (c.bw[L], c.bw_tmp[L] - outside if c.bw_tmp else 0, 0)
    seeds = [torch.ones_like(t) for t in roots]
    dev = rec.device
    tracer = None
    if dev.type == "cuda":
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        m0 = torch.cuda.memory_allocated(dev)
    else:
        tracer = OpTracer()
        marks = _mark_nodes(roots, tracer, [t.grad_fn for t in lasts])
    t0 = time.perf_counter()
    rec.step.replaying = True
    try:
        with tracer if tracer is not None else contextlib.nullcontext():
            grads = torch.autograd.grad(roots, lasts, seeds, retain_graph=True,
                                        allow_unused=True)
    finally:
        rec.step.replaying = False
        if tracer is not None:
            for h in marks:  # the graph is the model's: the user's backward runs it next
                h.remove()
    sync(dev)
    bw = time.perf_counter() - t0
    made = [g for g in grads if g is not None]
    if not made:
        return None
    # bw_tmp[L]: the peak less delta[L] (which the simulator counts for the whole op), the
    # gradients counted from when they are made, as ``measure_chain`` does
    if tracer is not None:
        made_keys = {storage_key(g) for g in made}
        bw_tmp = max(tracer.peak_live(skip=set(), keep=made_keys, by_node=True,
                                      release=saved - made_keys) - storage_bytes(made), 0)
    else:
        bw_tmp = max(torch.cuda.max_memory_allocated(dev) - m0 - storage_bytes(made), 0)
    # the replay asks for the last block's outputs only, so autograd skips the tail's weight
    # gradients (the LM head's: vocab x hidden); in training each is made and added into
    # .grad: count the largest as transient, as measure_chain does for a block (its time,
    # one matmul, is left out of bw[L]). A weight the head uses too (an LM head tied to the
    # input embedding) is different: autograd holds its tail gradient until the head's
    # gradient joins it, after B 0, so it stays for the whole backward of the chain
    # (tied: the same autograd leaf, ``Outside.ties``; sized as the gradient autograd makes,
    # dense, not as the weight's storage: a view of a flat buffer holding every weight
    # (ZeRO-1/2, Megatron's contiguous buffers) would count the whole buffer)
    head = rec.outside
    tied = [p for p in params if head is not None and head.ties(p)]
    untied = [p for p in params if head is None or not head.ties(p)]
    return (bw, bw_tmp + max((dense_bytes(p) for p in untied), default=0),
            sum(dense_bytes(p) for p in tied))
