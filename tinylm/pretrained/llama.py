"""The Llama family (Llama 2 and 3, TinyLlama, SmolLM2, Qwen2 and Qwen2.5, Mistral without a
sliding window) on tinylm's own attention.

    checkpoint=hf:HuggingFaceTB/SmolLM2-135M     or a folder with its config.json,
                                                 model.safetensors and tokenizer.json

A Llama block is tinylm's pre-norm block with four departures, each a small module below:
- RMSNorm instead of LayerNorm: x / rms(x) · weight, no mean subtracted, no bias.
- Rotary positions (RoPE) instead of a position embedding: q and k are turned by an angle that
  grows with the position, so that q·k depends on how far apart two tokens are.
- Grouped-query attention: fewer key/value heads than query heads (n_kv_head), each shared by a
  group of consecutive query heads; the KV cache holds only those.
- A SwiGLU MLP: down(silu(gate(x)) · up(x)).
The attention itself, softmax(q·kᵀ/√d)·v, is MultiHeadAttention's, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tinylm.pretrained.common as common
from tinylm.attention import AttentionSteps, MultiHeadAttention
from tinylm.config import at_least, bad, check, within
from tinylm.hooks import HookPoint
from tinylm.kv_cache import KVCache
from tinylm.model import Block, ModelConfig, TinyLM
from tinylm.pretrained.common import refused
from tinylm.tokenizer import Tokenizer, load_tokenizer

PADDED_VOCABULARY = True  # Qwen2.5 rounds its rows up
MODEL_TYPES = ("llama", "qwen2", "mistral")
BLOCK = r"model\.layers\.(\d+)\."  # a block's weights start model.layers.{i}.
SHAPE = {"vocab_size": "vocab_size", "block_size": "max_position_embeddings",
         "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size"}
# transformers' defaults, which a config.json may leave out
COMMON_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "num_key_value_heads": None,
                   "head_dim": None, "tie_word_embeddings": False, "attention_bias": False,
                   "mlp_bias": False, "sliding_window": None, "eos_token_id": 2}
DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32,
              "max_position_embeddings": 2048},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "use_sliding_window": False,
              "sliding_window": 4096, "eos_token_id": None},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
}
# what the architecture fixes whatever its config.json says: Qwen2's q, k, v have biases
FIXED = {"qwen2": {"attention_bias": True, "mlp_bias": False},
         "mistral": {"attention_bias": False, "mlp_bias": False}}
# rotary scalings written here, and the numbers each takes from config.json
ROPE_SCALINGS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                            "original_max_position_embeddings")}


@dataclass
class LlamaConfig(ModelConfig):
    """TinyLM's shape, and where a Llama departs from it."""

    n_kv_head: int | None = None  # key/value heads, each shared by n_head/n_kv_head query heads
    intermediate_size: int = 344  # SwiGLU's hidden width (~8/3 of the default n_embd)
    rope_theta: float = 10000.0  # the slowest rotary pair turns once per ~2π·theta positions
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", ...}; None: plain
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True  # the LM head is the token embedding
    attention_bias: bool = False  # biases in q_proj, k_proj, v_proj (Qwen2)
    out_proj_bias: bool = False  # a bias in out_proj (Llama's attention_bias: with the three)
    mlp_bias: bool = False

    def __post_init__(self):
        super().__post_init__()
        check(self, "model", n_kv_head=at_least(1, null="for as many as model.n_head"),
              intermediate_size=at_least(1), rope_theta=within(0, low_open=True),
              rms_norm_eps=within(0, low_open=True))
        if self.n_head % self.kv_heads:
            raise bad("model.n_kv_head", self.n_kv_head, f"must divide model.n_head="
                      f"{self.n_head}: each key/value head serves a group of query heads")
        if (self.n_embd // self.n_head) % 2:
            raise bad("model.n_embd", self.n_embd, "n_embd / n_head must be even: rotary "
                      "positions turn pairs of a head's dimensions")
        scaling = self.rope_scaling or {}  # its rope_type one of ROPE_SCALINGS (read_config)
        for name in ROPE_SCALINGS.get(scaling.get("rope_type"), ()):
            within(0, low_open=True)(f"model.rope_scaling.{name}", scaling[name])
        if scaling.get("rope_type") == "llama3" and (
                scaling["high_freq_factor"] <= scaling["low_freq_factor"]):
            raise bad("model.rope_scaling.high_freq_factor", scaling["high_freq_factor"],
                      "must be above low_freq_factor: the band between them is blended")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head


# ---- modules ----------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) · weight: LayerNorm without subtracting the mean, and without a bias."""

    def __init__(self, n_embd: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_embd))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32: the mean of squares of bf16 activations would lose digits
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, C)
        return self.weight * h.to(x.dtype)


def rope_frequencies(head_size: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Each rotary pair's angle per position, (hs/2,) radians: theta^(-2i/hs) for pair i, the
    first turning fastest; then a longer context's `scaling`, which slows some of them."""
    # on the CPU even inside torch.device("meta"): computed here, never read from a file
    exponents = torch.arange(0, head_size, 2, device="cpu").float() / head_size
    freq = 1.0 / (theta ** exponents)  # (hs/2,)
    if scaling is None:
        return freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":  # every pair slowed: positions read as p / factor
        return freq / factor
    # llama3: pairs whose wavelength is long next to the training context (the slow ones,
    # which never turned far in training) are slowed by `factor`; short ones are kept; those
    # between are a blend, moving smoothly from one to the other
    trained = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / freq  # positions per turn
    scaled = torch.where(wavelength > trained / low, freq / factor, freq)
    smooth = (trained / wavelength - low) / (high - low)  # 0 at the slow end, 1 at the fast end
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= trained / high) & (wavelength <= trained / low)
    return torch.where(between, blended, scaled)


class Rotary(nn.Module):
    """The cos and sin of every position's rotary angles."""

    def __init__(self, head_size: int, theta: float, scaling: dict | None):
        super().__init__()
        # not saved: computed from the config, like the causal mask
        self.register_buffer("freq", rope_frequencies(head_size, theta, scaling),
                             persistent=False)

    def forward(self, start: int, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, hs) for positions start..start+T-1, in `dtype`."""
        positions = torch.arange(start, start + T, device=self.freq.device).float()
        angles = positions[:, None] * self.freq.float()[None, :]  # (T, hs/2)
        # pair i is dimensions i and i + hs/2 (transformers' layout of Llama's weights), so
        # each angle serves both halves
        angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, hs) with each pair (x_i, x_{i+hs/2}) turned by its angle:
    (x_i cos - x_{i+hs/2} sin, x_{i+hs/2} cos + x_i sin)."""
    first, second = x.chunk(2, dim=-1)  # (B, h, T, hs/2) each
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def repeat_kv(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Keys or values (B, nkv, T, hs) -> (B, nh, T, hs): each key/value head repeated for its
    group of n_head / nkv consecutive query heads (query head h reads kv head h // group)."""
    group = n_head // x.size(-3)
    return x if group == 1 else x.repeat_interleave(group, dim=-3)


class LlamaAttention(MultiHeadAttention):
    """MultiHeadAttention with grouped-query heads and rotary positions on q and k.

    hook_q sees the rotated queries (B, nh, T, hs); hook_k the rotated keys and hook_v the values
    (B, nkv, T, hs), as the KV cache holds them; the attention repeats them to nh heads.
    """

    def __init__(self, config: LlamaConfig):
        # out_proj is Llama's o_proj
        super().__init__(config.n_embd, config.n_head, config.dropout, config.out_proj_bias)
        del self.qkv_proj  # q, k and v differ in width: three projections instead of one
        self.n_kv_head, hs = config.kv_heads, self.head_size
        self.q_proj = nn.Linear(config.n_embd, config.n_head * hs, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * hs, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * hs, bias=config.attention_bias)
        self.rotary = Rotary(hs, config.rope_theta, config.rope_scaling)

    def project_heads(self, x: torch.Tensor, start: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) at positions start.. -> q (B, nh, T, hs), k and v (B, nkv, T, hs), q and
        k turned by their positions."""
        B, T, C = x.size()
        q = self.q_proj(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_size).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_size).transpose(1, 2)
        cos, sin = self.rotary(start, T, q.dtype)  # (T, hs), the same for every head
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def steps(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dropout_p: float = 0.0) -> AttentionSteps:
        """MultiHeadAttention.steps; k/v may hold the nkv key/value heads, repeated here."""
        if q.dim() > 2 and k.size(-3) != q.size(-3):
            k, v = repeat_kv(k, q.size(-3)), repeat_kv(v, q.size(-3))
        return super().steps(q, k, v, dropout_p)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """MultiHeadAttention.attend on q (B, nh, T_q, hs) and k/v (B, nkv, T_k, hs)."""
        return super().attend(q, repeat_kv(k, self.n_head), repeat_kv(v, self.n_head))


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) · up(x)); the gate decides how much of each unit passes."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        width, bias = config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(config.n_embd, width, bias=bias)
        self.up_proj = nn.Linear(config.n_embd, width, bias=bias)
        self.down_proj = nn.Linear(width, config.n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(Block):
    """Block's pre-norm forward with RMSNorm, LlamaAttention and SwiGLU."""

    def __init__(self, config: LlamaConfig):
        nn.Module.__init__(self)  # Block's own layers would be built only to be replaced
        self.ln_1 = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.attn = LlamaAttention(config)
        self.ln_2 = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.mlp = SwiGLU(config)
        self.hook_resid_pre, self.hook_resid_post = HookPoint(), HookPoint()


class LlamaLM(TinyLM):
    """Token embedding (no position embedding: positions are rotary), LlamaBlocks, RMSNorm, LM
    head tied to the embedding or its own."""

    def __init__(self, config: LlamaConfig):
        nn.Module.__init__(self)  # TinyLM's layers would be built only to be replaced
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # embed_tokens
        self.blocks = nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layer)])
        self.ln_f = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)  # a model built to train; a loaded one overwrites them

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count, a tied LM head once; there is no position embedding to leave out."""
        return sum(p.numel() for p in self.parameters())

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty KVCache for the key/value heads of every layer."""
        c, p = self.config, self.wte.weight
        return KVCache(c.n_layer, batch_size, c.kv_heads, max_len or c.block_size,
                       c.n_embd // c.n_head, dtype=p.dtype, device=p.device)

    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Token ids idx (B, T) -> their embeddings (B, T, C); the positions enter as rotations
        of q and k in each layer."""
        return self.wte(idx)


# ---- reading a transformers folder ------------------------------------------------------------


def read_config(hf: dict, where: Path, layers: int) -> LlamaConfig:
    """The LlamaConfig of a transformers llama, qwen2 or mistral config.json (`hf`, read from
    `where`) whose weights hold `layers` blocks; what tinylm cannot do is refused in one line."""
    kind = hf.get("model_type")
    hf = {**COMMON_DEFAULTS, **DEFAULTS[kind], **hf, **FIXED.get(kind, {})}
    shape = common.shape_of(hf, SHAPE, where, layers)
    for key in ("intermediate_size", "num_key_value_heads"):  # the latter null: one per head
        if type(hf[key]) is not int and (key == "intermediate_size" or hf[key] is not None):
            raise refused(where, key, hf[key], "it must be a whole number")
    if hf["hidden_act"] != "silu":
        raise refused(where, "hidden_act", hf["hidden_act"], "tinylm's SwiGLU gates with silu")
    head_size = shape["n_embd"] // max(shape["n_head"], 1)
    if hf["head_dim"] not in (None, head_size):
        raise refused(where, "head_dim", hf["head_dim"], f"tinylm's heads are hidden_size / "
                      f"num_attention_heads = {head_size} wide")
    window = hf["sliding_window"]
    if (kind != "qwen2" or hf["use_sliding_window"]) and window is not None and (
            type(window) is not int or window < shape["block_size"]):
        raise refused(where, "sliding_window", window, "tinylm's Llama attention sees the whole "
                      "context: null, or at least max_position_embeddings")
    theta, scaling = _rope(hf, where)
    return common.built(LlamaConfig, where, **shape, bias=False,
                        n_kv_head=hf["num_key_value_heads"],
                        intermediate_size=hf["intermediate_size"], rope_theta=theta,
                        rope_scaling=scaling, rms_norm_eps=hf["rms_norm_eps"],
                        tie_word_embeddings=hf["tie_word_embeddings"],
                        attention_bias=hf["attention_bias"], mlp_bias=hf["mlp_bias"],
                        # Llama's attention_bias is o_proj's too; Qwen2's q, k, v alone
                        out_proj_bias=kind == "llama" and hf["attention_bias"])


def _rope(hf: dict, where: Path) -> tuple[float, dict | None]:
    """rope_theta and the rotary scaling (None: plain) of a config.json: transformers 5 writes
    them as rope_parameters, earlier versions (the hub's files) as rope_theta and rope_scaling."""
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        raise refused(where, key, params, "it must be a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" and kind not in ROPE_SCALINGS:
        raise refused(where, key, params, f"rope_type {kind!r} is not written in tinylm, which "
                      f"has default, {', '.join(ROPE_SCALINGS)}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise refused(where, "partial_rotary_factor", partial, "tinylm turns every dimension")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if kind == "default":
        return theta, None
    # transformers' default: the context the model was trained at is its max_position_embeddings
    given = {"original_max_position_embeddings": hf.get("original_max_position_embeddings",
                                                        hf["max_position_embeddings"]), **params}
    return theta, {"rope_type": kind, **{name: given.get(name) for name in ROPE_SCALINGS[kind]}}


def eos_id(hf: dict) -> int | None:
    """The id generation stops at: config.json's eos_token_id, the first where it lists several
    (an instruct model's chat turns end at another); None where it names none."""
    eos = {**COMMON_DEFAULTS, **DEFAULTS.get(hf.get("model_type"), {}), **hf}["eos_token_id"]
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if type(eos) is int and eos >= 0 else None


# tinylm's name in block i <- the checkpoint's name in block i (which starts "model.layers.{i}.")
BLOCK_NAMES = {
    "ln_1.weight": "input_layernorm.weight",
    **{f"attn.{x}_proj.{p}": f"self_attn.{x}_proj.{p}" for x in "qkv" for p in ("weight", "bias")},
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "attn.out_proj.bias": "self_attn.o_proj.bias",
    "ln_2.weight": "post_attention_layernorm.weight",
    **{f"mlp.{x}_proj.{p}": f"mlp.{x}_proj.{p}" for x in ("gate", "up", "down")
       for p in ("weight", "bias")},
}
OUTSIDE_BLOCKS = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
                  "lm_head.weight": "lm_head.weight"}


def table(n_layer: int) -> common.Table:
    """Every tinylm name -> its name in the checkpoint, for n_layer blocks."""
    return common.name_table(n_layer, "model.layers.{i}.", BLOCK_NAMES, OUTSIDE_BLOCKS)


def load(file: Path, model: LlamaLM) -> None:
    """The model's weights from a transformers Llama-family safetensors file, into `model` built
    on the meta device."""
    common.load_weights(file, model, table(model.config.n_layer))


def read_tokenizer(file: Path, hf: dict) -> Tokenizer:
    """The model's tokenizer.json: texts end at config.json's eos_token_id (or <|endoftext|>
    where it names none), and start with the BOS token where the file's post-processor adds one."""
    return load_tokenizer(file, eot_id=eos_id(hf))
