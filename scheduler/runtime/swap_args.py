"""The swap runtime's arguments (``scheduler.swap``, ``install_global``), checked where they are
given, with errors that name the argument and its value.

``window`` means what ``VMALLOC_WINDOW`` means: a size (0 here: no look-ahead). The budget is
every entry point's (``options.parse_budget``): positive or ``None``, which caps nothing; a 0
is refused rather than read as "no cap" (``VMALLOC_BUDGET=0`` reaches the runtime as ``None``).
"""
from __future__ import annotations

from typing import Any

import torch

from vmalloc.pluggable.register import cuda_present
from vmalloc.sizes import SizeLike, parse_size

_DEVICES = "'cuda', 'cuda:N', 'cpu', a CUDA device index or a torch.device"


def window_arg(window: SizeLike, where: str) -> int:
    """The window in bytes: a size >= 0 (``"2GiB"``, ints). 0 is no look-ahead: each saved
    tensor is fetched for its next use only (``VMALLOC_WINDOW=0`` is refused instead: set in
    the environment, it would read as "off")."""
    return parse_size(window, f"{where}: window")


def device_arg(device: Any, where: str) -> torch.device:
    """Which tensors to manage: a CUDA device (when CUDA is available) or the CPU; ``None``:
    ``"cuda"`` if available, else ``"cpu"``. Asked without starting the driver where NVML
    answers (``cuda_present``): ``VMALLOC_WINDOW`` builds the runtime at ``import torch``, and a
    ``cuInit`` there would leave a program that forks CUDA workers next unable to use CUDA in
    them."""
    if device is None:
        return torch.device("cuda" if cuda_present(torch) else "cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"{where}: device must be {_DEVICES}, got {device!r}")
    if isinstance(device, int):  # torch.device(5) is the current accelerator's: CUDA here
        if device < 0:
            raise ValueError(f"{where}: device must be {_DEVICES}, got {device!r}")
        dev = torch.device("cuda", device)
    else:
        try:
            dev = torch.device(device)
        except RuntimeError:  # torch's message lists every device type but names no argument
            raise ValueError(f"{where}: device must be {_DEVICES}, got {device!r}") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"{where}: device must be a cuda or cpu device ({_DEVICES}), got "
                         f"{device!r}")
    if dev.type == "cuda":
        if not cuda_present(torch):
            raise ValueError(f"{where}: device={device!r}: CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{where}: device={device!r}: there are "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return dev
