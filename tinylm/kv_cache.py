"""The KV cache: every attention layer's keys and values, kept across decoding steps.

Decoding one token at a time, each step's query attends over all earlier positions; their keys
and values do not change, so they are kept here instead of recomputed (tinylm/generate.py):

    cache = model.new_kv_cache(batch_size=1)
    logits = model(prompt, kv_cache=cache).logits       # the prompt's keys/values stored
    logits = model(next_token, kv_cache=cache).logits   # one more position
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KVCache:
    """Keys and values of every attention layer, kept across decoding steps.

    Preallocated to `max_len` positions so that each step writes in place instead of
    concatenating (which would copy the whole cache at every token). Each layer writes its new
    keys/values through its `layer(i)` slot; the model then calls `advance(T)` once, after the
    last layer, so all layers always hold the same `length` positions.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (n_layer, batch_size, n_head, max_len, head_size)
        self._k = torch.zeros(shape, dtype=dtype, device=device)
        self._v = torch.zeros(shape, dtype=dtype, device=device)
        # each layer's view, made once: indexing the 5-d buffers anew costs more than the write
        # itself at one token a step
        self._layer_k = [self._k[i] for i in range(n_layer)]
        self._layer_v = [self._v[i] for i in range(n_layer)]
        self._length = 0

    @property
    def length(self) -> int:
        """Positions cached so far; the next token's position."""
        return self._length

    @property
    def max_len(self) -> int:
        return self._k.size(3)

    def layer(self, i: int) -> LayerCache:
        """Layer i's slot, which MultiHeadAttention writes to."""
        return LayerCache(self, i)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys/values (B, nh, T_new, hs) after the cached positions;
        return that layer's keys/values up to them (B, nh, length + T_new, hs)."""
        start, new = self._length, k.size(2)
        if start + new > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {start + new} were "
                             "asked for")
        keys, values = self._layer_k[layer], self._layer_v[layer]  # (B, nh, max_len, hs)
        keys.narrow(2, start, new).copy_(k)
        values.narrow(2, start, new).copy_(v)
        return keys.narrow(2, 0, start + new), values.narrow(2, 0, start + new)

    def advance(self, n: int) -> None:
        """Count n new positions as cached, once every layer has written them."""
        if n < 0 or self._length + n > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; cannot advance "
                             f"{self._length} by {n}")
        self._length += n

    def reset(self) -> None:
        """Forget every position; the buffers are kept and overwritten by the next writes."""
        self._length = 0

    def rewind(self, pos: int) -> None:
        """Keep only the first `pos` positions (0 <= pos <= length); the next token goes at pos."""
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos <= self._length:
            raise ValueError(f"cannot rewind the KV cache to position {pos!r}: it must be an "
                             f"integer from 0 to the {self._length} positions cached")
        self._length = pos


class LayerCache(NamedTuple):
    """One layer's slot in a KVCache (KVCache.layer(i))."""

    cache: KVCache
    index: int

    @property
    def length(self) -> int:
        """Positions cached before this step's; the position of its first new token."""
        return self.cache.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values (B, nh, T_new, hs); return all cached so far (B, nh, T, hs).

        The cache's length moves on only at KVCache.advance, after the last layer.
        """
        return self.cache.write(self.index, k, v)
