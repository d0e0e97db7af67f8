"""Random-number and autocast state kept across recomputation, so a block run twice (once in
the forward pass, again in the backward pass) draws the same dropout masks as plain training.

The first execution of a block records the state; every re-execution runs inside
``replay(state)``, which sets the recorded state and puts the caller's state back afterwards,
so recomputation never advances the global generators.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Tuple

import torch


def cuda_devices_of(tensors: Iterable[object]) -> List[int]:
    """The CUDA device indices the given tensors live on (sorted, unique)."""
    devs = {t.device.index for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
    return sorted(d if d is not None else torch.cuda.current_device() for d in devs)


@dataclass
class RngState:
    cpu: torch.Tensor
    cuda: List[Tuple[int, torch.Tensor]]
    autocast: Tuple[Tuple[str, bool, Optional[torch.dtype]], ...]


def autocast_state() -> Tuple[Tuple[str, bool, Optional[torch.dtype]], ...]:
    """Whether autocast is on, and its dtype, for the CPU and CUDA: a recomputation runs
    under the settings of the first run (off where this torch cannot say per device)."""
    out = []
    for dev in ("cpu", "cuda"):
        try:
            enabled = torch.is_autocast_enabled(dev)
            dtype = torch.get_autocast_dtype(dev) if enabled else None
        except (TypeError, RuntimeError, AttributeError):  # older torch: no per-device query
            enabled, dtype = False, None
        out.append((dev, enabled, dtype))
    return tuple(out)


def capture(devices: Iterable[int] = ()) -> RngState:
    """The current CPU and CUDA generator states and autocast settings."""
    return RngState(cpu=torch.get_rng_state(),
                    cuda=[(d, torch.cuda.get_rng_state(d)) for d in devices],
                    autocast=autocast_state())


def _set(state: RngState) -> None:
    torch.set_rng_state(state.cpu)
    for d, s in state.cuda:
        torch.cuda.set_rng_state(s, d)


@contextlib.contextmanager
def replay(state: RngState) -> Iterator[None]:
    """Run the body with the generators (and autocast) as they were when ``state`` was captured;
    restore the caller's generator states afterwards."""
    mine = capture([d for d, _ in state.cuda])
    _set(state)
    try:
        with contextlib.ExitStack() as stack:
            # every device's setting, off ones too: a backward called inside autocast (it is
            # thread-local: autograd's threads inherit it) must not recompute in low precision
            for dev, enabled, dtype in state.autocast:
                stack.enter_context(torch.autocast(device_type=dev, dtype=dtype,
                                                   enabled=enabled))
            yield
    finally:
        _set(mine)


def restore(state: RngState) -> None:
    """Set the generators to ``state`` (and leave them there)."""
    _set(state)


def cast_cache_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the low-precision copies autocast's cast cache keeps of ``params`` until the
    autocast region ends, if autocast is on now for their device (else 0). Plain training under
    autocast holds every weight's copy at once by the end of the forward, beside the chain's
    items: a budget must count them. The cache keeps casts of float32 leaves that require grad
    (``cached_cast`` in ATen's autocast); the copies of those no op casts are counted too."""
    if not torch.is_autocast_cache_enabled():
        return 0
    on = {dev: dtype for dev, enabled, dtype in autocast_state() if enabled}
    return sum(p.numel() * on[p.device.type].itemsize
               for p in {id(p): p for p in params}.values()
               if p.device.type in on and p.dtype is torch.float32 and p.requires_grad
               and p.is_leaf)
