"""What the tab's arithmetic panel needs of one text: each head's q, k and v and the weights the
forward pass gave, read at the hook points (tinylm/hooks.py) when the text is captured; and what a
layer hides besides the causal mask, said as a band. tensorboard_plugin/summary.py writes them and
plugin.py serves them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tinylm.attention import causal_mask
from tinylm.hooks import caching

MASK_POSITIONS = 4096  # how far a layer's mask is looked at to find its band
MAX_STORED = 2**22  # float32 numbers per text: 16 MiB (why: summary.write_attention)
ARCHITECTURES = {"TinyLM": "tinylm", "GPT2LM": "GPT-2", "GPTNeoLM": "GPT-Neo",
                 "LlamaLM": "Llama-family"}


@dataclass
class LayerNumbers:
    """One layer's stored numbers and how it attends."""

    layer: int
    n_kv_head: int  # key/value heads: query head h reads h // (n_head // n_kv_head)
    scale: float | None  # multiplies q·k; None: 1/√d
    window: int | None  # a local layer: each query sees only the last `window` positions
    rotary: bool  # q and k were rotated by position before the hook points
    flat: np.ndarray  # float32: q (nh, T, hs), k, v (nkv, T, hs), weights' lower triangle

    def meta(self) -> dict:
        return {"layer": self.layer, "n_kv_head": self.n_kv_head, "scale": self.scale,
                "window": self.window, "rotary": self.rotary}


@dataclass
class ArithmeticCapture:
    """What the arithmetic panel needs of one text: each kept layer's q, k, v and weights."""

    architecture: str
    n_layer: int
    n_head: int
    head_size: int
    tokens: int  # T
    dtype: str  # what the model computed q, k, v in ("float32", "bfloat16")
    layers: list[LayerNumbers] = field(default_factory=list)
    not_stored: str = ""  # why the other layers are missing; "" when every layer is kept

    @property
    def size(self) -> int:
        return sum(layer.flat.size for layer in self.layers)


def layer_numbers(n_head: int, n_kv_head: int, head_size: int, t: int) -> int:
    """How many numbers one layer stores: q, k, v and its weights' lower triangle."""
    return (n_head + 2 * n_kv_head) * t * head_size + n_head * t * (t + 1) // 2


def layer_window(attn, positions: int) -> tuple[int | None, bool]:
    """(w, ok): the band of keys the layer's mask keeps besides the causal one (None: it hides
    no more than that), and whether what it hides is such a band at all (the route recomputes
    only bands); its mask is looked at over `positions` positions."""
    causal = causal_mask(positions, positions)
    hidden = attn.hidden(positions, positions, "cpu")
    if hidden is None or torch.equal(hidden.cpu() | causal, causal):
        return None, True
    window = band_width(hidden.cpu() | causal)
    return window, window is not None


def arithmetic_layers(model, t: int, budget: int = MAX_STORED
                      ) -> tuple[list[tuple[int, int | None]], str]:
    """The layers 0, 1, ... whose q, k, v and weights over t tokens fit in `budget` numbers, each
    with its band (layer_window), and why the others are not kept ("" when every one is)."""
    positions = min(int(model.config.block_size), MASK_POSITIONS)
    kept, not_band, why, total = [], [], [], 0
    for i, block in enumerate(model.blocks):
        attn = block.attn
        window, band = layer_window(attn, positions)
        if not band:
            not_band.append(i)
            continue
        size = layer_numbers(attn.n_head, getattr(attn, "n_kv_head", attn.n_head),
                             attn.head_size, t)
        if total + size > budget:
            why.append(f"layer {i} and later do not fit in the {budget:,} numbers kept per text "
                       f"(a layer's q, k, v and weights over {t} tokens are {size:,}): inspect "
                       "a shorter text to see them")
            break
        kept.append((i, window))
        total += size
    if not_band:
        why.insert(0, f"layers {', '.join(map(str, not_band))} hide more than a band of "
                   "earlier positions")
    return kept, "; ".join(why)


POINTS = ("hook_q", "hook_k", "hook_v", "hook_pattern")


def arithmetic_names(kept: list[tuple[int, int | None]]) -> list[str]:
    """The hook points a forward pass must cache for arithmetic_from: the kept layers' q, k, v
    and weights."""
    return [f"blocks.{i}.attn.{p}" for i, _ in kept for p in POINTS]


def arithmetic_from(model, cache: dict[str, torch.Tensor], t: int,
                    kept: list[tuple[int, int | None]], not_stored: str) -> ArithmeticCapture:
    """The ArithmeticCapture of one text's forward pass, from its cache of arithmetic_names."""
    name, blocks = type(model).__name__, model.blocks
    first = blocks[0].attn
    numbers = ArithmeticCapture(ARCHITECTURES.get(name, name), len(blocks), first.n_head,
                                first.head_size, t, "float32", not_stored=not_stored)
    rows, cols = np.tril_indices(t)
    for i, window in kept:
        attn = blocks[i].attn
        q, k, v, w = (cache[f"blocks.{i}.attn.{p}"][0] for p in POINTS)
        numbers.dtype = str(q.dtype).removeprefix("torch.")
        w = w.float().cpu().numpy()[:, rows, cols]  # (nh, T(T+1)/2): the causal triangle
        flat = np.concatenate([x.float().cpu().numpy().ravel() for x in (q, k, v)] + [w.ravel()])
        numbers.layers.append(LayerNumbers(
            i, k.size(0), None if attn.scale is None else float(attn.scale), window,
            hasattr(attn, "rotary"), flat.astype("<f4")))
    return numbers


@torch.inference_mode()
def capture_arithmetic(model, ids, budget: int = MAX_STORED) -> ArithmeticCapture:
    """One forward pass over token ids (T,) reading the q, k, v and weights of layers 0, 1, ...
    while they fit in `budget` numbers, at their hook points (tinylm.hooks.caching)."""
    device = next(model.parameters()).device
    idx = torch.as_tensor(ids, dtype=torch.long, device=device).reshape(1, -1)
    kept, not_stored = arithmetic_layers(model, idx.size(1), budget)
    cache = {}
    if kept:
        # every layer's weights are read, as capture_attention reads them, so that every layer
        # takes the same (explicit) path and the numbers are the ones the tab's weights come from
        with caching(model, [*arithmetic_names(kept), "hook_pattern"]) as cache:
            model(idx)
    return arithmetic_from(model, cache, idx.size(1), kept, not_stored)


def band_width(hidden: torch.Tensor) -> int | None:
    """w where the visible positions (~hidden, (T, T)) are a band, query i seeing keys i-w+1..i;
    None for any other mask."""
    T = hidden.size(0)
    w = int((~hidden).sum(-1).max())
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return w if torch.equal(~hidden, (j <= i) & (j > i - w)) else None
