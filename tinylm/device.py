"""Choosing the device: CUDA when present, the CPU everywhere else."""

from __future__ import annotations

import torch


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> cuda if available else cpu; otherwise the named device, checked to exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device={name!r} is not a device; allowed: auto, cpu, cuda, "
                         "cuda:N, mps") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available here; "
                         "use device=auto or device=cpu")
    return device
