"""Checkpoints that rebuild themselves, written so that a crash never leaves a broken one.

Layout inside a run directory:

    checkpoints/
      step-0000500/            one complete checkpoint
        model.safetensors      weights (safetensors: loading never runs code)
        model_config.json      ModelConfig, enough to rebuild the model
        config.yaml            the resolved run config
        tokenizer.json         the tokenizer the model was trained with
        trainer_state.pt       optimizer, schedule, step, RNG and sampler state (tensors only)
      last -> step-0000500     symlinks, switched atomically
      best -> step-0000250

A checkpoint is first written to a hidden temporary directory, flushed to disk and renamed into
place; only then is `last` (or `best`) re-pointed, with an atomic rename of a fresh symlink.
Killed at any moment, the run directory still holds the previous complete checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from tinylm.model import ModelConfig, TinyLM

CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_FILE = "model.safetensors"
MODEL_CONFIG_FILE = "model_config.json"
RUN_CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
TRAINER_STATE_FILE = "trainer_state.pt"
TAGS = ("last", "best")
_STEP_DIR = re.compile(r"^step-\d+(-\d+)?$")


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model in eval mode, and what it was trained with."""

    directory: Path
    model: TinyLM
    config: ModelConfig
    tokenizer: Any
    run_config: dict
    trainer_state_path: Path | None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point(checkpoints: Path, tag: str, target: str) -> None:
    """Atomically make checkpoints/<tag> a relative symlink to checkpoints/<target>."""
    tmp = checkpoints / f".{tag}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, checkpoints / tag)


def _remove_unreferenced(checkpoints: Path) -> None:
    """Delete step directories no tag points at, and leftovers of interrupted saves."""
    keep = {os.readlink(checkpoints / tag) for tag in TAGS if (checkpoints / tag).is_symlink()}
    for entry in checkpoints.iterdir():
        stale_tmp = entry.name.startswith(".tmp-")
        old_step = _STEP_DIR.match(entry.name) and entry.name not in keep
        if entry.is_dir() and not entry.is_symlink() and (stale_tmp or old_step):
            shutil.rmtree(entry, ignore_errors=True)


def save_checkpoint(
    run_dir: str | Path,
    model: TinyLM,
    tokenizer: Any,
    run_config: dict,
    step: int,
    trainer_state: dict | None = None,
    tags: tuple[str, ...] = ("last",),
) -> Path:
    """Write a complete checkpoint for `step` and point each tag ("last", "best") at it."""
    from safetensors.torch import save_model

    for tag in tags:
        if tag not in TAGS:
            raise ValueError(f"checkpoint tag {tag!r} is not allowed; allowed: {', '.join(TAGS)}")
    model = getattr(model, "module", model)  # unwrap DistributedDataParallel
    model = getattr(model, "_orig_mod", model)  # unwrap torch.compile
    checkpoints = Path(run_dir) / CHECKPOINTS_DIR
    checkpoints.mkdir(parents=True, exist_ok=True)

    # A name no tag points at yet: saving the same step twice must not touch the first copy.
    name, n = f"step-{step:07d}", 1
    while (checkpoints / name).exists():
        name, n = f"step-{step:07d}-{n}", n + 1
    tmp = checkpoints / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()

    save_model(model, str(tmp / WEIGHTS_FILE))  # handles the tied embedding / LM head
    (tmp / MODEL_CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    (tmp / RUN_CONFIG_FILE).write_text(yaml.safe_dump(run_config, sort_keys=False))
    tokenizer.save(str(tmp / TOKENIZER_FILE))
    if trainer_state is not None:
        torch.save(trainer_state, tmp / TRAINER_STATE_FILE)
    for file in tmp.iterdir():
        _fsync(file)
    _fsync(tmp)

    os.rename(tmp, checkpoints / name)
    _fsync(checkpoints)
    for tag in tags:
        _point(checkpoints, tag, name)
    _fsync(checkpoints)
    _remove_unreferenced(checkpoints)
    return checkpoints / name


def resolve_checkpoint_dir(path: str | Path, prefer: str = "best") -> Path:
    """The checkpoint directory meant by `path`: a run dir, its checkpoints/, or one checkpoint.

    Within a run, `prefer` ("best" or "last") is taken when it exists, else the other tag.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if (path / WEIGHTS_FILE).exists() or (path / MODEL_CONFIG_FILE).exists():
        # through a `last`/`best` link, read the step directory itself: the link may move on
        return path.resolve()
    order = [prefer] + [t for t in TAGS if t != prefer]
    for base in (path, path / CHECKPOINTS_DIR):
        for tag in order:
            if (base / tag).is_dir():
                return (base / tag).resolve()
    raise FileNotFoundError(
        f"no checkpoint found in {path}: expected {path / WEIGHTS_FILE}, or "
        f"{path / CHECKPOINTS_DIR}/best or {path / CHECKPOINTS_DIR}/last")


def _read_model_config(file: Path) -> ModelConfig:
    try:
        values = json.loads(file.read_text())
        return ModelConfig(**values)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint is missing {file}") from None
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"{file} is not a valid model config: {err}") from err


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    prefer: str = "best") -> Checkpoint:
    """Rebuild model and tokenizer from a checkpoint (see resolve_checkpoint_dir for `path`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    from tinylm.tokenizer import load_tokenizer

    directory = resolve_checkpoint_dir(path, prefer)
    config = _read_model_config(directory / MODEL_CONFIG_FILE)

    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"checkpoint is missing its weights file {weights}")
    model = TinyLM(config)
    try:
        load_model(model, str(weights), strict=True)
    except (SafetensorError, RuntimeError, OSError) as err:
        raise ValueError(f"{weights} cannot be loaded into the model that "
                         f"{directory / MODEL_CONFIG_FILE} describes (truncated or mismatched?):"
                         f" {err}") from err

    tokenizer_file = directory / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"checkpoint is missing its tokenizer {tokenizer_file}")
    tokenizer = load_tokenizer(str(tokenizer_file))
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"{tokenizer_file} has {tokenizer.vocab_size} tokens but "
                         f"{directory / MODEL_CONFIG_FILE} says vocab_size={config.vocab_size}")

    run_config_file = directory / RUN_CONFIG_FILE
    run_config = yaml.safe_load(run_config_file.read_text()) if run_config_file.is_file() else {}
    state = directory / TRAINER_STATE_FILE
    model.to(device).eval()
    return Checkpoint(directory, model, config, tokenizer, run_config or {},
                      state if state.is_file() else None)
