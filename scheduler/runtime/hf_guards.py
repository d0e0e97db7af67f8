"""What ``scheduler.checkpoint`` must refuse or turn off in a Hugging Face model, because a
plan recomputes blocks in the backward (the same rules HF's own gradient checkpointing
follows, across transformers 4.4x to 5.x):

- the KV cache: a recomputed block would write it twice. A training step asks the model for
  no cache at all (``model_cache_off``: a forward pre-hook), and each block's call loses any
  cache argument left (``KVCacheGuard.clean``); a cache that already holds positions (a prefix
  passed in) is refused, since dropping it would train on something else;
- HF's own checkpointing, on at the call (``refuse_hf_checkpointing``) or turned on afterwards
  (``check_not_hf_checkpointed``): every block would be checkpointed twice;
- LayerDrop (``layerdrop``): blocks skipped at random, which no plan over every block follows.

Nothing here imports transformers: a model that is not HF's passes through untouched."""
from __future__ import annotations

import inspect
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from vmalloc import user_warning
from . import fsdp

NAME = "scheduler.checkpoint"
# config fields a module reads in its forward to skip blocks (the encoder_/decoder_ ones are
# copied into the module's own ``layerdrop`` when it is built)
LAYERDROP_FIELDS = ("layerdrop", "speech_encoder_layerdrop")


def is_hf(module: nn.Module) -> bool:
    """Whether ``module``'s class (or one it derives from: FSDP2's, peft's) is transformers'."""
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


class KVCacheGuard:
    """Drops the KV cache from a block's call in a training step, saying so once."""

    # its argument names across versions (5.2x: `cache`); taken by name only in HF's blocks,
    # and any argument holding a transformers Cache, whatever its name, in every block
    NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")
    warned = False

    @classmethod
    def say(cls) -> None:
        """Warn, once per process, that training steps run without the KV cache."""
        if not cls.warned:
            cls.warned = True
            user_warning.warn(f"{NAME}: training steps run the blocks without their KV cache "
                              "(use_cache=False), as Hugging Face's gradient checkpointing does: "
                              "a recomputed block would write it twice; the model returns no "
                              "cache")

    @classmethod
    def clean(cls, block: nn.Module, s: int, args: Tuple[Any, ...],
              kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """Block ``s``'s call arguments without its KV cache (``use_cache=False``, every
        cache argument ``None``), as HF's gradient checkpointing runs blocks: a recomputed
        block would write its cache twice. Unchanged for a block that only reads its cache
        (``_can_checkpoint_with_cache``); a cache that already holds positions raises
        (``_check_empty``). Said once (``say``)."""
        if getattr(block, "_can_checkpoint_with_cache", False):  # HF: it only reads the cache
            return args, kwargs
        utils = sys.modules.get("transformers.cache_utils")
        cache_cls = getattr(utils, "Cache", None) if utils else None
        by_name = is_hf(block)

        def is_cache(key: Optional[str], value: Any) -> bool:
            if value is None:
                return False
            if cache_cls is not None and isinstance(value, cache_cls):
                return True
            return by_name and key in cls.NAMES

        changed = False
        if kwargs.get("use_cache") and by_name:
            kwargs = dict(kwargs, use_cache=False)
            changed = True
        dropped = [(k, v) for k, v in kwargs.items() if is_cache(k, v)]
        dropped += [(None, a) for a in args if is_cache(None, a)]
        for key, value in dropped:
            _check_empty(block, s, key, value)
        if dropped:
            kwargs = {k: (None if is_cache(k, v) else v) for k, v in kwargs.items()}
            args = tuple(None if is_cache(None, a) else a for a in args)
            changed = True
        if changed:
            cls.say()
        return args, kwargs


def _check_empty(block: nn.Module, s: int, key: Optional[str], cache: Any) -> None:
    held = _positions(cache)
    if held:
        raise ValueError(
            f"{NAME}: block {s} ({type(block).__name__}) got a KV cache "
            f"({key or 'a positional argument'}) that already holds {held} positions in a "
            "training step; the checkpointed blocks run without their cache (a recomputed "
            "block would write it twice), so that prefix would be lost: train without a past "
            "cache (peft's prefix tuning passes one), or call "
            "scheduler.runtime.checkpoint.undo(model) first")


def _positions(cache: Any) -> int:
    """How many positions a cache holds: a transformers Cache says; a legacy one (tuples of
    key and value tensors, batch x heads x positions x dim) by its tensors' shapes."""
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        try:
            return int(length())
        except Exception:  # a cache type that cannot say: nothing known to be lost
            return 0
    if isinstance(cache, torch.Tensor):
        return int(cache.shape[-2]) if cache.dim() >= 2 and cache.numel() else 0
    if isinstance(cache, (tuple, list)):
        return max((_positions(c) for c in cache), default=0)
    return 0


def model_cache_off(model: nn.Module) -> Optional[Any]:
    """A forward pre-hook on ``model`` (a transformers module looping over checkpointed
    blocks) that passes ``use_cache=False`` whenever the runner may step (gradients enabled
    and a weight that wants one, FSDP1's flat-parameter views included, as the runner reads
    it: ``fsdp.trains``; train or eval mode alike); the handle, or ``None`` if the
    module is not HF's or its forward takes no ``use_cache``. As HF's checkpointing does at the
    model level: transformers 4 reads its blocks' outputs by position, which a block asked
    alone for no cache shortens."""
    if not is_hf(model):  # a user's own loop: its use_cache means what it means there
        return None
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    if "use_cache" not in params:
        return None
    return model.register_forward_pre_hook(_CacheOff(params.index("use_cache")),
                                           with_kwargs=True)


class _CacheOff:
    """``model_cache_off``'s hook (a class, not a closure, so a model holding it pickles)."""

    def __init__(self, position: int):
        self.position = position  # of use_cache among the forward's parameters

    def __call__(self, module: nn.Module, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        if not torch.is_grad_enabled() or not fsdp.trains([module]):  # (FSDP1's views too)
            return None
        position = self.position
        if len(args) > position:  # passed by position
            wanted = args[position]
            args = args[:position] + (False,) + args[position + 1:]
        else:
            wanted = kwargs.get("use_cache")
            kwargs = dict(kwargs, use_cache=False)
        if wanted is None:
            wanted = getattr(getattr(module, "config", None), "use_cache", False)
        if wanted:
            KVCacheGuard.say()
        return args, kwargs


def _turn_hf_checkpointing_off(call: str) -> str:
    return (f"call {call}, and leave gradient_checkpointing (activation_checkpointing in "
            "transformers 5) out of the Trainer's TrainingArguments: the plan decides what is "
            "recomputed")


def refuse_hf_checkpointing(model: nn.Module) -> None:
    """Refuse a model whose HF checkpointing is on at the call (transformers 5.2x names it
    activation checkpointing; the gradient_* names: deprecated)."""
    new_names = hasattr(model, "is_activation_checkpointing")  # a PeftModel forwards it
    if getattr(model, "is_activation_checkpointing" if new_names else "is_gradient_checkpointing",
               False):
        off = "activation_checkpointing_disable" if new_names else "gradient_checkpointing_disable"
        raise ValueError(f"{NAME}: Hugging Face gradient checkpointing is on for this model; "
                         + _turn_hf_checkpointing_off(f"model.{off}()"))


def check_not_hf_checkpointed(block: nn.Module, owner: Optional[nn.Module], s: int) -> None:
    """Refuse a step where HF's checkpointing was turned on after ours: on the block
    (transformers 4.5x on) or on the module whose loop calls it (before)."""
    if getattr(block, "gradient_checkpointing", False) or \
            getattr(owner, "gradient_checkpointing", False) is True:
        raise RuntimeError(
            f"{NAME}: Hugging Face gradient checkpointing was turned on for block {s} "
            f"({type(block).__name__}) after scheduler.checkpoint; " + _turn_hf_checkpointing_off(
                "model.activation_checkpointing_disable() (transformers < 5.2x: "
                "gradient_checkpointing_disable())"))


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def layerdrop(owners: Sequence[Tuple[str, nn.Module]]) -> List[str]:
    """Where the modules looping over the checkpointed lists (``(path, module)``) keep a
    LayerDrop probability above 0 (their own ``layerdrop``, or a config field they read in
    their forward), as ``path=value``."""
    found = []
    for where, owner in owners:
        own = owner.__dict__.get("layerdrop")
        if _positive(own):
            found.append(f"{where}.layerdrop={own}")
        config = getattr(owner, "config", None)
        for key in LAYERDROP_FIELDS:
            value = getattr(config, key, None)
            if _positive(value):
                found.append(f"{where}.config.{key}={value}")
    return list(dict.fromkeys(found))
