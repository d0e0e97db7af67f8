"""Hugging Face's output capture, kept to the model's own block calls.

transformers 5 collects ``output_hidden_states``, ``output_attentions`` and
``output_router_logits`` (the MoE load-balancing loss) with forward hooks on the blocks and
their submodules, which append to a collector that is active while the model's forward runs
(``transformers.utils.output_capturing._active_collector``). The runner calls blocks again
inside that forward: ``measure_chain`` on a profiling step, Mimose's measurements. Their
outputs must not join the model's: the hidden states would come back with extra entries, and
the router logits of a measurement (whose graph the measurement frees) would join the
auxiliary loss, whose backward then fails. ``outputs_not_captured()`` turns the collector off
around such calls. Recomputations run in the backward, after the forward's collector is gone,
and are covered the same way."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator


@contextlib.contextmanager
def outputs_not_captured() -> Iterator[None]:
    """Turn transformers' output collector off for the body (module doc), whichever form this
    transformers version keeps it in: none, a plain global while ``torch.compile`` traces,
    or a ``ContextVar``."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    var = getattr(capturing, "_active_collector", None)
    if var is None:  # transformers not imported, or a version without a collector
        yield
        return
    if getattr(var, "compiling", False):
        # set while torch.compile traced the model: a plain global until the forward resets it
        held, var.global_var = var.global_var, None
        try:
            yield
        finally:
            var.global_var = held
        return
    inner = getattr(var, "context_var", var)  # its ContextVar (or a bare ContextVar)
    token = inner.set(None)
    try:
        yield
    finally:
        inner.reset(token)
