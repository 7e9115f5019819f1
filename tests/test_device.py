"""Device and precision choice on the CPU (tests/test_cuda.py covers CUDA)."""

import pytest
import torch

from tinylm.device import has_fast_bf16, resolve_device
from tinylm.train.runtime import resolve_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(("avx512_bf16", "amx", "fast"), [
    (True, False, True), (False, True, True), (False, False, False)])
def test_auto_precision_is_bf16_only_on_cpus_with_bf16_instructions(
        monkeypatch, avx512_bf16, amx, fast):
    """Elsewhere bf16 is emulated: ~80x slower than fp32 on an AVX2-only CPU."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16,
                        raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert has_fast_bf16(CPU) is fast
    assert resolve_precision("auto", CPU) == (torch.bfloat16 if fast else torch.float32)
    assert resolve_precision("bf16", CPU) == torch.bfloat16  # asked for by name: given


def test_a_device_that_is_not_one_is_refused_naming_the_allowed_ones():
    assert resolve_device("cpu") == CPU
    with pytest.raises(ValueError, match=r"device='gpu' is not a device; allowed: auto, cpu"):
        resolve_device("gpu")
