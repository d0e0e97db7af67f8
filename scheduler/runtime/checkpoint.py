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
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .chain_runner import ChainRunner, PlannerArg, check_planner, parse_budget, parse_rate
from .tail import TailProbe

NAME = "scheduler.checkpoint"
_ATTR = "_vmalloc_checkpoint"
BlocksArg = Union[None, str, nn.ModuleList, nn.Sequential, Sequence[Union[str, nn.Module]]]


class Checkpointed:
    """What ``checkpoint`` installed on a model: the block lists and their runners."""

    def __init__(self, lists: List[Tuple[str, nn.Module]], runners: List[ChainRunner],
                 tail: Optional[TailProbe] = None):
        self.lists = lists
        self.runners = runners
        self.tail = tail  # measures the model's tail as the chain's loss stage, or None

    def stats(self) -> Dict[str, Any]:
        """Per block list: the runner's figures (plans, cache, last peak)."""
        return {name: r.stats() for (name, _), r in zip(self.lists, self.runners)}


# ------------------------------------------------------------------------------ block lists
def _is_hf_layer(m: nn.Module) -> bool:
    layers = sys.modules.get("transformers.modeling_layers")
    cls = getattr(layers, "GradientCheckpointingLayer", None) if layers else None
    return cls is not None and isinstance(m, cls)


def _same_class_list(m: nn.Module) -> bool:
    kids = list(m.children())
    return isinstance(m, (nn.ModuleList, nn.Sequential)) and len(kids) >= 2 and \
        len({type(k) for k in kids}) == 1 and any(True for _ in m.parameters())


def find_blocks(model: nn.Module, blocks: BlocksArg = None) -> List[Tuple[str, nn.Module]]:
    """The block lists to run under plans, as ``(dotted name, list)`` pairs."""
    names = {id(m): n for n, m in model.named_modules()}
    if blocks is not None:
        items = [blocks] if isinstance(blocks, (str, nn.Module)) else list(blocks)
        out = []
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
        raise ValueError(f"{NAME}: found no repeated block list in {type(model).__name__}; name "
                         "the nn.ModuleList its forward loops over with blocks= (e.g. "
                         "blocks='transformer.h')")
    return found


def layerdrop(model: nn.Module) -> List[str]:
    """Where ``model`` keeps a LayerDrop probability above 0 (HF's encoders and decoders: a
    module's own ``layerdrop``, read in its forward, or its config's ``layerdrop``,
    ``encoder_layerdrop``, ``decoder_layerdrop``), as ``path=value``."""
    found, configs = [], set()
    for name, module in model.named_modules():
        where = f"model.{name}" if name else "model"
        value = module.__dict__.get("layerdrop")
        if isinstance(value, float) and value > 0:
            found.append(f"{where}.layerdrop={value}")
        config = module.__dict__.get("config")
        if config is None or id(config) in configs:
            continue
        configs.add(id(config))
        for key in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
            value = getattr(config, key, None)
            if isinstance(value, float) and value > 0:
                found.append(f"{where}.config.{key}={value}")
    return found


# ------------------------------------------------------------------------------ interception
class _CacheGuard:
    """Under a plan a block runs again in the backward: a KV cache it writes would be written
    twice. As HF's own gradient checkpointing does, training steps run without the cache."""

    # the cache's argument names across transformers versions (5.2x calls it `cache`); any
    # other argument holding a transformers Cache is dropped too, whatever its name
    NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")
    warned = False

    @classmethod
    def clean(cls, block: nn.Module, s: int, args: Tuple[Any, ...],
              kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        if getattr(block, "_can_checkpoint_with_cache", False):
            return args, kwargs
        utils = sys.modules.get("transformers.cache_utils")
        cache_cls = getattr(utils, "Cache", None) if utils else None

        def is_cache(key: Optional[str], value: Any) -> bool:
            if value is None:
                return False
            if cache_cls is not None and isinstance(value, cache_cls):
                return True
            return key in cls.NAMES

        changed = False
        if kwargs.get("use_cache"):
            kwargs = dict(kwargs, use_cache=False)
            changed = True
        dropped = [(k, v) for k, v in kwargs.items() if is_cache(k, v)]
        dropped += [(None, a) for a in args if is_cache(None, a)]
        for key, value in dropped:
            cls._check_empty(block, s, key, value)
        if dropped:
            kwargs = {k: (None if is_cache(k, v) else v) for k, v in kwargs.items()}
            args = tuple(None if is_cache(None, a) else a for a in args)
            changed = True
        if changed and not cls.warned:
            cls.warned = True
            warnings.warn(f"{NAME}: training steps run the blocks without their KV cache "
                          "(use_cache=False), as Hugging Face's gradient checkpointing does: "
                          "a recomputed block would write it twice; the cache the model "
                          "returns stays empty", stacklevel=4)
        return args, kwargs

    @staticmethod
    def _check_empty(block: nn.Module, s: int, key: Optional[str], cache: Any) -> None:
        """A cache that already holds positions (a prefix passed in) cannot be dropped without
        changing the step's result: say so instead of training on something else."""
        length = getattr(cache, "get_seq_length", None)
        try:
            held = int(length()) if callable(length) else 0
        except Exception:  # a cache type that cannot say: nothing known to be lost
            held = 0
        if held > 0:
            raise ValueError(
                f"{NAME}: block {s} ({type(block).__name__}) got a KV cache "
                f"({key or 'a positional argument'}) that already holds {held} positions in a "
                "training step; the checkpointed blocks run without their cache (a recomputed "
                "block would write it twice), so that prefix would be lost: train without a "
                "past cache, or call scheduler.runtime.checkpoint.undo(model) first")


class _BlockForward:
    """The instance ``forward`` of a checkpointed block: the call goes through the runner."""

    def __init__(self, runner: ChainRunner, s: int, block: nn.Module, original: Any,
                 installed: bool):
        self.runner = runner
        self.s = s
        self.original = original       # the forward to call (bound)
        self.installed = installed     # whether the block had its own instance forward
        self.thread: Optional[int] = None

    @torch.compiler.disable  # as CheckpointedChain.forward: the runner runs eagerly
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        r = self.runner
        if r.passthrough:  # a recomputation or a measurement: the block itself
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
            if getattr(block, "gradient_checkpointing", False) and block.training:
                # HF's checkpointing turned on after ours: each block would be checkpointed
                # twice (its recomputation recomputed), costing time against the plan
                raise RuntimeError(
                    f"{NAME}: Hugging Face gradient checkpointing was turned on for block "
                    f"{self.s} ({type(block).__name__}) after scheduler.checkpoint; call "
                    "model.activation_checkpointing_disable() (transformers < 5.2x: "
                    "gradient_checkpointing_disable()), and leave gradient_checkpointing out "
                    "of the Trainer's TrainingArguments: the plan decides what is recomputed")
            args, kwargs = _CacheGuard.clean(block, self.s, args, kwargs)
        return r.call(self.s, args, kwargs, lambda a, k: self.original(*a, **k))


def undo(model: nn.Module) -> nn.Module:
    """Give the blocks back their own forwards (a no-op on a model not checkpointed)."""
    done: Optional[Checkpointed] = model.__dict__.pop(_ATTR, None)
    if done is None:
        return model
    if done.tail is not None:
        done.tail.remove()
    for (_, lst), runner in zip(done.lists, done.runners):
        for block in lst:
            fwd = block.__dict__.get("forward")
            if isinstance(fwd, _BlockForward):
                if fwd.installed:
                    block.forward = fwd.original
                else:
                    del block.__dict__["forward"]
    return model


def checkpointed(model: nn.Module) -> Optional[Checkpointed]:
    """What ``checkpoint`` installed on ``model`` (its runners, ``stats()``), or None."""
    return model.__dict__.get(_ATTR)


def checkpoint(model: nn.Module, budget: Any = "6GiB", planner: PlannerArg = "rotor",
               blocks: BlocksArg = None, **options: Any) -> nn.Module:
    """Run ``model``'s repeated blocks under an activation-memory ``budget`` (bytes or a size
    string; ``None``: no limit) with the plans of ``planner`` (``"rotor"``, ``"pofo"``,
    ``"periodic"``, ``"mimose"``, ``"none"``, a Plan or a callable ``(chain, budget) -> Plan``);
    returns ``model``, changed in place.

    ``blocks``: the ``nn.ModuleList`` (or its dotted path, or a list of them) the model's
    forward loops over; default: found (see module doc). Several lists (T5's encoder and
    decoder) each get a runner and a share of the budget proportional to their block count.
    Options: ``bandwidth`` (bytes/s, for pofo; default measured on a GPU, 12e9 on CPU) and
    those of ``scheduler.wrap`` (``chain``, ``track_memory``, ``cache_size``, ``samples``,
    ``input_size``, ``mimose``, ``loss``, ``measure_options``, ``on_chain``); a ``chain`` callable gets
    block 0's arguments ``(*args, **kwargs)``. Without ``chain``, the first training step of
    each new input shape checkpoints every block and measures the chain on the blocks' real
    calls, and its loss stage on the model's own tail (what runs between the last block's
    return and the model's: final norm, LM head, the loss; ``runtime.tail``; ``loss=``
    keeps ``measure_chain``'s stand-in instead); the plan runs from the next step on.
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
    # transformers >= 5.2x names it activation checkpointing (the gradient_* names: deprecated)
    new_names = hasattr(model, "is_activation_checkpointing")  # a PeftModel forwards it
    if getattr(model, "is_activation_checkpointing" if new_names else "is_gradient_checkpointing",
               False):
        off = "activation_checkpointing_disable" if new_names else "gradient_checkpointing_disable"
        raise ValueError(f"{NAME}: Hugging Face gradient checkpointing is on for this model; "
                         f"call model.{off}() first, and leave gradient_checkpointing out of "
                         "the Trainer's TrainingArguments (the plan decides what is recomputed)")
    if planner == "mimose" and options.get("mimose") is not None:
        raise ValueError(f"{NAME}: mimose= is per block list; let checkpoint create them")
    skipping = layerdrop(model)
    if skipping:
        raise ValueError(f"{NAME}: the model skips blocks at random in training (LayerDrop: "
                         f"{', '.join(skipping)}), and a plan runs every block; set each to 0")
    undo(model)  # calling again re-plans with the new arguments, never wraps twice
    lists = find_blocks(model, blocks)
    n_all = sum(len(lst) for _, lst in lists)
    runners = []
    for name, lst in lists:
        share = None if total is None else max(1, total * len(lst) // n_all)
        runner = ChainRunner(list(lst), share, planner, bandwidth, name=NAME, **options)
        runners.append(runner)
        for s, block in enumerate(lst):
            own = block.__dict__.get("forward")
            block.forward = _BlockForward(runner, s, block, own or block.forward,
                                          installed=own is not None)
    # the model's tail (what runs after the last block: norm, LM head, loss) is measured on
    # profiling steps as the chain's loss stage, unless loss= says what that stage is
    tail = TailProbe(model, NAME) if "loss" not in options else None
    for runner in runners:
        runner.tail = tail
    model.__dict__[_ATTR] = Checkpointed(lists, runners, tail)
    return model
