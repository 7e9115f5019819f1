"""The tinylm causal Transformer language model (GPT-2 style, pre-norm).

Reads top-down: config -> MLP -> Block -> TinyLM. The attention it is built on lives in
tinylm/attention.py, the KV cache in tinylm/kv_cache.py.

    from tinylm.model import ModelConfig, TinyLM
    model = TinyLM(ModelConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64))
    logits, loss, attentions = model(idx, targets, return_attention=True)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tinylm.attention import MultiHeadAttention
from tinylm.config import at_least, bad, check, within
from tinylm.fast import lm_head_cross_entropy
from tinylm.hooks import HookPoint, caching
from tinylm.kv_cache import KVCache, LayerCache


@dataclass
class ModelConfig:
    """Shape of the model; the schema of conf/model/*.yaml (defaults: here only)."""

    vocab_size: int | None = None  # None: taken from the tokenizer when training starts
    block_size: int = 128  # longest context, in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1  # the default run sees its ~1 MB corpus ~20 times: regularise
    bias: bool = False  # biases in Linear and LayerNorm layers

    def __post_init__(self):
        check(self, "model", vocab_size=at_least(1, null="to take it from the tokenizer"),
              block_size=at_least(1), n_layer=at_least(1), n_head=at_least(1),
              n_embd=at_least(1), dropout=within(0, 1, high_open=True))
        if self.n_embd % self.n_head:
            raise bad("model.n_embd", self.n_embd,
                      f"must be divisible by model.n_head={self.n_head}")

    def to_dict(self) -> dict:
        return asdict(self)


class LMOutput(NamedTuple):
    """What TinyLM.forward returns; unpacks as `logits, loss, attentions`."""

    logits: torch.Tensor | None  # (B, T, vocab_size); None when need_logits=False
    loss: torch.Tensor | None  # mean cross-entropy, only when targets are given
    attentions: list[torch.Tensor] | None  # per layer (B, n_head, T_q, T_k), when asked


class MLP(nn.Module):
    """Position-wise feed-forward: expand 4x, GELU, project back."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    Hook points (tinylm/hooks.py): hook_resid_pre, the residual stream coming in, and
    hook_resid_post, going out."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiHeadAttention(config.n_embd, config.n_head, config.dropout, config.bias)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.hook_resid_pre, self.hook_resid_post = HookPoint(), HookPoint()

    def forward(self, x: torch.Tensor, kv_cache: LayerCache | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = x + self.attn(self.ln_1(x), kv_cache)
        x = x + self.mlp(self.ln_2(x))
        return self.hook_resid_post(x)


class TinyLM(nn.Module):
    """Token + position embeddings, n_layer blocks, final norm, LM head tied to the embedding."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("model.vocab_size is unset: build the tokenizer first and set it")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embeddings
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embeddings
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: reading a token in and writing it out share one matrix (fewer
        # parameters, and it trains better at this size).
        self.lm_head.weight = self.wte.weight

        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * n_layer),
        # since 2 of them per block add up along the depth.
        for name, param in self.named_parameters():
            if name.endswith("attn.out_proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position embeddings (the token embedding
        is shared with the LM head, so it counts as compute)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty KVCache for every layer, on the model's device and dtype."""
        c, p = self.config, self.wte.weight
        return KVCache(c.n_layer, batch_size, c.n_head, max_len or c.block_size,
                       c.n_embd // c.n_head, dtype=p.dtype, device=p.device)

    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Token ids idx (B, T) at positions start.. -> the residual stream's start (B, T, C)."""
        T = idx.size(1)
        # positions start .. start+T-1 are consecutive rows of the position embedding
        return self.drop(self.wte(idx) + self.wpe.weight[start:start + T])

    def forward_from(self, layer: int, x: torch.Tensor, kv_cache: KVCache | None = None
                     ) -> torch.Tensor:
        """Blocks layer.. and the final norm on x (B, T, C), the residual stream into block
        `layer`: the states (B, T, C) the LM head reads."""
        for i, block in enumerate(self.blocks):
            if i >= layer:  # (a slice of a ModuleList builds a new module: slow per token)
                x = block(x, kv_cache.layer(i) if kv_cache is not None else None)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, return_attention: bool = False,
                need_logits: bool = True) -> LMOutput:
        """idx (B, T) token ids -> LMOutput(logits (B, T, V), loss, attentions).

        targets (B, T): next-token ids; -1 positions are ignored in the loss.
        kv_cache: from new_kv_cache(); idx then holds only the tokens not yet cached, which
        it takes in (its length grows by T).
        return_attention: also return every layer's weights, (B, n_head, T, T_k) each, read at
        the hook points blocks.{i}.attn.hook_pattern (tinylm/hooks.py).
        need_logits=False (with targets): only the loss, computed without the (B, T, V) logits
        (tinylm/fast.py), which makes a training step faster on a CPU; logits is None.
        """
        B, T = idx.size()
        start = kv_cache.length if kv_cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(
                f"sequence of {start + T} tokens is longer than block_size="
                f"{self.config.block_size}; crop it to the last {self.config.block_size} tokens")
        attentions = None
        if return_attention:
            with caching(self, ["hook_pattern"], detach=False) as cache:
                x = self.forward_from(0, self.embed(idx, start), kv_cache)  # (B, T, C)
            attentions = [cache[f"blocks.{i}.attn.hook_pattern"] for i in range(len(self.blocks))]
        else:
            x = self.forward_from(0, self.embed(idx, start), kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)  # every layer has stored its T new positions
        if not need_logits:  # training's faster loss (tinylm/fast.py): the logits never exist
            if targets is None:
                raise ValueError("need_logits=False leaves only the loss: pass targets too")
            loss = lm_head_cross_entropy(x.reshape(B * T, -1), self.lm_head.weight,
                                         targets.reshape(-1), ignore_index=-1)
            return LMOutput(None, loss, attentions)

        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-1)
        return LMOutput(logits, loss, attentions)
