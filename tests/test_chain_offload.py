"""The chain step's offload side (``chain_offload.Offloader``) and the pieces both runtimes share
with it: what a step owns must not keep it alive, the collector interface matches the collector,
and one byte view serves every copy."""
import gc
import inspect
import weakref

import torch
from torch import nn

from scheduler.planners.mimose import plan_from_checkpoints
from scheduler.runtime.accounting import storage_bytes_view
from scheduler.runtime.chain_exec import ChainStep, Collector
from scheduler.runtime.compiled_plan import CompiledPlan
from scheduler.runtime.mimose_collector import ShuttlingCollector


def test_a_step_is_freed_by_reference_counting_alone():
    # the offloader links back to its step weakly, as a frame does: a strong link would be a
    # cycle that keeps a dropped step's checkpoints until a garbage collection
    blocks = [nn.Identity(), nn.Identity()]
    step = ChainStep(blocks, CompiledPlan.of(plan_from_checkpoints(2, []), 2), lambda *a: None)
    assert step.offloader.step is step
    ref = weakref.ref(step)
    gc.disable()
    try:
        del step
        assert ref() is None
    finally:
        gc.enable()


def test_the_collector_protocol_is_what_the_mimose_collector_offers():
    assert inspect.signature(Collector.measure) == \
        inspect.signature(ShuttlingCollector.measure)
    assert Collector not in ShuttlingCollector.__mro__  # (a Protocol: matched, not derived)


def test_storage_bytes_view_spans_the_whole_storage_whatever_the_view():
    base = torch.arange(12, dtype=torch.float32)
    view = base[3:7]   # an offset view: its storage is still all of base's bytes
    b = storage_bytes_view(view.untyped_storage())
    assert b.dtype == torch.uint8 and b.numel() == base.numel() * 4
    assert torch.equal(b.view(torch.float32), base)
    b.view(torch.float32)[5] = -1.0   # the same memory, not a copy
    assert view[2].item() == -1.0


def test_a_copy_dropped_before_its_prefetch_runs_no_python_code():
    # its host buffer is queued by a C callback (a Python finalizer is where a Ctrl-C's
    # KeyboardInterrupt would be lost: CPython only prints it), and goes at the next drain
    import sys
    from scheduler.runtime.chain_transfers import ChainTransfers
    engine = ChainTransfers(torch.device("cpu"))
    t = torch.randn(256)
    sc = engine.offload_storage(t.untyped_storage())
    ran = []
    sys.setprofile(lambda frame, event, arg: ran.append(frame.f_code.co_name)
                   if event == "call" else None)
    try:
        del sc
    finally:
        sys.setprofile(None)
    assert ran == [] and len(engine.dead) == 1
    engine.drain_orphans()
    assert engine.dead == [] and engine._watched == {}
    kept = engine.offload_storage(t.untyped_storage())  # a copy prefetched: nothing queued
    engine.prefetch_storage(kept)
    del kept
    assert engine.dead == [] and engine._watched == {}
