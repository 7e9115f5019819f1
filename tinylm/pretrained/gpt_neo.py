"""GPT-Neo (the TinyStories models among them) in tinylm's TinyLM.

GPT-Neo is GPT-2's shape with two departures in its attention: q·kᵀ is not divided by √d, and
its local layers (every other one in the TinyStories models) let a query see only the last
`window_size` positions, itself included: their causal mask is a band (docs/pretrained.md draws
it). q, k and v are three projections without biases, stacked here into tinylm's qkv_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import tinylm.pretrained.common as common
from tinylm.attention import MultiHeadAttention
from tinylm.config import at_least, bad
from tinylm.pretrained.common import WEIGHTS_FILE, refused
from tinylm.pretrained.gpt2 import (  # noqa: F401  (GPT-2's blocks h.{i}. and tokenizer)
    ACTIVATIONS,
    BLOCK,
    BLOCK_NAMES,
    GPT2LM,
    GPT2Config,
    read_tokenizer,
    shared_checks,
    table,
)

MODEL_TYPES = ("gpt_neo",)
PADDED_VOCABULARY = False
SHAPE = {"vocab_size": "vocab_size", "block_size": "max_position_embeddings",
         "n_layer": "num_layers", "n_head": "num_heads", "n_embd": "hidden_size"}
DEFAULTS = {"vocab_size": 50257, "max_position_embeddings": 2048, "num_layers": 24,
            "num_heads": 16, "hidden_size": 2048, "intermediate_size": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "attention_types": [[["global", "local"], 12]], "window_size": 256}
# GPT-Neo keeps q, k and v apart, without biases (None: zeros)
NEO_BLOCK_NAMES = {
    **BLOCK_NAMES,
    "attn.qkv_proj.weight": tuple(f"attn.attention.{x}_proj.weight" for x in "qkv"),
    "attn.qkv_proj.bias": None,
    "attn.out_proj.weight": "attn.attention.out_proj.weight",
    "attn.out_proj.bias": "attn.attention.out_proj.bias",
}


@dataclass
class GPTNeoConfig(GPT2Config):
    """A GPT2Config with GPT-Neo's local layers."""

    attention_layers: list[str] | None = None  # per layer: global | local; None: all global
    window_size: int | None = None  # positions a local layer's query sees, itself included

    def __post_init__(self):
        super().__post_init__()
        at_least(1, null="without local layers")("model.window_size", self.window_size)
        layers = self.attention_layers
        if layers is not None and (not isinstance(layers, list) or len(layers) != self.n_layer
                                   or not set(layers) <= {"global", "local"}):
            raise bad("model.attention_layers", layers, f"must list global or local for each of "
                      f"the {self.n_layer} layers, or be null for all global")
        if layers and "local" in layers and self.window_size is None:
            raise bad("model.window_size", None, "must be an integer >= 1 where "
                      "model.attention_layers has local layers: the positions they see")


class LocalAttention(MultiHeadAttention):
    """A local layer: each query sees the last `window` positions, itself included."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, window: int):
        super().__init__(n_embd, n_head, dropout, bias)
        self.window = window

    def hidden(self, t_q: int, t_k: int, device: torch.device | str) -> torch.Tensor | None:
        """The keys `window` or more positions back (query i sits at t_k - t_q + i); None while
        no key is that far back, which leaves the plain causal mask (and the fused kernel)."""
        if t_k <= self.window:
            return None
        return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(
            diagonal=t_k - t_q - self.window)


class GPTNeoLM(GPT2LM):
    """GPT2LM with GPT-Neo's local layers."""

    def __init__(self, config: GPTNeoConfig):
        super().__init__(config)
        for i, block in enumerate(self.blocks):
            if config.attention_layers is not None and config.attention_layers[i] == "local":
                local = LocalAttention(config.n_embd, config.n_head, config.dropout, config.bias,
                                       config.window_size)
                local.scale = block.attn.scale
                block.attn = local


def _layer_kinds(types, layers: int, where: Path) -> list:
    """GPT-Neo's attention_types expanded: [[["global", "local"], 2]] is 4 layers, local 2nd
    and 4th. The count is checked first against the weights' `layers`, since each repeat
    is a number the file chose."""
    rule = (f'it must be [[["global", "local"], repeat], ...] making the {layers} layers '
            f"its {WEIGHTS_FILE} holds")
    pairs = types if isinstance(types, list) else [None]
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], list)
                and type(pair[1]) is int and pair[1] >= 0):
            raise refused(where, "attention_types", types, rule)
    if sum(len(kinds) * repeat for kinds, repeat in types) != layers:
        raise refused(where, "attention_types", types, rule)
    return [kind for kinds, repeat in types for _ in range(repeat) for kind in kinds]


def read_config(hf: dict, where: Path, layers: int) -> GPTNeoConfig:
    """The GPTNeoConfig of a transformers GPT-Neo config.json whose weights hold `layers`
    blocks."""
    hf = {**DEFAULTS, **hf}
    shape = common.shape_of(hf, SHAPE, where, layers)
    shared_checks(hf, where, "intermediate_size", shape["n_embd"])
    kinds = hf.get("attention_layers") or _layer_kinds(hf["attention_types"], layers, where)
    return common.built(GPTNeoConfig, where, **shape, bias=True,
                        activation=ACTIVATIONS[hf["activation_function"]],
                        attention_scale=False,  # GPT-Neo: q·kᵀ unscaled
                        attention_layers=kinds, window_size=hf["window_size"])


def load(file: Path, model: GPTNeoLM) -> None:
    """The model's weights from a GPT-Neo safetensors file, into `model` built on meta."""
    common.load_weights(file, model, table(model.config.n_layer, NEO_BLOCK_NAMES))
