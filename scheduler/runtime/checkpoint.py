"""``scheduler.checkpoint``: budgeted optimal checkpointing of any model with a repeated block
list, in place, in one line (public contract, DESIGN.md "The chain runtime").

    model = scheduler.checkpoint(model, budget="6GiB", planner="rotor")

Finds the block list (``blocks=`` names it; else the ``nn.ModuleList`` whose entries are
Hugging Face ``GradientCheckpointingLayer``s, the list HF's own gradient checkpointing walks,
else the outermost ``ModuleList`` of same-class modules) and replaces each block's
``forward`` (an instance attribute: parameter names, ``state_dict`` and module hooks stay as
they were) by a call through one ``ChainRunner`` per list. The model's own loop keeps calling
the blocks with whatever arguments it uses; see ``chain_exec`` for how a step runs.

Calling it again first undoes every previous call whose blocks are inside the model, whatever
module it was made on (the model itself, a model inside a wrapper such as peft's ``PeftModel``
or DDP, a parent of it), so a block's forward is never wrapped twice; ``undo(model)`` restores
the original forwards the same way. A block whose installation is gone (the module it was made
on was dropped: a ``PeftModel`` after ``merge_and_unload()``) runs plainly, says so once at a
step that wants gradients, and is unwrapped by the next ``checkpoint`` or ``undo``.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from torch import nn

from vmalloc import user_warning
from . import fsdp
from .chain_runner import ChainRunner, needs_grad
from .not_compiled import not_compiled
from .options import PlannerArg, check_options_used, check_planner, parse_budget, parse_rate
from .hf_guards import (KVCacheGuard, check_not_hf_checkpointed, layerdrop, model_cache_off,
                        refuse_hf_checkpointing)
from .tail import TailProbe
from .weak import WeakFields, gone

NAME = "scheduler.checkpoint"
# what Dynamo's fullgraph=True error quotes at a block call (not_compiled's two parts)
BLOCK_CALLS_EAGER = (f"{NAME} runs each checkpointed block eagerly through its runner, at "
                     "each block call", "the blocks themselves before scheduler.checkpoint, "
                     "as the list's entries")
_ATTR = "_vmalloc_checkpoint"
BlocksArg = Union[None, str, nn.ModuleList, nn.Sequential, Sequence[Union[str, nn.Module]]]


class Checkpointed:
    """What ``checkpoint`` installed on a model: the block lists and their runners.
    ``budget``: the model's whole budget; a new one (bytes, a size string, ``None``) is shared
    among the lists as ``checkpoint`` shares it and plans again on the next forward. Nothing
    else is set from outside, nor anything on one that ``undo`` (or ``checkpoint`` called
    again) removed: a misspelt knob or a stale handle would otherwise be taken silently."""

    def __init__(self, lists: List[Tuple[str, nn.Module]], runners: List[ChainRunner],
                 tail: Optional[TailProbe] = None, hooks: Sequence[Any] = (),
                 total: Optional[int] = None):
        self.__dict__.update(
            lists=lists, runners=runners,
            tail=tail,  # numbers the model's forwards, measures its tail (the loss stage)
            hooks=list(hooks),  # hf_guards.model_cache_off's pre-hooks on the lists' owners
            total=total,  # the budget checkpoint() was given, or set since (None: no limit)
            removed=False)  # by undo() or another checkpoint() call on the model

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "budget":
            raise AttributeError(
                f"{NAME}: checkpointed(model) has no setting {name!r}; the budget is "
                "checkpointed(model).budget, the other options are checkpoint()'s arguments "
                "(call scheduler.checkpoint(model, ...) again to change them)")
        object.__setattr__(self, name, value)

    @property
    def budget(self) -> Optional[int]:
        """The whole budget: the one given, or the lists' own where one was set on a runner."""
        own = [r.budget for r in self.runners]
        total = self.__dict__.get("total")   # (a model pickled before it was kept)
        if own == budget_shares(total, [len(lst) for _, lst in self.lists]):
            return total
        return None if None in own else sum(own)

    @budget.setter
    def budget(self, value: Any) -> None:
        if self.__dict__.get("removed"):
            raise RuntimeError(
                f"{NAME}: this checkpointed(model) was removed (by undo(), or by another "
                "scheduler.checkpoint call on the model) and plans nothing now; set the budget "
                "on checkpointed(model) of the model as it is checkpointed now")
        total = parse_budget(value, NAME)
        sizes = [len(lst) for _, lst in self.lists]
        for runner, n, share in zip(self.runners, sizes, budget_shares(total, sizes)):
            runner.budget = share   # (plans again on the next forward)
            if len(sizes) > 1 and share is not None:
                runner.budget_share = (n, sum(sizes))
        self.__dict__["total"] = total

    def stats(self) -> Dict[str, Any]:
        """Per block list: the runner's figures (plans, cache, last peak)."""
        return {name: r.stats() for (name, _), r in zip(self.lists, self.runners)}


def budget_shares(total: Optional[int], sizes: Sequence[int]) -> List[Optional[int]]:
    """Each block list's share of the whole budget, proportional to its block count."""
    n_all = sum(sizes)
    return [None if total is None else max(1, total * n // n_all) for n in sizes]


# ------------------------------------------------------------------------------ block lists
def _is_hf_layer(m: nn.Module) -> bool:
    layers = sys.modules.get("transformers.modeling_layers")
    cls = getattr(layers, "GradientCheckpointingLayer", None) if layers else None
    return cls is not None and isinstance(m, cls)


# containers without a forward: the model loops through them, never calls them
_NOT_CALLED = (nn.ModuleList, nn.ModuleDict)


def _same_class_list(m: nn.Module) -> bool:
    kids = list(m.children())
    return isinstance(m, (nn.ModuleList, nn.Sequential)) and len(kids) >= 2 and \
        len({type(k) for k in kids}) == 1 and not isinstance(kids[0], _NOT_CALLED) and \
        fsdp.has_weights(m)


def find_blocks(model: nn.Module, blocks: BlocksArg = None) -> List[Tuple[str, nn.Module]]:
    """The block lists to run under plans, as ``(dotted name, list)`` pairs."""
    names = {id(m): n for n, m in model.named_modules()}
    if blocks is not None:
        if not isinstance(blocks, (str, nn.Module, list, tuple)):
            raise TypeError(f"{NAME}: blocks must be a ModuleList, a dotted path or a list of "
                            f"those, got {blocks!r}")
        items = [blocks] if isinstance(blocks, (str, nn.Module)) else list(blocks)
        if not items:  # else nothing would be checkpointed, without a word
            raise ValueError(f"{NAME}: blocks must name at least one block list, got {blocks!r}")
        out: List[Tuple[str, nn.Module]] = []
        for item in items:
            if isinstance(item, str):
                try:
                    mod = model.get_submodule(item)
                except AttributeError as e:
                    raise ValueError(f"{NAME}: blocks={item!r} names no submodule of "
                                     f"{type(model).__name__}") from e
                name = item
            elif isinstance(item, nn.Module):
                mod, name = item, names.get(id(item))
                if name is None:
                    raise ValueError(f"{NAME}: blocks= is a {type(item).__name__} that is not "
                                     f"part of the model")
            else:
                raise TypeError(f"{NAME}: blocks= must be a ModuleList, a dotted path or a list "
                                f"of those, got {type(item).__name__}")
            if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) == 0:
                raise TypeError(f"{NAME}: blocks={name!r} is a {type(mod).__name__}; it must be "
                                "a non-empty nn.ModuleList or nn.Sequential the model's forward "
                                "loops over")
            inner = next((k for k in mod if isinstance(k, _NOT_CALLED)), None)
            if inner is not None:
                raise TypeError(f"{NAME}: blocks={name!r} holds {type(inner).__name__}s, which "
                                "the model loops through but never calls; name the lists of "
                                f"blocks inside it (e.g. blocks=['{name}.0', '{name}.1'])")
            # a list twice, or inside another's blocks: its blocks would be wrapped twice
            for other, known in out:
                if known is mod or name.startswith(other + ".") or other.startswith(name + "."):
                    raise ValueError(f"{NAME}: blocks names {other!r} and {name!r}, which "
                                     "overlap; name each block list once")
            out.append((name, mod))
        return out
    hf = [(n, m) for n, m in model.named_modules()
          if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 1 and
          all(_is_hf_layer(k) for k in m.children())]
    found = hf or [(n, m) for n, m in model.named_modules() if _same_class_list(m)]
    # outermost lists only (a list inside a block is part of that block)
    found = [(n, m) for n, m in found
             if not any(n != o and n.startswith(o + ".") for o, _ in found)]
    if not found:
        # the model's own lists, to pick from: a generic example would name a path it lacks
        lists = [f"'{n}' ({len(m)} {type(m[0]).__name__})" for n, m in model.named_modules()
                 if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 1][:6]
        where = f"its lists: {', '.join(lists)}" if lists else "it has no nn.ModuleList"
        raise ValueError(f"{NAME}: found no repeated block list in {type(model).__name__} "
                         f"({where}); name the nn.ModuleList its forward loops over with "
                         "blocks= (a list of one block that the forward runs several times, "
                         "ALBERT's shared layers, leaves nothing to plan)")
    return found


def _owner(model: nn.Module, name: str) -> Optional[nn.Module]:
    """The module holding the list ``name``: the one whose forward loops over it."""
    if not name:
        return None
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


# ------------------------------------------------------------------------------ interception
class _BlockForward(WeakFields):
    """The instance ``forward`` of a checkpointed block: the call goes through the runner.

    It refers to its block, the runner, the owner and the root (the module ``checkpoint`` was
    called on, which holds the runner) weakly: the block holds it, the model holds the runner
    (``Checkpointed``) and the runner the blocks, so strong references would make a cycle
    that keeps a model the user deleted, weights and all, until the garbage collector runs
    (``del model`` would free no device memory). A copied or pickled model's blocks go
    through the copied runner (``WeakFields``)."""

    WEAK = ("_runner", "_block", "_owner", "_root")
    said_gone = False  # whether a step has said that the runner is gone
    # what Dynamo reads on an OptimizedModule's forward (a block compiled before the call):
    # without them, a torch.compile(model) tracing the model's loop would trace the compiled
    # block's _orig_mod, past this forward and the runner (no plan, the budget not held)
    _torchdynamo_disable = True
    _torchdynamo_disable_msg = BLOCK_CALLS_EAGER[0]

    def __init__(self, runner: ChainRunner, s: int, block: nn.Module, own: Any,
                 owner: Optional[nn.Module], root: nn.Module, list_name: str):
        self._runner = weakref.ref(runner)
        self.s = s
        self._block = weakref.ref(block)
        # the module whose forward loops over the list
        self._owner = weakref.ref(owner) if owner is not None else gone
        self._root = weakref.ref(root)
        # for the warning once the root is gone: what the call was made on
        self.where = f"'{list_name}' of the {type(root).__name__}"
        self.own = _own_forward(own)   # the block's own instance forward, if it had one
        self.function = type(block).forward  # else its class's, called on the block
        self.thread: Optional[int] = None

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        state.setdefault("_root", None)  # pickled before the root was kept: gone
        super().__setstate__(state)

    def original(self, *args: Any, **kwargs: Any) -> Any:
        """The block's forward as it was before the call."""
        if self.own is not None:
            return self.own(*args, **kwargs)
        return self.function(self._block(), *args, **kwargs)

    @not_compiled(*BLOCK_CALLS_EAGER)  # as CheckpointedChain.forward: the runner runs eagerly
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        r = self._runner()
        if r is None or r.passthrough:  # a recomputation or a measurement: the block itself
            if r is None and self.s == 0 and not self.said_gone and \
                    self._wants_grad(args, kwargs):
                self._say_gone()
            return self.original(*args, **kwargs)
        me = threading.get_ident()
        if self.s == 0:
            r.thread = me  # type: ignore[attr-defined]
            step = r._needs_grad(args, kwargs)
        else:
            if r.current is not None and getattr(r, "thread", None) != me:
                raise RuntimeError(f"{NAME}: blocks of one model are running in several threads "
                                   "at once (nn.DataParallel?); use DistributedDataParallel, "
                                   "one process per device")
            step = r.current is not None
        if step:
            block = r.blocks[self.s]
            check_not_hf_checkpointed(block, self._owner(), self.s)
            args, kwargs = KVCacheGuard.clean(block, self.s, args, kwargs)
        return r.call(self.s, args, kwargs, lambda a, k: self.original(*a, **k))

    def _wants_grad(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
        """``needs_grad`` of this block without the runner: a step that would be planned."""
        block = self._block()
        return needs_grad([block] if block is not None else [], args, kwargs)

    def _say_gone(self) -> None:
        # the plan went with the module the call was made on; training on without a word
        # would exceed the budget the user set (an out-of-memory later, far from the cause)
        self.said_gone = True
        where = getattr(self, "where", "this list")
        user_warning.warn(
            f"{NAME}: the blocks of {where} were checkpointed through a module that is gone "
            "(the one scheduler.checkpoint was called on: a PeftModel after "
            "merge_and_unload(), a wrapper dropped), and their plan went with it: they run "
            "plainly from this step on and the budget no longer applies. Call "
            "scheduler.checkpoint(model, budget) again on the model you train now (it "
            "replaces what is left), or scheduler.runtime.checkpoint.undo(model) to train "
            "without a plan", RuntimeWarning)


# ------------------------------------------------------------------------------ installations
def _wrapped(model: nn.Module) -> Iterator[Tuple[nn.Module, _BlockForward]]:
    """The modules inside ``model`` (itself included) whose forward is a ``_BlockForward``."""
    for m in model.modules():
        fwd = m.__dict__.get("forward")
        if isinstance(fwd, _BlockForward):
            yield m, fwd


def _root_of(fwd: _BlockForward) -> Optional[nn.Module]:
    """The module whose ``checkpoint`` call installed ``fwd``, while that installation stands;
    None for a dead one (its root or runner gone, or the root undone since)."""
    runner, root = fwd._runner(), fwd._root()
    done = root.__dict__.get(_ATTR) if root is not None else None
    if runner is None or done is None or not any(r is runner for r in done.runners):
        return None
    return root


def _own_forward(forward: Any) -> Any:
    """A block's own instance forward under any ``_BlockForward`` (never two wrappers, one
    calling the other; a model pickled while calls still nested could hold one)."""
    while isinstance(forward, _BlockForward):
        forward = forward.own
    return forward


def _unwrap(block: nn.Module, fwd: _BlockForward) -> None:
    """Give ``block`` the forward it had before ``fwd`` was installed."""
    own = _own_forward(fwd.own)
    if own is not None:
        block.forward = own
    else:
        del block.__dict__["forward"]


def _undo_own(model: nn.Module) -> None:
    """Remove what ``checkpoint`` installed on ``model`` itself."""
    done: Optional[Checkpointed] = model.__dict__.pop(_ATTR, None)
    if done is None:
        return
    done.__dict__["removed"] = True   # (a handle kept by the user: its budget setter refuses)
    if done.tail is not None:
        done.tail.remove()
    for hook in done.hooks:
        hook.remove()
    for runner in done.runners:
        for block in runner.blocks:
            fwd = block.__dict__.get("forward")
            if isinstance(fwd, _BlockForward):
                _unwrap(block, fwd)


def undo(model: nn.Module) -> nn.Module:
    """Give the blocks inside ``model`` back their own forwards (a no-op on a model not
    checkpointed): what ``checkpoint`` installed on ``model``, and also an installation made on
    another module whose blocks are inside ``model`` (the model inside a ``PeftModel``, DDP or
    another wrapper; a parent of ``model``), removed whole (its lists share one budget and one
    tail probe), and the wrappers left by an installation whose module is gone."""
    _undo_own(model)
    roots: Dict[int, nn.Module] = {}
    for block, fwd in list(_wrapped(model)):
        root = _root_of(fwd)
        if root is None:
            _unwrap(block, fwd)
        else:
            roots[id(root)] = root
    inside = {id(m) for m in model.modules()}
    for root in roots.values():
        if id(root) not in inside and not any(m is model for m in root.modules()):
            # neither a wrapper of the model nor a part of it: another model sharing blocks
            # (a trunk under two heads); its call goes, which it must not do unsaid
            user_warning.warn(
                f"{NAME}: {type(model).__name__} shares checkpointed blocks with a "
                f"{type(root).__name__} that scheduler.checkpoint was called on; that call is "
                "removed (a block runs one plan): the other model's steps now run its blocks "
                "plainly, or under this call's plan if it is a new one. Checkpoint the module "
                "that holds both models instead", RuntimeWarning)
        _undo_own(root)
    return model


def checkpointed(model: nn.Module) -> Optional[Checkpointed]:
    """What ``checkpoint`` installed on ``model`` (its runners, ``stats()``); else, when the
    call was made on one module inside ``model`` (the model a ``PeftModel`` or DDP wraps),
    what it installed there; None when there is none, or several (ambiguous)."""
    done = model.__dict__.get(_ATTR)
    if done is not None:
        return done
    inside = {id(m) for m in model.modules()}
    roots = {id(root): root for root in (_root_of(fwd) for _, fwd in _wrapped(model))
             if root is not None and id(root) in inside}
    return next(iter(roots.values())).__dict__[_ATTR] if len(roots) == 1 else None


def _runners_of(model: nn.Module) -> List[ChainRunner]:
    # the tail probe's look-up, at every forward of the model it is on: no search
    done: Optional[Checkpointed] = model.__dict__.get(_ATTR)
    return done.runners if done is not None else []


def checkpoint(model: nn.Module, budget: Any, planner: PlannerArg = "rotor",
               blocks: BlocksArg = None, **options: Any) -> nn.Module:
    """Run ``model``'s repeated blocks under an activation-memory ``budget`` (required: bytes
    or a size string; ``None``: no limit) with the plans of ``planner`` (``"rotor"``, ``"pofo"``,
    ``"periodic"``, ``"mimose"``, ``"none"``, a Plan or a callable ``(chain, budget) -> Plan``);
    returns ``model``, changed in place.

    ``blocks``: the ``nn.ModuleList`` (or its dotted path, or a list of them) the model's
    forward loops over; default: found (see module doc). Several lists (T5's encoder and
    decoder) each get a runner and a share of the budget proportional to their block count.
    Options: ``bandwidth`` (bytes/s, for pofo; default measured on a GPU, 12e9 on CPU),
    ``outputs`` (``"watch"``, ``"dropped"`` or ``"held"``: what the caller does with the
    model's outputs before the backward; ``runtime.tail_outputs``) and those of
    ``scheduler.wrap`` (``chain``, ``track_memory``, ``cache_size``, ``samples``,
    ``input_size``, ``mimose``, ``loss``, ``measure_options``, ``on_chain``; ``mimose``: a
    ``Mimose`` for a model with one block list, ``ValueError`` with several); a ``chain``
    callable gets block 0's arguments ``(*args, **kwargs)``. Without ``chain``, the first training step of
    each new input shape checkpoints every block and measures the chain on the blocks' real
    calls, and its loss stage on the model's own tail (what runs between the last block's
    return and the model's: final norm, LM head, the loss; ``runtime.tail``; ``loss=``
    keeps ``measure_chain``'s stand-in instead); the plan runs from the next step on.
    An option ``planner`` would not read raises ``ValueError`` naming both.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{NAME}: model must be an nn.Module, got {type(model).__name__}")
    bandwidth = options.pop("bandwidth", None)
    unknown = set(options) - set(ChainRunner.OPTIONS)
    if unknown:
        raise TypeError(f"{NAME}: unknown option(s) {sorted(unknown)}")
    check_planner(planner, NAME)
    total = parse_budget(budget, NAME)
    parse_rate(bandwidth, NAME)
    check_options_used(planner, dict(options, bandwidth=bandwidth), NAME)
    refuse_hf_checkpointing(model)
    lists = find_blocks(model, blocks)
    if planner == "mimose" and options.get("mimose") is not None and len(lists) > 1:
        # a Mimose learns one block list; the runner checks that its n_blocks is the list's
        raise ValueError(f"{NAME}: mimose= serves one block list, and this model has "
                         f"{len(lists)} ({', '.join(name or '<model>' for name, _ in lists)}); "
                         "leave mimose= out and checkpoint makes one Mimose per list")
    owners = [(name, _owner(model, name)) for name, _ in lists]
    skipping = layerdrop([(f"model.{n.rpartition('.')[0]}" if "." in n else "model", o)
                          for n, o in owners if o is not None])
    if skipping:
        raise ValueError(f"{NAME}: the model skips blocks at random in training (LayerDrop: "
                         f"{', '.join(skipping)}), and a plan runs every block; set each to 0")
    # calling again re-plans with the new arguments: whatever was installed on these blocks
    # goes first, wherever it was installed (through a wrapper, on a part of the model)
    undo(model)
    n_all = sum(len(lst) for _, lst in lists)
    runners = []
    shares = budget_shares(total, [len(lst) for _, lst in lists])
    for (name, lst), (_, owner), share in zip(lists, owners, shares):
        # a block FSDP1 made a unit (the call after the wrapping): what the unit wraps, as
        # when the call comes first (the unit's forward gathers, then the runner runs)
        blocks = [fsdp.unwrapped(b) for b in lst]
        runner = ChainRunner(blocks, share, planner, bandwidth, entries=lst, name=NAME,
                             list_name=name or type(model).__name__, **options)
        if len(lists) > 1 and share is not None:
            runner.budget_share = (len(lst), n_all)
        runners.append(runner)
        for s, block in enumerate(blocks):
            block.forward = _BlockForward(runner, s, block, block.__dict__.get("forward"),
                                          owner=owner, root=model,
                                          list_name=name or type(model).__name__)
    # the model's tail (what runs after the last block: norm, LM head, loss) is measured on
    # profiling steps as the chain's loss stage, unless loss= says what that stage is; the
    # probe numbers the model's forwards either way (a list run twice in one forward)
    tail = TailProbe(model, NAME, _runners_of, measures=options.get("loss") is None)
    for runner in runners:
        runner.tail = tail
    # the KV cache off where the blocks' outputs are read: in the modules looping over them
    unique = {id(o): o for _, o in owners if o is not None}.values()
    hooks = [h for h in map(model_cache_off, unique) if h is not None]
    model.__dict__[_ATTR] = Checkpointed(lists, runners, tail, hooks, total)
    return model
