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
                                                   enabled=enabled, cache_enabled=False))
            yield
    finally:
        _set(mine)


@contextlib.contextmanager
def casts_uncached() -> Iterator[None]:
    """The body's autocast casts not cached. Inside ``torch.autocast`` PyTorch keeps the
    low-precision copy of every weight a block casts until the autocast region ends: a forward
    under a budget would hold every block's copy at once, bytes no chain measurement sees (its
    casts hit the cache). Uncached, a block's copies live as its other intermediates do (freed
    after it, or saved by its graph) and are measured with them; the values are the same."""
    if not any(enabled for _, enabled, _ in autocast_state()):
        yield
        return
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


def restore(state: RngState) -> None:
    """Set the generators to ``state`` (and leave them there)."""
    _set(state)
