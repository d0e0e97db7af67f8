"""The host-device bandwidth every transferring planner assumes unless told (``bandwidth=``).

On a GPU it is measured once per process and device: a pinned host buffer of
``PROBE_BYTES`` is copied to the device and back (after one warm-up copy), and the slower
direction is kept (offload and prefetch both move every byte). On the CPU, or when no device
is given and CUDA is absent, it is the documented constant ``CPU_DEFAULT`` (12e9 bytes/s, a
PCIe 3.0 x16 link), so plans stay reproducible on machines without a GPU.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional

CPU_DEFAULT = 12e9          # bytes/s when there is no device to measure
PROBE_BYTES = 256 << 20     # bytes copied each way by the measurement

_measured: Dict[int, float] = {}
_lock = threading.Lock()


def _probe(index: int) -> float:
    import torch

    with torch.cuda.device(index):
        host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream(index)
        # the probe may run mid-step (a planner's first plan, an autograd final callback),
        # with kernels still queued on the current stream, and its buffer may be a block those
        # kernels still read (freed in stream order): the probe's stream waits for them before
        # it writes. The buffer belongs to the current stream (allocated there), so the caching
        # allocator can hand it to the step again afterwards: the copies are done by then
        # (each is synchronized), so nothing on the probe's stream still uses it.
        dev = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
        stream.wait_stream(torch.cuda.current_stream(index))
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)  # warm-up (first-touch, lazy init)
            times = []
            for src, dst in ((host, dev), (dev, host)):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        del host, dev
    return PROBE_BYTES / max(max(times), 1e-9)


def default_bandwidth(device: Optional[Any] = None) -> float:
    """Bytes/s between host and ``device`` (a ``torch.device``, a string or a CUDA index;
    ``None``: the current CUDA device if CUDA is available). Measured once per device and
    process on a GPU, ``CPU_DEFAULT`` otherwise."""
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return CPU_DEFAULT
        index = torch.cuda.current_device()
    else:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            return CPU_DEFAULT
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _measured:
            _measured[index] = _probe(index)
        return _measured[index]
