"""Checkpoints that rebuild themselves, written so that a crash never leaves a broken one.

Layout inside a run directory:

    .lock                      held by the process writing the run (.lock.pid: its pid, while held)
    checkpoints/
      step-0000500/            one complete checkpoint
        model.safetensors      weights (safetensors: loading never runs code)
        model_config.json      ModelConfig, enough to rebuild the model
        config.yaml            the resolved run config
        tokenizer.json         the tokenizer the model was trained with
        trainer_state.pt       optimizer, schedule, step, RNG, sampler state, thread count
      last -> step-0000500     symlinks, switched atomically (tag files where there are none)
      best -> step-0000250

A checkpoint is written to a hidden directory, flushed and renamed into place; only then is a
tag re-pointed (a fresh symlink, or a tag file where there are none, renamed onto it), so a kill at
any moment leaves the previous complete checkpoint. Non-finite weights are never written, a failed
write leaves nothing behind, and one process at a time writes a run directory (`run_dir_lock`).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import yaml
from filelock import FileLock, Timeout
from safetensors import SafetensorError, safe_open

from tinylm.model import ModelConfig, TinyLM
from tinylm.tokenizer import Tokenizer, load_tokenizer

CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_FILE = "model.safetensors"
MODEL_CONFIG_FILE = "model_config.json"
RUN_CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
TRAINER_STATE_FILE = "trainer_state.pt"
LOCK_FILE = ".lock"  # held by the process writing the run directory
LOCK_PID_FILE = ".lock.pid"  # beside it (the lock file itself is truncated by each taker)
TAGS = ("last", "best")
_STEP_DIR = re.compile(r"^step-\d+(-\d+)?$")
_TMP_PREFIX = ".tmp-"
# What os.symlink raises on a disk that holds no symlinks (vfat on Linux: EPERM; exFAT on macOS:
# ENOTSUP); anything else, a full disk say, is a failure to report.
_NO_SYMLINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}

log = logging.getLogger(__name__)


class RunDirInUse(ValueError):
    """Another live process holds the run directory's lock."""


class NonFiniteWeights(ValueError):
    """The weights hold NaN or inf: such a model is not saved as a checkpoint."""


class CheckpointNotWritten(OSError):
    """Writing a checkpoint failed (e.g. the disk is full); nothing of it was left behind."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model in eval mode, and what it was trained with."""

    directory: Path
    model: TinyLM
    config: ModelConfig
    tokenizer: Tokenizer
    run_config: dict
    trainer_state_path: Path | None


def _fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to the disk."""
    windows = os.name == "nt"
    if windows and path.is_dir():
        return  # Windows cannot open a directory as a file; NTFS journals the renames in it
    # Windows flushes only a file opened for writing
    fd = os.open(path, (os.O_RDWR | getattr(os, "O_BINARY", 0)) if windows else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point(checkpoints: Path, tag: str, target: str) -> None:
    """Atomically make checkpoints/<tag> name checkpoints/<target>: a relative symlink, or a tag
    file holding the name where the system or the disk makes no symlinks."""
    tmp = checkpoints / f"{_TMP_PREFIX}{tag}-{os.getpid()}"  # this process's own name
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    # Windows: symlinks need a privilege most users lack, and os.replace cannot move a
    # directory's link onto another, so it always gets tag files
    linked = os.name != "nt"
    if linked:
        try:
            os.symlink(target, tmp)
        except OSError as err:
            if err.errno not in _NO_SYMLINKS:
                raise
            linked = False
    if not linked:
        tmp.write_text(f"{target}\n", encoding="utf-8")
        _fsync(tmp)
    os.replace(tmp, checkpoints / tag)


def tagged(checkpoints: Path, tag: str) -> Path | None:
    """The step directory that checkpoints/<tag> names, which may be missing; None: no such tag.

    A tag is a symlink, a tag file (one line, a step directory's name), or a checkpoint copied in
    its place (`cp -r` follows links). A tag file naming anything but a step directory beside it
    names nothing: a hand-edited `../elsewhere` is not followed.
    """
    path = checkpoints / tag
    if path.is_symlink() or path.is_dir():
        return path.resolve()
    if not path.is_file():
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        name = f.read(64).strip()
    return (checkpoints / name).resolve() if _STEP_DIR.match(name) else None


def tagged_checkpoint(checkpoints: Path, tag: str) -> Path | None:
    """The step directory that checkpoints/<tag> names, where it exists."""
    named = tagged(checkpoints, tag)
    return named if named and named.is_dir() else None


def _remove_unreferenced(checkpoints: Path) -> None:
    """Delete step directories no tag points at (this process's temporary ones are gone)."""
    keep = {named.name for named in (tagged(checkpoints, tag) for tag in TAGS) if named}
    for entry in checkpoints.iterdir():
        if entry.is_dir() and not entry.is_symlink() and _STEP_DIR.match(entry.name) \
                and entry.name not in keep:
            shutil.rmtree(entry, ignore_errors=True)


def _remove_leftovers(checkpoints: Path) -> list[str]:
    """Delete what killed writers left (temporary directories and links); call it only while
    holding the run directory's lock, which proves that no other process is writing here."""
    removed = []
    for entry in checkpoints.glob(f"{_TMP_PREFIX}*") if checkpoints.is_dir() else ():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


@contextmanager
def run_dir_lock(run_dir: str | Path) -> Iterator[None]:
    """Hold `run_dir`'s lock while writing it: a second process is refused (RunDirInUse, naming
    the holder's pid). The OS drops the lock when its holder dies, even by kill -9, so a crashed
    run never blocks its resume; what the dead writer left half-written is removed here."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(run_dir / LOCK_FILE)
    pid_file = run_dir / LOCK_PID_FILE
    try:
        lock.acquire(timeout=0)
    except Timeout:
        holder = pid_file.read_text().strip() if pid_file.is_file() else "unknown"
        raise RunDirInUse(f"{run_dir} is in use by another process (pid {holder}); wait for it "
                          "to end or choose another hydra.run.dir") from None
    try:
        pid_file.write_text(f"{os.getpid()}\n")
        removed = _remove_leftovers(run_dir / CHECKPOINTS_DIR)
        if removed:
            log.info(f"removed what an interrupted save left in {run_dir / CHECKPOINTS_DIR}: "
                     f"{', '.join(removed)}")
        yield
    finally:
        pid_file.unlink(missing_ok=True)
        lock.release()
        if created and [p.name for p in run_dir.iterdir()] in ([LOCK_FILE], []):
            # a run refused before its first file: leave no empty run directory behind
            (run_dir / LOCK_FILE).unlink(missing_ok=True)
            run_dir.rmdir()


def mount_point(path: Path) -> Path:
    """The mount point (the disk) that holds `path`."""
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def save_checkpoint(run_dir: str | Path, model: TinyLM, tokenizer: Tokenizer, run_config: dict,
                    step: int, trainer_state: dict | None = None,
                    tags: tuple[str, ...] = ("last",)) -> Path:
    """Write a complete checkpoint for `step` and point each tag ("last", "best") at it."""
    for tag in tags:
        if tag not in TAGS:
            raise ValueError(f"checkpoint tag {tag!r} is not allowed; allowed: {', '.join(TAGS)}")
    model = getattr(model, "module", model)  # unwrap DistributedDataParallel
    model = getattr(model, "_orig_mod", model)  # unwrap torch.compile
    for param_name, p in model.named_parameters():  # a diverged model is never a checkpoint
        if not torch.isfinite(p).all():
            raise NonFiniteWeights(f"the weights are not finite ({param_name} holds NaN or inf)")
    checkpoints = Path(run_dir) / CHECKPOINTS_DIR
    checkpoints.mkdir(parents=True, exist_ok=True)

    # A name no tag points at yet: saving the same step twice must not touch the first copy.
    name, n = f"step-{step:07d}", 1
    while (checkpoints / name).exists():
        name, n = f"step-{step:07d}-{n}", n + 1
    tmp = checkpoints / f"{_TMP_PREFIX}{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # save_model (not save_file) handles the tied embedding / LM head
        safetensors.torch.save_model(model, str(tmp / WEIGHTS_FILE))
        (tmp / MODEL_CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
        (tmp / RUN_CONFIG_FILE).write_text(yaml.safe_dump(run_config, sort_keys=False))
        tokenizer.save(str(tmp / TOKENIZER_FILE))
        if trainer_state is not None:
            torch.save(trainer_state, tmp / TRAINER_STATE_FILE)
        for file in tmp.iterdir():
            _fsync(file)
        _fsync(tmp)
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        disk = mount_point(checkpoints)
        free = shutil.disk_usage(disk).free
        full = getattr(err, "errno", None) == errno.ENOSPC or "No space" in str(err) or \
            free < 2 * sum(p.numel() * p.element_size() for p in model.parameters())
        reason = f"no space left on {disk} ({free / 2**20:.1f} MiB free)" if full else \
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        raise CheckpointNotWritten(f"the checkpoint of step {step} could not be written to "
                                   f"{checkpoints}: {reason}") from err

    os.rename(tmp, checkpoints / name)
    _fsync(checkpoints)
    for tag in tags:
        _point(checkpoints, tag, name)
    _fsync(checkpoints)
    _remove_unreferenced(checkpoints)
    return checkpoints / name


def resolve_checkpoint_dir(path: str | Path, prefer: str = "best") -> Path:
    """The checkpoint directory meant by `path`: a run dir, its checkpoints/, one checkpoint, or
    a tag (`checkpoints/best`, a link or a tag file).

    Within a run, `prefer` ("best" or "last") is taken when it exists, else the other tag.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if (path / WEIGHTS_FILE).exists() or (path / MODEL_CONFIG_FILE).exists():
        # through a `last`/`best` link, read the step directory itself: the link may move on
        return path.resolve()
    if path.is_file() and path.name in TAGS:
        named = tagged(path.parent, path.name)
        if named is None or not named.is_dir():
            raise FileNotFoundError(f"{path} names no checkpoint directory beside it"
                                    + (f" ({named.name} is missing)" if named else ""))
        return named
    order = [prefer] + [t for t in TAGS if t != prefer]
    for base in (path, path / CHECKPOINTS_DIR):
        for tag in order:
            found = tagged_checkpoint(base, tag)
            if found is None:
                continue
            for other in TAGS:  # say so when a tag was passed over: the step it names is gone
                named = tagged(base, other)
                if other != tag and named is not None and not named.is_dir():
                    log.warning(f"{base / other} points at {named.name}, which is missing; "
                                f"using {tag} ({found.name}) instead")
            return found
    raise FileNotFoundError(
        f"no checkpoint found in {path}: expected {path / WEIGHTS_FILE}, or "
        f"{path / CHECKPOINTS_DIR}/best or {path / CHECKPOINTS_DIR}/last")


def _read_model_config(file: Path, weights: Path) -> ModelConfig:
    """The model config, checked against the weights file before any memory is allocated."""
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
        config = ModelConfig(**values)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint is missing {file}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"{file} is not a valid model config: {str(err).splitlines()[0]}"
                         ) from None
    if not weights.is_file():
        raise FileNotFoundError(f"checkpoint is missing its weights file {weights}")
    # The model the config describes, on the meta device: shapes only, no memory. An absurd
    # config (n_embd: 400000000) then cannot ask for terabytes: it must match the weights file.
    with torch.device("meta"):
        wanted = sum(p.numel() for p in TinyLM(config).parameters())
    try:
        with safe_open(str(weights), "pt") as f:
            stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{weights} is not a safetensors file (truncated or corrupt?): "
                         f"{str(err).splitlines()[0]}") from None
    if wanted != stored:
        raise ValueError(f"{file} describes a model of {wanted:,} parameters but {weights} "
                         f"holds {stored:,}: they are not one checkpoint")
    return config


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    prefer: str = "best") -> Checkpoint:
    """Rebuild model and tokenizer from a checkpoint (see resolve_checkpoint_dir for `path`)."""
    directory = resolve_checkpoint_dir(path, prefer)
    weights = directory / WEIGHTS_FILE
    config = _read_model_config(directory / MODEL_CONFIG_FILE, weights)
    model = TinyLM(config)
    try:
        safetensors.torch.load_model(model, str(weights), strict=True)
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


def default_logdir(checkpoint_dir: Path, kind: str = "inspect") -> Path:
    """<run dir>/<kind>/<timestamp> for a checkpoint inside <run dir>/checkpoints/."""
    run_dir = Path(checkpoint_dir).parent
    if run_dir.name == "checkpoints":
        run_dir = run_dir.parent
    return run_dir / kind / time.strftime("%Y-%m-%d_%H-%M-%S")
