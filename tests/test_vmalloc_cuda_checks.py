"""The CUDA-facing checks of vmalloc's registration, on the CPU with fakes (a GPU machine
cannot show most of them either: they are about what happens around the driver).

- availability is asked without ``cuInit`` (NVML), so ``VMALLOC=1`` and ``VMALLOC_WINDOW`` (the
  swap runtime's device, chosen at ``import torch``) leave forking possible;
- the device index of "the current device" is not asked before CUDA started (an exit report
  would start it);
- a report of "the current device" is of a device vmalloc used;
- ``record_stream`` is not optional;
- ``pool(device=k)`` makes its MemPool on device k, and vmalloc's cache is trimmed when
  PyTorch empties its own and when the block ends.
"""
import contextlib
import types

import pytest
import torch

from vmalloc.pluggable import live_report, register, registry


def fake_cuda(initialized=False, compiled=True, nvml=1, available=None):
    def is_available():
        if available is None:
            raise AssertionError("is_available() runs cuInit: it must not be asked")
        return available

    def nvml_count():
        if isinstance(nvml, Exception):
            raise nvml
        return nvml

    cuda = types.SimpleNamespace(is_initialized=lambda: initialized, device_count=lambda: 1,
                                 _is_compiled=lambda: compiled, _device_count_nvml=nvml_count,
                                 is_available=is_available)
    return types.SimpleNamespace(cuda=cuda)


@pytest.mark.parametrize("kw, present", [
    (dict(nvml=1), True),
    (dict(nvml=0), False),
    (dict(compiled=False), False),
    (dict(initialized=True), True),
    (dict(nvml=-1, available=True), True),              # NVML cannot answer: CUDA does
    (dict(nvml=OSError("no libnvidia-ml"), available=False), False),
])
def test_cuda_present_asks_nvml_before_cuda(kw, present):
    assert register.cuda_present(fake_cuda(**kw)) is present


@pytest.mark.parametrize("device", [None, "cuda"])
def test_swap_runtime_device_does_not_start_cuda(monkeypatch, device):
    """``VMALLOC_WINDOW`` builds the swap runtime at ``import torch``: before, its default
    device came from ``torch.cuda.is_available()`` (``cuInit``: a forked child of the program
    could not use CUDA any more)."""
    from scheduler.runtime.swap_args import device_arg

    def cuinit():
        raise AssertionError("is_available() runs cuInit: it must not be asked")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", cuinit)
    assert device_arg(device, "scheduler.swap") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 0)
    if device is None:
        assert device_arg(device, "scheduler.swap") == torch.device("cpu")
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            device_arg(device, "scheduler.swap")


def test_device_index_does_not_start_cuda(monkeypatch):
    asked = []   # current_device() would start CUDA (it answers 5 here, as if it had)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append(1) or 5)
    assert registry.device_index(None) == 0
    assert registry.device_index("cuda:1") == 1
    assert not asked
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert registry.device_index(None) == 5


@pytest.mark.parametrize("used, current, expect", [
    ([1], 0, (1, [])),          # only cuda:1 used, no set_device: its report, not cuda:0's zeros
    ([0, 1], 0, (0, [1])),      # the current one, the other named in the title
    ([0, 1], 1, (1, [0])),
    ([], 0, (0, [])),           # nothing allocated yet
])
def test_report_device_is_one_vmalloc_used(monkeypatch, used, current, expect):
    monkeypatch.setattr(live_report, "devices", lambda: list(used))
    monkeypatch.setattr(live_report, "device_index", lambda d: current if d is None else d)
    assert live_report._report_device(None) == expect
    assert live_report._report_device(3) == (3, [])


def test_record_stream_hook_is_required():
    raw = types.SimpleNamespace()   # a PyTorch whose pluggable allocator has no hooks at all
    with pytest.raises(RuntimeError, match="set_record_stream_fn"):
        register._wire_hooks(None, raw)


def test_pool_mode_empty_cache_also_trims_vmalloc(monkeypatch):
    calls = []
    monkeypatch.setattr(registry.REGISTRY, "patched", {})
    monkeypatch.setattr(torch._C, "_cuda_emptyCache", lambda: calls.append("torch"),
                        raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_emptyCache", lambda: calls.append("acc"),
                        raising=False)
    monkeypatch.setattr(register, "core",
                        lambda: types.SimpleNamespace(_torch_trim=lambda: calls.append("trim")))
    register._trim_on_empty_cache(torch)
    register._trim_on_empty_cache(torch)   # once only: no wrapper around the wrapper
    torch._C._cuda_emptyCache()
    torch._C._accelerator_emptyCache()
    assert calls == ["torch", "trim", "acc", "trim"]


def test_pool_makes_its_mempool_on_its_device_and_trims_at_exit(monkeypatch):
    current, log = [0], []

    @contextlib.contextmanager
    def device(d):
        prev, current[0] = current[0], d
        try:
            yield
        finally:
            current[0] = prev

    class MemPool:
        def __init__(self, allocator):
            log.append(("mempool on", current[0]))

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        log.append(("use", device))
        yield

    native = types.SimpleNamespace(_torch_configure=lambda *a: None,
                                   _torch_trim=lambda: log.append(("trim",)))
    monkeypatch.setattr(registry.REGISTRY, "patched", {"_cuda_emptyCache": None, "_accelerator_emptyCache": None})
    monkeypatch.setattr(registry.REGISTRY, "mode", None)
    monkeypatch.setattr(registry.REGISTRY, "config", {})
    monkeypatch.setattr(register, "_require_cuda", lambda torch, who: None)
    monkeypatch.setattr(register, "core", lambda: native)
    monkeypatch.setattr(register, "_pool_allocator",
                        lambda torch, native: types.SimpleNamespace(allocator=lambda: "raw"))
    monkeypatch.setattr(torch.cuda, "MemPool", MemPool, raising=False)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool, raising=False)
    monkeypatch.setattr(torch.cuda, "device", device)
    with pytest.raises(KeyError):
        with register.pool(device=1):
            log.append(("body",))
            raise KeyError("the block raised")    # the trim runs all the same
    assert log == [("mempool on", 1), ("use", 1), ("body",), ("trim",)]


def test_graph_capture_is_refused_before_its_stream_is_entered(monkeypatch):
    from vmalloc.pluggable import shims
    entered = []
    graph = torch.cuda.graphs.graph
    monkeypatch.setattr(graph, "__enter__", lambda self: entered.append("stream + capture"))
    monkeypatch.setattr(registry.REGISTRY, "patched", {})
    monkeypatch.setattr(registry.REGISTRY, "mode", "global")
    shims.refuse_graph_capture_early(torch)
    shims.refuse_graph_capture_early(torch)   # once: no wrapper around the wrapper
    dummy = object.__new__(graph)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        graph.__enter__(dummy)
    assert entered == []   # the side stream never became current
    monkeypatch.setattr(registry.REGISTRY, "mode", "pool")   # PyTorch's allocator captures
    graph.__enter__(dummy)
    assert entered == ["stream + capture"]
