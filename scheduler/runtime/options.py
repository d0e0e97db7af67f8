"""The chain runtimes' arguments (``scheduler.wrap``, ``scheduler.checkpoint``), checked
where they are given, with errors that name the entry point and the value: the planner, the
budget, the bandwidth (``units.parse_rate``, re-exported here), the options a planner does not
read, what goes to ``measure_chain``; and Mimose's default input size."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch

from vmalloc.sizes import parse_size

from ..chain import Chain
from ..plan import Plan
from ..units import parse_rate  # noqa: F401 - the runtimes' import of the one rate parser

PLANNERS = ("rotor", "pofo", "periodic", "mimose", "none")

PlannerArg = Union[str, Plan, Callable[[Chain, Optional[int]], Plan]]
ChainArg = Union[None, Chain, Callable[..., Chain]]


def default_input_size(args: Sequence[Any]) -> int:
    """The input size Mimose and ``InputAwareChain`` key their estimates on by default:
    elements of the first input tensor (seed 004, section 3.1)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.numel()
    raise ValueError("the input size (planner='mimose', InputAwareChain): block 0's arguments "
                     f"have no tensor to size ({[type(a).__name__ for a in args]}); pass "
                     "input_size=, a callable from them to a number")


def parse_budget(budget: Any, where: str) -> Optional[int]:
    """``None`` (no limit) or a positive byte count (an int or a size string: "6GiB"); every
    entry point's budget (wrap, checkpoint, the swap runtime's)."""
    if budget is None:
        return None
    value = parse_size(budget, f"{where}: budget")
    if value <= 0:
        raise ValueError(f"{where}: budget must be a positive byte size (e.g. '6GiB') or None "
                         f"for no limit, got {budget!r}")
    return value


def check_planner(planner: Any, where: str) -> None:
    if isinstance(planner, Plan) or (callable(planner) and not isinstance(planner, type)):
        return
    if not isinstance(planner, str) or planner not in PLANNERS:
        raise ValueError(f"{where}: planner must be one of {', '.join(PLANNERS)}, a Plan or a "
                         f"callable (chain, budget) -> Plan; got {planner!r}")


def check_bool(value: Any, name: str, where: str) -> bool:
    """A flag: ``True`` or ``False`` only ("no" would read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {value!r}")
    return value


def check_callable(value: Any, name: str, where: str, what: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{where}: {name} must be {what}, got {value!r}")


# what the runner passes to measure_chain itself (the rest of its keywords are measure_options)
_MEASURE_OWN = ("model_blocks", "sample_input", "loss", "input_grad")


def check_measure(loss: Any, measure_options: Any, where: str) -> Dict[str, Any]:
    """``loss`` and ``measure_options`` for ``measure_chain``, checked now rather than at the
    first measurement (deep in a training step); returns the options as a dict."""
    from ..profile import measure  # torch-importing, as this module
    from ..profile.losses import LOSSES
    if not callable(loss) and loss not in LOSSES:
        raise ValueError(f"{where}: loss must be one of {', '.join(map(repr, LOSSES))} or "
                         f"a callable on the last block's output, got {loss!r}")
    if measure_options is None:
        return {}
    if not isinstance(measure_options, dict):
        raise TypeError(f"{where}: measure_options must be a dict of measure_chain keywords, "
                        f"got {measure_options!r}")
    params = inspect.signature(measure.measure_chain).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        known = [n for n in params if n not in _MEASURE_OWN]
        for key in measure_options:
            if key not in known:
                raise ValueError(f"{where}: measure_options key {key!r} is not a measure_chain "
                                 f"option (it takes {', '.join(known)})")
    return dict(measure_options)


def _planner_text(planner: Any) -> str:
    if isinstance(planner, Plan):
        return "a Plan as planner"
    return f"planner={planner!r}" if isinstance(planner, str) else "a callable planner"


_MIMOSE_ONLY = ("samples", "input_size", "mimose")
_MEASURING = ("chain", "loss", "measure_options", "on_chain")  # what a chain is measured with


def _why_unused(planner: PlannerArg, key: str, given: Dict[str, Any]) -> Optional[str]:
    """Why ``planner`` would never read option ``key``, or None if it does."""
    name = planner if isinstance(planner, str) else None
    if key == "bandwidth" and name != "pofo":
        return "only planner='pofo' plans transfers at that rate"
    if key in _MIMOSE_ONLY and name != "mimose":
        return "only planner='mimose' reads it"
    if key == "samples" and given.get("mimose") is not None:
        return "the Mimose given as mimose= has its own"
    if key in _MEASURING and name == "mimose":
        return "Mimose measures the blocks itself, in the training step"
    if key in _MEASURING and isinstance(planner, Plan):
        return "the Plan runs as given, on no chain"
    if key == "outputs" and name == "mimose":
        return "Mimose learns the model's tail, outputs and all, from its samples"
    if key == "outputs" and isinstance(planner, Plan):
        return "the Plan runs as given, on no chain"
    if key == "outputs" and (given.get("chain") is not None or given.get("loss") is not None):
        return ("a chain given, or a loss= stand-in, has no measured tail: outputs= says how "
                "the model's tail counts what it returns")
    if key == "sample_input" and name == "mimose":
        return ("Mimose cannot plan before it has learnt the chain on its first `samples` "
                "training steps")
    return None


def check_options_used(planner: PlannerArg, given: Dict[str, Any], where: str) -> None:
    """Options the caller passed (``given``: name -> value; ``None`` is every one's default)
    that ``planner`` would never read raise ``ValueError`` naming both, rather than being
    ignored."""
    for key, value in given.items():
        why = None if value is None else _why_unused(planner, key, given)
        if why is None:
            continue
        shown = repr(value) if len(repr(value)) <= 60 else f"<{type(value).__name__}>"
        raise ValueError(f"{where}: {key}={shown} has no effect with "
                         f"{_planner_text(planner)}: {why}")
