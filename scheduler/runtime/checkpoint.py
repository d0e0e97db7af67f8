"""``scheduler.checkpoint``: budgeted optimal checkpointing of any model with a repeated block
list, in place, in one line (public contract, DESIGN.md "The chain runtime").

    model = scheduler.checkpoint(model, budget="6GiB", planner="rotor")

Finds the block list (``blocks=`` names it; else the ``nn.ModuleList`` whose entries are
Hugging Face ``GradientCheckpointingLayer``s, the list HF's own gradient checkpointing walks,
else the outermost ``ModuleList`` of same-class modules) and replaces each block's
``forward`` (an instance attribute: parameter names, ``state_dict`` and module hooks stay as
they were) by a call through one ``ChainRunner`` per list. The model's own loop keeps calling
the blocks with whatever arguments it uses; see ``chain_exec`` for how a step runs.

Calling it again on the same model first undoes the previous call (never wraps twice);
``undo(model)`` restores the original forwards.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import fsdp
from .chain_runner import ChainRunner
from .options import PlannerArg, check_options_used, check_planner, parse_budget, parse_rate
from .hf_guards import (KVCacheGuard, check_not_hf_checkpointed, layerdrop, model_cache_off,
                        refuse_hf_checkpointing)
from .tail import TailProbe
from .weak import WeakFields, gone

NAME = "scheduler.checkpoint"
_ATTR = "_vmalloc_checkpoint"
BlocksArg = Union[None, str, nn.ModuleList, nn.Sequential, Sequence[Union[str, nn.Module]]]


class Checkpointed:
    """What ``checkpoint`` installed on a model: the block lists and their runners."""

    def __init__(self, lists: List[Tuple[str, nn.Module]], runners: List[ChainRunner],
                 tail: Optional[TailProbe] = None, hooks: Sequence[Any] = ()):
        self.lists = lists
        self.runners = runners
        self.tail = tail  # numbers the model's forwards, measures its tail (the loss stage)
        self.hooks = list(hooks)  # hf_guards.model_cache_off's pre-hooks on the lists' owners

    def stats(self) -> Dict[str, Any]:
        """Per block list: the runner's figures (plans, cache, last peak)."""
        return {name: r.stats() for (name, _), r in zip(self.lists, self.runners)}


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

    It refers to its block, the runner and the owner weakly: the block holds it, the model
    holds the runner (``Checkpointed``) and the runner the blocks, so strong references
    would make a cycle that keeps a model the user deleted, weights and all, until the
    garbage collector runs (``del model`` would free no device memory). A copied or pickled
    model's blocks go through the copied runner (``WeakFields``)."""

    WEAK = ("_runner", "_block", "_owner")

    def __init__(self, runner: ChainRunner, s: int, block: nn.Module, own: Any,
                 owner: Optional[nn.Module]):
        self._runner = weakref.ref(runner)
        self.s = s
        self._block = weakref.ref(block)
        # the module whose forward loops over the list
        self._owner = weakref.ref(owner) if owner is not None else gone
        self.own = own                 # the block's own instance forward, if it had one
        self.function = type(block).forward  # else its class's, called on the block
        self.thread: Optional[int] = None

    def original(self, *args: Any, **kwargs: Any) -> Any:
        """The block's forward as it was before the call."""
        if self.own is not None:
            return self.own(*args, **kwargs)
        return self.function(self._block(), *args, **kwargs)

    @torch.compiler.disable  # as CheckpointedChain.forward: the runner runs eagerly
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        r = self._runner()
        if r is None or r.passthrough:  # a recomputation or a measurement: the block itself
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


def undo(model: nn.Module) -> nn.Module:
    """Give the blocks back their own forwards (a no-op on a model not checkpointed)."""
    done: Optional[Checkpointed] = model.__dict__.pop(_ATTR, None)
    if done is None:
        return model
    if done.tail is not None:
        done.tail.remove()
    for hook in done.hooks:
        hook.remove()
    for runner in done.runners:
        for block in runner.blocks:
            fwd = block.__dict__.get("forward")
            if isinstance(fwd, _BlockForward):
                if fwd.own is not None:
                    block.forward = fwd.own
                else:
                    del block.__dict__["forward"]
    return model


def checkpointed(model: nn.Module) -> Optional[Checkpointed]:
    """What ``checkpoint`` installed on ``model`` (its runners, ``stats()``), or None."""
    return model.__dict__.get(_ATTR)


def _runners_of(model: nn.Module) -> List[ChainRunner]:
    done = checkpointed(model)
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
    Options: ``bandwidth`` (bytes/s, for pofo; default measured on a GPU, 12e9 on CPU) and
    those of ``scheduler.wrap`` (``chain``, ``track_memory``, ``cache_size``, ``samples``,
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
    undo(model)  # calling again re-plans with the new arguments, never wraps twice
    n_all = sum(len(lst) for _, lst in lists)
    runners = []
    for (name, lst), (_, owner) in zip(lists, owners):
        share = None if total is None else max(1, total * len(lst) // n_all)
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
                                          owner=owner)
    # the model's tail (what runs after the last block: norm, LM head, loss) is measured on
    # profiling steps as the chain's loss stage, unless loss= says what that stage is; the
    # probe numbers the model's forwards either way (a list run twice in one forward)
    tail = TailProbe(model, NAME, _runners_of, measures=options.get("loss") is None)
    for runner in runners:
        runner.tail = tail
    # the KV cache off where the blocks' outputs are read: in the modules looping over them
    unique = {id(o): o for _, o in owners if o is not None}.values()
    hooks = [h for h in map(model_cache_off, unique) if h is not None]
    model.__dict__[_ATTR] = Checkpointed(lists, runners, tail, hooks)
    return model
