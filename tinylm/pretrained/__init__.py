"""Pretrained Hugging Face models in tinylm's own attention, one file per architecture.

    checkpoint=models/gpt2        a folder holding config.json, model.safetensors and
                                  tokenizer.json
    checkpoint=hf:gpt2            those three files, fetched once from the Hugging Face hub into
                                  its cache (hf:distilgpt2, hf:roneneldan/TinyStories-33M, ...)

Each architecture's file (gpt2.py, gpt_neo.py, llama.py) holds its weight names, its config
reading and the modules in which it departs from tinylm's: a config class and a model class
(subclasses of tinylm's, registered in MODELS below: every one attends with tinylm.attention's
softmax(q·kᵀ/√d)·v). It offers:

    MODEL_TYPES                       config.json's model_type values it loads
    BLOCK                             the regex of a block's weight names, to count them
    read_config(hf, where, layers)    its ModelConfig, each value it cannot take refused by name
    load(weights, model)              the weights into it, each shape checked before it is read
    read_tokenizer(file, hf)          its tokenizer
    PADDED_VOCABULARY                 whether its embedding may have rows past the tokens

Only safetensors are read. Loading a pickle (pytorch_model.bin) can run any code it holds, so
tinylm never loads one; scripts/convert_bin_to_safetensors.py converts one when its user runs it.
gpt2.export_gpt2 goes the other way: a tinylm model as a GPT-2 that transformers loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError

from tinylm.files import is_there_as_file
from tinylm.model import ModelConfig, TinyLM
from tinylm.pretrained import gpt2, gpt_neo, llama
from tinylm.pretrained.common import (
    CONFIG_FILE,
    CONVERT,
    HUB_PREFIX,
    PICKLE_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    layers_in,
)
from tinylm.pretrained.gpt2 import export_gpt2
from tinylm.tokenizer import Tokenizer

__all__ = ["CONFIG_FILE", "HUB_PREFIX", "PICKLE_FILE", "TOKENIZER_FILE", "WEIGHTS_FILE",
           "export_gpt2", "fetch", "is_pretrained", "load_pretrained", "model_name",
           "saved_config", "build"]

ARCHITECTURES = {kind: module for module in (gpt2, gpt_neo, llama)
                 for kind in module.MODEL_TYPES}
# each architecture's config class -> its model class
MODELS = {gpt2.GPT2Config: gpt2.GPT2LM, gpt_neo.GPTNeoConfig: gpt_neo.GPTNeoLM,
          llama.LlamaConfig: llama.LlamaLM}
KNOWN = "gpt2 (GPT-2, DistilGPT2), gpt_neo (GPT-Neo, the TinyStories models), llama, qwen2, mistral"


def is_pretrained(path: str | Path) -> bool:
    """Whether `checkpoint=path` names a Hugging Face model (hf:<id>, a folder with config.json)."""
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


def _read_json(config_file: Path) -> dict:
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_file} is not a JSON config: {err}") from None
    except RecursionError:
        raise ValueError(f"{config_file} is not a JSON config: it is nested too deeply") from None
    return hf if isinstance(hf, dict) else {}


def _unreadable(weights: Path, err: Exception) -> ValueError:
    return ValueError(f"{weights} is not a safetensors file (truncated or corrupt?): "
                      f"{str(err).splitlines()[0]}")


def load_pretrained(path: str | Path) -> tuple[TinyLM, Tokenizer, Path]:
    """(model in eval mode on the CPU, tokenizer, folder) of hf:<id> or a Hugging Face folder."""
    name = str(path)
    folder = fetch(name.removeprefix(HUB_PREFIX)) if name.startswith(HUB_PREFIX) else Path(path)
    config_file, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not is_there_as_file(config_file):
        raise FileNotFoundError(f"{name} has no {CONFIG_FILE}")
    hf = _read_json(config_file)
    if not is_there_as_file(weights):
        pickled = f", only {PICKLE_FILE}" if (folder / PICKLE_FILE).is_file() else ""
        raise FileNotFoundError(
            f"{name} has no {WEIGHTS_FILE}{pickled}: tinylm loads no pickle, since loading one "
            f"can run any code it holds; convert it once, explicitly: {CONVERT} {name} <folder>,"
            " then pass checkpoint=<folder>")
    kind = hf.get("model_type")
    if not isinstance(kind, str) or kind not in ARCHITECTURES:
        raise ValueError(f"{config_file}: model_type={kind!r} is not one tinylm loads: {KNOWN}")
    arch = ARCHITECTURES[kind]
    try:
        layers = layers_in(weights, arch.BLOCK)
    except (SafetensorError, OSError) as err:
        raise _unreadable(weights, err) from None
    config = arch.read_config(hf, config_file, layers)
    tokenizer_file = folder / TOKENIZER_FILE
    if not is_there_as_file(tokenizer_file):
        raise FileNotFoundError(f"{name} has no {TOKENIZER_FILE}; GPT-2 and the TinyStories "
                                f"models share one: put {HUB_PREFIX}gpt2's in a folder with this "
                                f"model's {CONFIG_FILE} and {WEIGHTS_FILE}, and pass "
                                "checkpoint=<that folder>")
    tokenizer = arch.read_tokenizer(tokenizer_file, hf)
    # some architectures pad the embedding past the tokens (Qwen2.5: 151,936 rows, 151,665)
    if tokenizer.vocab_size > config.vocab_size or (
            tokenizer.vocab_size < config.vocab_size and not arch.PADDED_VOCABULARY):
        raise ValueError(f"{tokenizer_file} has {tokenizer.vocab_size} tokens but {config_file} "
                         f"says vocab_size={config.vocab_size}: they are not one model")

    with torch.device("meta"):  # shapes only: the weights come from the file, no init
        model = build(config)
    try:
        arch.load(weights, model)
    except (SafetensorError, OSError) as err:
        raise _unreadable(weights, err) from None
    return model.eval(), tokenizer, folder


# What tinylm checkpoints saved before the architectures had their own files may hold in their
# model_config.json, with the values that mean tinylm's own model.
LEGACY_FIELDS = {"activation": "gelu", "attention_scale": True, "attention_layers": None,
                 "window_size": None}


def saved_config(values: dict) -> ModelConfig:
    """The config of a tinylm checkpoint's model_config.json: a ModelConfig, or, where it holds
    GPT-2's or GPT-Neo's options with other values than tinylm's, that architecture's config."""
    if all(values.get(key, default) == default for key, default in LEGACY_FIELDS.items()):
        return ModelConfig(**{k: v for k, v in values.items() if k not in LEGACY_FIELDS})
    return gpt_neo.GPTNeoConfig(**values)


def build(config: ModelConfig) -> TinyLM:
    """The model a config describes: TinyLM, or the architecture's whose config it is."""
    return MODELS.get(type(config), TinyLM)(config)
