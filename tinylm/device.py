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


def has_fast_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices in hardware: CUDA GPUs that support bf16, CPUs
    with AVX512-BF16 or AMX. Elsewhere PyTorch emulates bf16, many times slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = torch.cpu
        return getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or \
            getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    return False
