"""GPT-2 (and DistilGPT2) in tinylm's TinyLM, and a tinylm run out as a GPT-2.

GPT-2 is the model tinylm's is written after. It departs in two places: its MLP's GELU is the
tanh approximation (activation_function gelu_new), and a config may switch off the 1/√d scale
(scale_attn_weights: false). Its Conv1D layers store weights (in, out), transposed from
nn.Linear's (out, in), and q, k, v in one c_attn, like tinylm's qkv_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import tinylm.pretrained.common as common
from tinylm.config import choice, flag
from tinylm.files import write_json_atomic
from tinylm.model import MLP, ModelConfig, TinyLM
from tinylm.pretrained.common import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, refused
from tinylm.tokenizer import EOT, CharTokenizer, Tokenizer, load_tokenizer

PADDED_VOCABULARY = False
MODEL_TYPES = ("gpt2",)
BLOCK = r"h\.(\d+)\."  # a block's weights start h.{i}.
SHAPE = {"vocab_size": "vocab_size", "block_size": "n_positions", "n_layer": "n_layer",
         "n_head": "n_head", "n_embd": "n_embd"}  # tinylm's name -> config.json's
# transformers' defaults, which a config.json may leave out
DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768,
            "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "scale_attn_weights": True}
# transformers' activation_function -> GPT2Config.activation (gelu_new is the tanh form), and
# back: transformers' names for exactly these two GELUs (gelu is the exact, erf one there too)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
EXPORTED_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}

# tinylm's name in block i <- GPT-2's name in block i (which starts "h.{i}.")
BLOCK_NAMES = {
    "ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias",
    "attn.qkv_proj.weight": "attn.c_attn.weight", "attn.qkv_proj.bias": "attn.c_attn.bias",
    "attn.out_proj.weight": "attn.c_proj.weight", "attn.out_proj.bias": "attn.c_proj.bias",
    "ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias",
    "mlp.fc.weight": "mlp.c_fc.weight", "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.weight": "mlp.c_proj.weight", "mlp.proj.bias": "mlp.c_proj.bias",
}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
OUTSIDE_BLOCKS = {name: name for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}


@dataclass
class GPT2Config(ModelConfig):
    """TinyLM's shape, and where a GPT-2 departs from it."""

    activation: str = "gelu"  # the MLP's GELU: gelu (exact, erf) | gelu_tanh (GPT-2's tanh form)
    attention_scale: bool = True  # divide q·kᵀ by √head_size; false: unscaled

    def __post_init__(self):
        super().__post_init__()
        choice("gelu", "gelu_tanh")("model.activation", self.activation)
        flag("model.attention_scale", self.attention_scale)


class TanhGELUMLP(MLP):
    """tinylm's MLP with GPT-2's GELU, the tanh approximation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class GPT2LM(TinyLM):
    """TinyLM with GPT-2's GELU and, where its config says so, unscaled q·kᵀ."""

    def __init__(self, config: GPT2Config):
        super().__init__(config)
        for block in self.blocks:
            if config.activation == "gelu_tanh":
                block.mlp = TanhGELUMLP(config)
            if not config.attention_scale:
                block.attn.scale = 1.0


def table(n_layer: int, block: common.Table) -> common.Table:
    """Every tinylm name -> its name in the checkpoint, for n_layer blocks of `block`."""
    return common.name_table(n_layer, "h.{i}.", block, OUTSIDE_BLOCKS)


def shared_checks(hf: dict, where: Path, mlp: str, n_embd: int) -> None:
    """What GPT-2 and GPT-Neo both refuse: another MLP width, activation, LayerNorm epsilon or an
    untied LM head, and options tinylm's attention lacks."""
    if hf[mlp] not in (None, 4 * n_embd):
        raise refused(where, mlp, hf[mlp], "tinylm's MLP is 4 x n_embd wide")
    if not isinstance(hf["activation_function"], str) or (
            hf["activation_function"] not in ACTIVATIONS):
        raise refused(where, "activation_function", hf["activation_function"],
                      f"tinylm has {', '.join(ACTIVATIONS)}")
    if hf["layer_norm_epsilon"] != 1e-5:
        raise refused(where, "layer_norm_epsilon", hf["layer_norm_epsilon"],
                      "tinylm's LayerNorm adds 1e-5")
    if not hf.get("tie_word_embeddings", True):
        raise refused(where, "tie_word_embeddings", False,
                      "tinylm's LM head is the token embedding")
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(key):
            raise refused(where, key, hf[key], "tinylm's attention has no such option")


def read_config(hf: dict, where: Path, layers: int) -> GPT2Config:
    """The GPT2Config of a transformers GPT-2 config.json whose weights hold `layers` blocks."""
    hf = {**DEFAULTS, **hf}
    shape = common.shape_of(hf, SHAPE, where, layers)
    shared_checks(hf, where, "n_inner", shape["n_embd"])
    return common.built(GPT2Config, where, **shape, bias=True,
                        activation=ACTIVATIONS[hf["activation_function"]],
                        attention_scale=hf["scale_attn_weights"])


def load(file: Path, model: GPT2LM) -> None:
    """The model's weights from a GPT-2 safetensors file, into `model` built on the meta device."""
    conv1d = frozenset(f"h.{i}.{name}" for i in range(model.config.n_layer) for name in CONV1D)
    common.load_weights(file, model, table(model.config.n_layer, BLOCK_NAMES), conv1d)


def read_tokenizer(file: Path, hf: dict) -> Tokenizer:
    """GPT-2's byte-level BPE, whose <|endoftext|> ends a text."""
    return load_tokenizer(file)


def export_gpt2(model: TinyLM, tokenizer: Tokenizer, folder: Path) -> str | None:
    """Write `model` into `folder` as a transformers GPT-2 (config.json, model.safetensors) with
    its tokenizer (tokenizer.json, tokenizer_config.json). Returns what could not be written
    (a char tokenizer), or None. A model GPT-2 cannot hold (local layers, another architecture's
    weights) is refused, ValueError, before anything is written."""
    c = model.config
    if "local" in (getattr(c, "attention_layers", None) or []):  # a GPT-Neo
        raise ValueError("the model has local attention layers, which GPT-2 has no place for: "
                         "it cannot be exported as GPT-2")
    ours = {name: p.detach().float().cpu() for name, p in model.state_dict().items()}
    names = table(c.n_layer, BLOCK_NAMES)
    # another architecture's weights (a Llama's q_proj, its SwiGLU) have no place in GPT-2
    foreign = sorted(set(ours) - set(names) - {"lm_head.weight"})  # the LM head is wte: tied
    if foreign:
        raise ValueError(f"the model's {foreign[0]} has no place in GPT-2 (the model is a "
                         f"{type(model).__name__}): it cannot be exported as GPT-2; a "
                         "pretrained model's own folder is already one that transformers loads")
    write_json_atomic(folder / CONFIG_FILE, {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": c.vocab_size, "n_positions": c.block_size, "n_layer": c.n_layer,
        "n_head": c.n_head, "n_embd": c.n_embd, "n_inner": None,
        "activation_function": EXPORTED_ACTIVATIONS[getattr(c, "activation", "gelu")],
        "layer_norm_epsilon": 1e-5, "scale_attn_weights": getattr(c, "attention_scale", True),
        "tie_word_embeddings": True,
        "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
        "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id})

    tensors = {}
    for name, theirs in names.items():
        # GPT-2 has biases everywhere: those a model.bias=false run has not are zeros
        tensor = ours[name] if name in ours else torch.zeros(
            ours[name.replace(".bias", ".weight")].size(0))
        if theirs.split(".", 2)[-1] in CONV1D:
            tensor = tensor.t()
        tensors[f"transformer.{theirs}"] = tensor.contiguous()  # the LM head is wte: tied
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})

    if isinstance(tokenizer, CharTokenizer):
        return ("the run's tokenizer is tinylm's char tokenizer, which transformers has no class "
                f"for: the exported model loads and takes token ids, but no {TOKENIZER_FILE} was "
                "written; encode text with tinylm (tinylm.tokenizer.load_tokenizer on the run's "
                f"{TOKENIZER_FILE}), or train the run with tokenizer=bpe")
    tokenizer.save(folder / TOKENIZER_FILE)
    write_json_atomic(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
        "model_max_length": c.block_size})
    return None
