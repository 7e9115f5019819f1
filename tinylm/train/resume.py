"""Continuing a run: which checkpoint train.resume means, whether it fits this run, and the
trainer state saved beside the weights (trainer_state.pt): what an uninterrupted run would still
hold in memory (optimizer, scaler, step, and each process's sampler, RNGs and thread count), so
that on CPU a resumed run continues bit for bit. Another train.max_steps rebuilds the schedule
for it from the step resumed at, unless optim.lr_decay_steps fixes it.
"""

from __future__ import annotations

import dataclasses
import pickle
import shlex
from collections.abc import Callable
from pathlib import Path

import torch

from tinylm.checkpoint import (
    CHECKPOINTS_DIR,
    TAGS,
    TOKENIZER_FILE,
    TRAINER_STATE_FILE,
    Checkpoint,
    load_checkpoint,
    resolve_checkpoint_dir,
    tagged_checkpoint,
)
from tinylm.config import ConfigError
from tinylm.data import BatchSampler
from tinylm.train.optim import OptimConfig, lr_at

TRAINER_STATE_KEYS = ("step", "best_val_loss", "tokens_seen", "world_size", "optimizer", "scaler",
                      "sampler", "rng_cpu", "rng_cuda")


def checkpoint_to_resume(run_dir: Path, resume: bool | str) -> Path | None:
    """Which checkpoint train.resume means; refuses to start a fresh run over an old one."""
    checkpoints = run_dir / CHECKPOINTS_DIR
    has_checkpoints = any(tagged_checkpoint(checkpoints, tag) for tag in TAGS)
    if resume is False:
        if has_checkpoints:
            raise ConfigError(f"{run_dir} already holds checkpoints ({checkpoints}); continue "
                              "that run with train.resume=true "
                              f"{shlex.quote(f'hydra.run.dir={run_dir}')}, or start a new one "
                              "in another hydra.run.dir")
        return None
    if resume is True:
        if not has_checkpoints:
            raise ConfigError(f"train.resume=true but {run_dir} holds no checkpoint; point "
                              "hydra.run.dir at the run to continue, or pass "
                              "train.resume=<checkpoint or run dir>")
        return resolve_checkpoint_dir(run_dir, prefer="last")
    try:
        directory = resolve_checkpoint_dir(resume, prefer="last")
    except FileNotFoundError as err:
        raise ConfigError(f"train.resume={resume}: {err}") from None
    if has_checkpoints and not directory.is_relative_to(run_dir.resolve()):  # both resolved paths
        raise ConfigError(f"{run_dir} already holds checkpoints of another run; resume "
                          f"{resume} into a new hydra.run.dir")
    return directory


def check_resume_matches(ckpt: Checkpoint, run_config: dict, tokenizer_file: Path) -> None:
    """Refuse a checkpoint of another model shape (dropout may change), optimizer or tokenizer
    than `run_config` (RunConfig.to_dict(), vocab_size resolved), saying what differs."""
    model, saved_tok = run_config["model"], ckpt.run_config.get("tokenizer", {})
    differences = [f"model.{k}: checkpoint {v!r}, this run {model[k]!r}"
                   for k, v in dataclasses.asdict(ckpt.config).items()
                   if k != "dropout" and model[k] != v]
    saved_optimizer = ckpt.run_config.get("optim", {}).get("name", "adamw")
    if saved_optimizer != run_config["optim"]["name"]:  # their states do not fit each other
        differences.append(f"optim.name: checkpoint {saved_optimizer!r}, this run "
                           f"{run_config['optim']['name']!r} (add optim={saved_optimizer})")
    differences += [f"tokenizer.{k}: checkpoint {saved_tok[k]!r}, this run {v!r}"
                    for k, v in run_config["tokenizer"].items()
                    if k in saved_tok and saved_tok[k] != v]
    if not differences and (ckpt.directory / TOKENIZER_FILE).read_bytes() != \
            tokenizer_file.read_bytes():
        differences.append(f"tokenizer: {ckpt.directory / TOKENIZER_FILE} differs from this "
                           f"run's {tokenizer_file} (was data.* changed?)")
    if differences:
        raise ConfigError(f"cannot resume from {ckpt.directory}: it does not match this run's "
                          f"config: {'; '.join(differences)}")
    if not (ckpt.directory / TRAINER_STATE_FILE).is_file():
        raise ConfigError(f"cannot resume from {ckpt.directory}: it has no {TRAINER_STATE_FILE}")


def schedule_change(ckpt: Checkpoint, optim: OptimConfig, max_steps: int, step: int) -> str | None:
    """One line on the learning rate of a resume at `step` with another train.max_steps than the
    checkpoint's run had; None if it has the same (or leaves no step, which is refused)."""
    saved = ckpt.run_config.get("train", {}).get("max_steps")
    if not isinstance(saved, int) or saved == max_steps or step >= max_steps:
        return None
    before, after = lr_at(step, optim, saved), lr_at(step, optim, max_steps)
    change = f"train.max_steps={max_steps} (the run had {saved}): "
    if optim.lr_decay_steps:
        return change + (f"the learning-rate schedule stays as it was, set by "
                         f"optim.lr_decay_steps={optim.lr_decay_steps} ({after:.3g} after step "
                         f"{step}, optim.min_lr={optim.min_lr:g} from step "
                         f"{optim.lr_decay_steps} on)")
    return change + (f"the learning-rate schedule is rebuilt to decay to optim.min_lr at step "
                     f"{max_steps}, so where it resumes, after step {step}, the learning rate "
                     f"goes from {before:.3g} to {after:.3g}")


def rank_state(sampler: BatchSampler, device: torch.device, threads: int) -> dict:
    """This process's part of the trainer state: where its batches stand, its RNGs, its threads."""
    return {"sampler": sampler.state_dict(), "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "threads": threads}


def trainer_state(step: int, best_val_loss: float, tokens_seen: int, optimizer, scaler,
                  ranks: list[dict]) -> dict:
    """What trainer_state.pt holds: the shared state, and each key of rank_state as a list in
    rank order (rng_cuda: None off CUDA)."""
    state = {"step": step, "best_val_loss": best_val_loss, "tokens_seen": tokens_seen,
             "world_size": len(ranks), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict()}
    state |= {key: [r[key] for r in ranks] for key in ranks[0]}
    if ranks[0]["rng_cuda"] is None:
        state["rng_cuda"] = None
    return state


def restore_rank(state: dict, rank: int, sampler: BatchSampler, device: torch.device) -> None:
    """Continue rank `rank`'s batches and random streams where they stood."""
    sampler.load_state_dict(state["sampler"][rank])
    torch.set_rng_state(state["rng_cpu"][rank])
    if device.type == "cuda" and state["rng_cuda"]:
        torch.cuda.set_rng_state(state["rng_cuda"][rank], device)


def load_trainer_state(file: Path) -> dict:
    """trainer_state.pt as saved by training; anything else is refused in one line naming it.
    Only tensors and plain containers load (weights_only), and PyTorch's hint to retry with
    weights_only=False is never passed on."""
    not_ours = f"{file} is not a tinylm trainer state"
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # objects other than tensors and containers
        raise ValueError(f"{not_ours}: it holds objects that only an unsafe load could build; "
                         "it was not loaded") from None
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        raise ValueError(f"{not_ours}: it cannot be read (truncated or corrupt: "
                         f"{type(err).__name__})") from None
    missing = [k for k in TRAINER_STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{not_ours}: it lacks {', '.join(missing)}")
    return state


def restore(directory: Path, run_config: dict, tokenizer_file: Path, model: torch.nn.Module,
            optimizer, scaler, warn: Callable[[str], None] = lambda line: None) -> dict:
    """Load `directory`'s weights and optimizer and scaler states, once checked to fit this run;
    returns the trainer state. `warn` gets the line on a schedule changed by train.max_steps."""
    ckpt = load_checkpoint(directory, device="cpu")
    check_resume_matches(ckpt, run_config, tokenizer_file)
    model.load_state_dict(ckpt.model.state_dict())
    state = load_trainer_state(ckpt.trainer_state_path)
    try:
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise ValueError(f"{ckpt.trainer_state_path} does not fit this run's optimizer: "
                         f"{str(err).splitlines()[0]}") from None
    change = schedule_change(ckpt, OptimConfig(**run_config["optim"]),
                             run_config["train"]["max_steps"], state["step"])
    if change:
        warn(change)
    return state

