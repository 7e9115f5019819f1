"""What a checkpoint's files say about the model, read without trusting them: model_config.json is
checked against model.safetensors' header before any memory is allocated, config.yaml must be the
mapping tinylm wrote; anything else is refused in one line naming the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError, safe_open

from tinylm.files import read_regular_file
from tinylm.model import ModelConfig
from tinylm.pretrained import build, saved_config

# the records save_checkpoint keeps in the weights file's metadata
MODEL_RECORD, TOKENIZER_RECORD = "tinylm.model", "tinylm.tokenizer"
MAX_CONFIG_BYTES = 2**20  # model_config.json and config.yaml are a few KB


def recorded(records: dict[str, str], key: str, weights: Path) -> dict:
    """One of the records save_checkpoint keeps in the weights' metadata; {} in a checkpoint
    written before there were any."""
    try:
        value = json.loads(records.get(key, "{}"))
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{weights} holds an unreadable {key} record in its metadata; it is not "
                         "a checkpoint that tinylm wrote")
    return value


def read_model_config(file: Path, weights: Path) -> tuple[ModelConfig, dict[str, str]]:
    """The model config, checked against the weights file's header before any memory is
    allocated, and the weights file's metadata."""
    raw = read_regular_file(file, MAX_CONFIG_BYTES, "the checkpoint's model config")
    try:
        values = json.loads(raw)
        if not isinstance(values, dict):
            raise ValueError("it does not hold a JSON object")
        config = saved_config(values)
        if config.vocab_size is None:  # training takes it from the tokenizer; a model has one
            raise ValueError("model.vocab_size is null: a saved model has a vocabulary")
    except RecursionError:
        raise ValueError(f"{file} is not a valid model config: it is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"{file} is not a valid model config: {str(err).splitlines()[0]}"
                         ) from None
    try:  # the header only: names, shapes and metadata, no tensor is read
        with safe_open(str(weights), "pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
            records = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{weights} is not a safetensors file (truncated or corrupt?): "
                         f"{str(err).splitlines()[0]}") from None
    # even a shapes-only model costs time per layer (10^9 never return): count them first
    layers = len({k.split(".")[1] for k in shapes if k.startswith("blocks.")})
    if config.n_layer != layers:
        raise ValueError(f"{file} says n_layer={config.n_layer} but {weights} holds the weights "
                         f"of n_layer={layers}: they are not one checkpoint; set n_layer back")
    # on the meta device, shapes only: an absurd n_embd cannot ask for terabytes
    with torch.device("meta"):
        wanted = sum(p.numel() for p in build(config).parameters())
    stored = sum(math.prod(shape) for shape in shapes.values())
    if wanted != stored:
        raise ValueError(f"{file} describes a model of {wanted:,} parameters but {weights} "
                         f"holds {stored:,}: they are not one checkpoint")
    # the same number of parameters may still be another model (n_head splits them otherwise)
    saved = {k: v for k, v in recorded(records, MODEL_RECORD, weights).items()
             if getattr(config, k, v) != v}
    if saved:
        raise ValueError(f"{file} says {', '.join(f'{k}={getattr(config, k)!r}' for k in saved)}"
                         f" but {weights} was saved from a model with "
                         f"{', '.join(f'{k}={v!r}' for k, v in saved.items())}: they are not one "
                         f"checkpoint; set {', '.join(saved)} back")
    return config, records


def yaml_in(source: Path | bytes) -> object:
    """The YAML in `source` (bytes, or a checked file), parsed; ValueError in one line if not."""
    try:
        text = source.decode("utf-8") if isinstance(source, bytes) else \
            source.read_text(encoding="utf-8")
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:  # its str spans lines: the problem and where
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{err.problem or err.context}{where}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(str(err).splitlines()[0]) from None
    except RecursionError:
        raise ValueError("it is nested too deeply") from None


def read_run_config(file: Path) -> dict:
    """A checkpoint's config.yaml ({} where there is none), refused in one line naming it where
    it is not the mapping save_checkpoint wrote."""
    try:
        raw = read_regular_file(file, MAX_CONFIG_BYTES, "the checkpoint's run config")
    except FileNotFoundError:
        return {}
    try:
        values = yaml_in(raw)
    except ValueError as err:
        why = str(err)
    else:
        if isinstance(values, dict) or values is None:
            return values or {}
        why = f"it holds a {type(values).__name__}, not a mapping"
    raise ValueError(f"{file} is not the run config tinylm wrote ({why}): put back the "
                     "config.yaml of the run that saved this checkpoint")
