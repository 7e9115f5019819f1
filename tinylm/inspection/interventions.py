"""Changing heads' outputs through the hook points (tinylm/hooks.py): ablation and patching.

A head's output is its slice of blocks.{layer}.attn.hook_z, (B, nh, T, hs), before the heads are
concatenated and projected:

    with heads_scaled(model, mask):                  # mask (n_layer, n_head): 0 zero-ablates
        logits = model(idx).logits
    with head_replaced(model, 2, 1, means[2][:, 1]): # values (T, hs), e.g. its mean output
        logits = model(idx).logits
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tinylm.hooks import hooks


@contextmanager
def heads_scaled(model, mask: torch.Tensor) -> Iterator[None]:
    """Inside: each head's output multiplied by mask[layer, head] (0: the head removed)."""
    mask = mask.to(next(model.parameters()).device)

    def scale(layer: int):
        def fn(z: torch.Tensor) -> torch.Tensor:  # z (B, nh, T, hs)
            if mask.size(1) != z.size(1):  # broadcasting would say less, or scale the wrong heads
                raise ValueError(f"heads_scaled: a mask of {mask.size(1)} heads per layer, but "
                                 f"layer {layer} has {z.size(1)}")
            return z * mask[layer].view(1, -1, 1, 1).to(z.dtype)
        return fn
    # a layer whose factors are all 1 keeps its hook point unhooked: its numbers stay untouched
    with hooks(model, {f"blocks.{layer}.attn.hook_z": scale(layer)
                       for layer in range(mask.size(0)) if not bool((mask[layer] == 1).all())}):
        yield


@contextmanager
def head_replaced(model, layer: int, head: int, values: torch.Tensor,
                  where: torch.Tensor | None = None) -> Iterator[None]:
    """Inside: head `head` of layer `layer` outputs `values` (..., T_v, hs) at positions
    0..T-1 of every sequence, where `where` (B, T) is True (None: at every position)."""
    def replace(z: torch.Tensor) -> torch.Tensor:  # z (B, nh, T, hs)
        T, hs = z.size(2), z.size(3)
        if values.size(-1) != hs:
            raise ValueError(f"head_replaced: values of shape {tuple(values.shape)}; a head's "
                             f"output in layer {layer} is (positions, {hs})")
        if T > values.size(-2):  # the positions past the values would keep their own
            raise ValueError(f"a sequence of {T} tokens, but values for only "
                             f"{values.size(-2)} positions to put in head {head}")
        new = values[..., :T, :].to(device=z.device, dtype=z.dtype)
        z = z.clone()  # the hook point's input may be a view the caller still holds
        z[:, head] = new if where is None else torch.where(where[..., None], new, z[:, head])
        return z
    with hooks(model, {f"blocks.{layer}.attn.hook_z": replace}):
        yield
