"""Pretrained Hugging Face models in tinylm's own TinyLM, and tinylm models out as GPT-2.

    checkpoint=models/gpt2        a folder holding config.json (model_type gpt2 or gpt_neo),
                                  model.safetensors and tokenizer.json
    checkpoint=hf:gpt2            those three files, fetched once from the Hugging Face hub into
                                  its cache (hf:distilgpt2, hf:roneneldan/TinyStories-33M, ...)

The weights go into TinyLM, built on tinylm's MultiHeadAttention: each architecture is a table of
names below, and what it does otherwise is a ModelConfig option, not another model: GPT-2's tanh
GELU (activation), GPT-Neo's unscaled q·kᵀ (attention_scale) and its local layers, whose causal
mask is a band (attention_layers, window_size; docs/pretrained.md draws it).

Only safetensors are read. Loading a pickle (pytorch_model.bin) can run any code it holds, so
tinylm never loads one; scripts/convert_bin_to_safetensors.py converts one when its user runs it.
`export_gpt2` goes the other way: a tinylm model as a GPT-2 that transformers loads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tinylm.files import is_there_as_file, write_json_atomic
from tinylm.model import ModelConfig, TinyLM
from tinylm.tokenizer import EOT, CharTokenizer, Tokenizer, load_tokenizer

HUB_PREFIX = "hf:"
CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
PICKLE_FILE = "pytorch_model.bin"
CONVERT = "python scripts/convert_bin_to_safetensors.py"


class Architecture(NamedTuple):
    """How one transformers architecture's files map onto TinyLM."""

    shape: dict[str, str]  # ModelConfig field -> its config.json key
    mlp: str  # the config.json key of the MLP's width (null: 4 x n_embd)
    defaults: dict  # transformers' defaults, which a config.json may leave out
    block: dict  # tinylm's name in block i -> the checkpoint's name(s) in block i ("h.{i}.")
    transposed: frozenset[str]  # the checkpoint's block names stored (in, out), not (out, in)


# tinylm's name in block i <- the checkpoint's name in block i (which starts "h.{i}."). A tuple
# is stacked: tinylm's qkv_proj holds q, k and v one after another, GPT-Neo keeps them apart.
# None is zeros: GPT-Neo's q, k and v have no bias.
GPT2_BLOCK = {
    "ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias",
    "attn.qkv_proj.weight": "attn.c_attn.weight", "attn.qkv_proj.bias": "attn.c_attn.bias",
    "attn.out_proj.weight": "attn.c_proj.weight", "attn.out_proj.bias": "attn.c_proj.bias",
    "ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias",
    "mlp.fc.weight": "mlp.c_fc.weight", "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.weight": "mlp.c_proj.weight", "mlp.proj.bias": "mlp.c_proj.bias",
}
GPT_NEO_BLOCK = {
    **GPT2_BLOCK,
    "attn.qkv_proj.weight": tuple(f"attn.attention.{x}_proj.weight" for x in "qkv"),
    "attn.qkv_proj.bias": None,
    "attn.out_proj.weight": "attn.attention.out_proj.weight",
    "attn.out_proj.bias": "attn.attention.out_proj.bias",
}
OUTSIDE_BLOCKS = ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")  # one name in all

ARCHITECTURES = {
    "gpt2": Architecture(
        {"vocab_size": "vocab_size", "block_size": "n_positions", "n_layer": "n_layer",
         "n_head": "n_head", "n_embd": "n_embd"}, "n_inner",
        {"vocab_size": 50257, "n_positions": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768,
         "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
         "scale_attn_weights": True},
        GPT2_BLOCK,
        # GPT-2's Conv1D layers store (in, out), the transpose of nn.Linear's (out, in)
        frozenset({"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                   "mlp.c_proj.weight"})),
    "gpt_neo": Architecture(
        {"vocab_size": "vocab_size", "block_size": "max_position_embeddings",
         "n_layer": "num_layers", "n_head": "num_heads", "n_embd": "hidden_size"},
        "intermediate_size",
        {"vocab_size": 50257, "max_position_embeddings": 2048, "num_layers": 24, "num_heads": 16,
         "hidden_size": 2048, "intermediate_size": None, "activation_function": "gelu_new",
         "layer_norm_epsilon": 1e-5, "attention_types": [[["global", "local"], 12]],
         "window_size": 256},
        GPT_NEO_BLOCK,
        frozenset()),
}
GPT2 = ARCHITECTURES["gpt2"]
# transformers' activation_function -> ModelConfig.activation (gelu_new is the tanh form), and
# back: transformers' names for exactly tinylm's two GELUs (gelu is the exact, erf one there too)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
EXPORTED_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def is_pretrained(path: str | Path) -> bool:
    """Whether `checkpoint=path` names a Hugging Face model (hf:<id>, or a folder with a
    config.json) rather than a tinylm run."""
    # exists, not is_file: a FIFO or folder named config.json is refused by the loader, by name
    return str(path).startswith(HUB_PREFIX) or (Path(path) / CONFIG_FILE).exists()


def fetch(repo_id: str) -> Path:
    """The hub's folder of `repo_id` with config.json, model.safetensors and tokenizer.json:
    downloaded once into Hugging Face's cache (with progress bars), then read from there."""
    # imported here: only an hf: checkpoint pays for the hub client's import
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    name = f"{HUB_PREFIX}{repo_id}"
    try:
        return Path(snapshot_download(repo_id, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE,
                                                               TOKENIZER_FILE]))
    except (RepositoryNotFoundError, GatedRepoError, HFValidationError):
        raise ValueError(f"{name}: the Hugging Face hub has no such model, or it is private or "
                         "gated (then log in: hf auth login); ids look like hf:gpt2 or "
                         "hf:roneneldan/TinyStories-33M") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise ValueError(f"{name} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                         f"{why}: run once with a network to download it, or pass checkpoint=<a "
                         f"folder with its {CONFIG_FILE}, {WEIGHTS_FILE} and {TOKENIZER_FILE}>"
                         ) from None
    except OSError as err:  # the hub's HTTP errors, a full cache disk
        raise ValueError(f"{name} could not be downloaded: {str(err).strip().splitlines()[0]}"
                         ) from None


def model_name(folder: Path) -> str:
    """A pretrained model's name, for the folders its outputs go to: the repo ("org--name") of
    a folder in the hub's cache, else the folder's own name."""
    repo = next((p.name for p in folder.parents if p.name.startswith("models--")), None)
    return repo.removeprefix("models--") if repo else Path(os.path.abspath(folder)).name


def model_config(hf: dict, where: Path, layers: int) -> ModelConfig:
    """The ModelConfig of a transformers config.json (`hf`, read from `where`) whose weights file
    holds `layers` blocks; what TinyLM cannot do is refused in one line naming the key."""
    kind = hf.get("model_type")
    if not isinstance(kind, str) or kind not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type={kind!r} is not one tinylm loads: gpt2 (GPT-2, "
                         "DistilGPT2) or gpt_neo (GPT-Neo, the TinyStories models)")
    arch = ARCHITECTURES[kind]
    hf = {**arch.defaults, **hf}

    def refuse(key: str, rule: str) -> ValueError:
        return ValueError(f"{where}: {key}={_short(hf.get(key))} is not supported: {rule}")
    for key in arch.shape.values():
        if type(hf[key]) is not int:
            raise refuse(key, "it must be a whole number")
    # compared before anything is built: a layer count is work and memory, and the weights
    # file's header already says how many blocks there are
    n_layer = arch.shape["n_layer"]
    if hf[n_layer] != layers:
        raise ValueError(f"{where}: {n_layer}={hf[n_layer]}, but the {WEIGHTS_FILE} beside it "
                         f"holds {layers} layers: they are not one model")
    if hf[arch.mlp] not in (None, 4 * hf[arch.shape["n_embd"]]):
        raise refuse(arch.mlp, "tinylm's MLP is 4 x n_embd wide")
    if not isinstance(hf["activation_function"], str) or (
            hf["activation_function"] not in ACTIVATIONS):
        raise refuse("activation_function", f"tinylm has {', '.join(ACTIVATIONS)}")
    if hf["layer_norm_epsilon"] != 1e-5:
        raise refuse("layer_norm_epsilon", "tinylm's LayerNorm adds 1e-5")
    if not hf.get("tie_word_embeddings", True):
        raise refuse("tie_word_embeddings", "tinylm's LM head is the token embedding")
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(key):
            raise refuse(key, "tinylm's attention has no such option")
    if kind == "gpt2":
        attention = {"attention_scale": hf["scale_attn_weights"]}
    else:  # GPT-Neo: q·kᵀ unscaled
        attention = {"attention_scale": False, "window_size": hf["window_size"],
                     "attention_layers": hf.get("attention_layers") or _neo_layers(
                         hf["attention_types"], layers, refuse)}
    try:
        # no dropout: a pretrained model is loaded to be read, not trained
        return ModelConfig(**{ours: hf[theirs] for ours, theirs in arch.shape.items()},
                           dropout=0.0, bias=True,
                           activation=ACTIVATIONS[hf["activation_function"]], **attention)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def _neo_layers(types, layers: int, refuse) -> list:
    """GPT-Neo's attention_types expanded: [[["global", "local"], 2]] is 4 layers, local 2nd
    and 4th. The count is checked first against the weights' `layers`, since each repeat
    is a number the file chose."""
    rule = (f'it must be [[["global", "local"], repeat], ...] making the {layers} layers '
            f"its {WEIGHTS_FILE} holds")
    pairs = types if isinstance(types, list) else [None]
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], list)
                and type(pair[1]) is int and pair[1] >= 0):
            raise refuse("attention_types", rule)
    if sum(len(kinds) * repeat for kinds, repeat in types) != layers:
        raise refuse("attention_types", rule)
    return [kind for kinds, repeat in types for _ in range(repeat) for kind in kinds]


def _short(value) -> str:
    """repr of a config value, cut to one readable line (a crafted value may be huge)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _table(config: ModelConfig, block: dict) -> dict:
    """Every tinylm name -> its name(s) in the checkpoint, for all of config's blocks."""
    table = {name: name for name in OUTSIDE_BLOCKS}
    for i in range(config.n_layer):
        for ours, theirs in block.items():
            if isinstance(theirs, str):
                theirs = f"h.{i}.{theirs}"
            elif theirs is not None:
                theirs = tuple(f"h.{i}.{name}" for name in theirs)
            table[f"blocks.{i}.{ours}"] = theirs
    return table


def _stored_names(f) -> dict[str, str]:
    """The names in an open safetensors file, without transformers' "transformer." prefix
    (GPT2LMHeadModel's save has it, the hub's gpt2 not) -> the name as stored."""
    return {name.removeprefix("transformer."): name for name in f.keys()}


def _layers_in(file: Path) -> int:
    """How many blocks (h.0., h.1., ...) a safetensors file holds, from its header alone."""
    with safe_open(str(file), "pt") as f:
        blocks = {m.group(1) for m in map(re.compile(r"h\.(\d+)\.").match, _stored_names(f))
                  if m}
    return len(blocks)


def _state_dict(file: Path, model: TinyLM, arch: Architecture) -> dict[str, torch.Tensor]:
    """TinyLM's state dict from a transformers safetensors file, by the architecture's table;
    each tensor's shape is compared from the header, before it is read, with `model`'s (on
    the meta device: shapes only)."""
    needs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state = {}
    with safe_open(str(file), "pt") as f:
        stored = _stored_names(f)

        def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in stored:
                raise ValueError(f"{file} has no tensor {name}: it is not the "
                                 f"{model.config.n_layer}-layer model its {CONFIG_FILE} "
                                 "describes")
            transposed = name.split(".", 2)[-1] in arch.transposed
            shape = shape[::-1] if transposed else shape
            found = tuple(f.get_slice(stored[name]).get_shape())
            if found != shape:
                raise ValueError(f"{file} does not fit the model its {CONFIG_FILE} describes: "
                                 f"size mismatch for {name}: {list(found)} in the file, the "
                                 f"model needs {list(shape)}")
            tensor = f.get_tensor(stored[name]).float()
            return tensor.t().contiguous() if transposed else tensor

        for ours, theirs in _table(model.config, arch.block).items():
            if theirs is None:  # a bias the checkpoint does without
                state[ours] = torch.zeros(needs[ours])
            elif isinstance(theirs, tuple):  # stacked along dim 0: q, k, v one after another
                rows, *rest = needs[ours]
                part = (rows // len(theirs), *rest)
                state[ours] = torch.cat([read(name, part) for name in theirs])
            else:
                state[ours] = read(theirs, needs[ours])
    return state


def load_pretrained(path: str | Path) -> tuple[TinyLM, Tokenizer, Path]:
    """(model in eval mode on the CPU, tokenizer, folder) of hf:<id> or a Hugging Face folder."""
    name = str(path)
    folder = fetch(name.removeprefix(HUB_PREFIX)) if name.startswith(HUB_PREFIX) else Path(path)
    config_file, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not is_there_as_file(config_file):
        raise FileNotFoundError(f"{name} has no {CONFIG_FILE}")
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_file} is not a JSON config: {err}") from None
    except RecursionError:
        raise ValueError(f"{config_file} is not a JSON config: it is nested too deeply") from None
    if not is_there_as_file(weights):
        pickled = f", only {PICKLE_FILE}" if (folder / PICKLE_FILE).is_file() else ""
        raise FileNotFoundError(
            f"{name} has no {WEIGHTS_FILE}{pickled}: tinylm loads no pickle, since loading one "
            f"can run any code it holds; convert it once, explicitly: {CONVERT} {name} <folder>,"
            " then pass checkpoint=<folder>")
    try:
        layers = _layers_in(weights)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{weights} is not a safetensors file (truncated or corrupt?): "
                         f"{str(err).splitlines()[0]}") from None
    config = model_config(hf if isinstance(hf, dict) else {}, config_file, layers)
    tokenizer_file = folder / TOKENIZER_FILE
    if not is_there_as_file(tokenizer_file):
        raise FileNotFoundError(f"{name} has no {TOKENIZER_FILE}; GPT-2 and the TinyStories "
                                f"models share one: put {HUB_PREFIX}gpt2's in a folder with this "
                                f"model's {CONFIG_FILE} and {WEIGHTS_FILE}, and pass "
                                "checkpoint=<that folder>")
    tokenizer = load_tokenizer(tokenizer_file)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"{tokenizer_file} has {tokenizer.vocab_size} tokens but {config_file} "
                         f"says vocab_size={config.vocab_size}: they are not one model")

    with torch.device("meta"):  # shapes only: the weights come from the file, no init
        model = TinyLM(config)
    try:
        state = _state_dict(weights, model, ARCHITECTURES[hf["model_type"]])
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{weights} is not a safetensors file (truncated or corrupt?): "
                         f"{str(err).splitlines()[0]}") from None
    state["lm_head.weight"] = state["wte.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.lm_head.weight = model.wte.weight  # tied again: assign gave each its own Parameter
    return model.eval(), tokenizer, folder


def export_gpt2(model: TinyLM, tokenizer: Tokenizer, folder: Path) -> str | None:
    """Write `model` into `folder` as a transformers GPT-2 (config.json, model.safetensors) with
    its tokenizer (tokenizer.json, tokenizer_config.json). Returns what could not be written
    (a char tokenizer), or None."""
    c = model.config
    if c.attention_layers is not None and "local" in c.attention_layers:
        raise ValueError("the model has local attention layers (model.attention_layers), which "
                         "GPT-2 has no place for: it cannot be exported as GPT-2")
    write_json_atomic(folder / CONFIG_FILE, {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": c.vocab_size, "n_positions": c.block_size, "n_layer": c.n_layer,
        "n_head": c.n_head, "n_embd": c.n_embd, "n_inner": None,
        "activation_function": EXPORTED_ACTIVATIONS[c.activation], "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": c.attention_scale, "tie_word_embeddings": True,
        "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
        "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id})

    ours = {name: p.detach().float().cpu() for name, p in model.state_dict().items()}
    tensors = {}
    for name, theirs in _table(c, GPT2.block).items():
        # GPT-2 has biases everywhere: those a model.bias=false run has not are zeros
        tensor = ours[name] if name in ours else torch.zeros(
            ours[name.replace(".bias", ".weight")].size(0))
        if theirs.split(".", 2)[-1] in GPT2.transposed:
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
