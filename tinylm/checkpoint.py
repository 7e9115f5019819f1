"""Checkpoints that rebuild themselves, written so that a crash never leaves a broken one.

Layout inside a run directory (docs/training.md says it for users):

    .lock                      held by the process writing the run (.lock.pid: its pid, while held)
    checkpoints/
      step-0000500/            one complete checkpoint
        model.safetensors      weights (safetensors: loading never runs code); its metadata
                               records the model's shape and tokenizer.json's sha256
        model_config.json      ModelConfig, enough to rebuild the model
        config.yaml            the resolved run config
        tokenizer.json         the tokenizer the model was trained with
        trainer_state.pt       optimizer, schedule, step, RNG, sampler state, thread count
      last, best               tag files, each one line naming a step directory ("step-0000500")

A checkpoint is written to a hidden directory and renamed into place; only then do the tags move,
so a kill at any moment leaves the previous complete checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil
import safetensors.torch
import torch
import yaml
from filelock import FileLock, Timeout
from safetensors import SafetensorError

from tinylm.checkpoint_configs import (
    MODEL_RECORD,
    TOKENIZER_RECORD,
    read_model_config,
    read_run_config,
    recorded,
)
from tinylm.files import (
    is_there_as_file,
    published_atomically,
    replaced_atomically,
    reported,
    sweep_leftovers,
)
from tinylm.model import ModelConfig, TinyLM
from tinylm.pretrained import build, is_pretrained, load_pretrained, model_name
from tinylm.tokenizer import CharTokenizer, Tokenizer, load_tokenizer

try:
    import fcntl
except ImportError:  # Windows: no flock, and no file there is removed while it is open
    fcntl = None

CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_FILE = "model.safetensors"
MODEL_CONFIG_FILE = "model_config.json"
RUN_CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
TRAINER_STATE_FILE = "trainer_state.pt"
LOCK_FILE = ".lock"  # held by the process writing the run directory
LOCK_PID_FILE = ".lock.pid"  # beside it (the lock file itself is truncated by each taker)
TAGS = ("last", "best")
READ_TRIES = 10  # a checkpoint superseded and removed while read is read again, the newest
_STEP_DIR = re.compile(r"^step-\d+(-\d+)?$")

log = logging.getLogger(__name__)


class RunDirInUse(ValueError):
    """Another live process holds the run directory's lock."""


class NonFiniteWeights(ValueError):
    """The weights hold NaN or inf: such a model is neither saved as a checkpoint nor loaded."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model in eval mode, and what it was trained with."""

    directory: Path
    model: TinyLM
    config: ModelConfig
    tokenizer: Tokenizer
    run_config: dict
    trainer_state_path: Path | None


def _resolved(path: Path) -> Path:
    """path.resolve(), refusing in one line a link that loops back to itself."""
    try:
        path.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link that loops back to itself: remove it, "
                             "or point it at a checkpoint directory") from None
    return path.resolve()


def tagged(checkpoints: Path, tag: str) -> Path | None:
    """The step directory that checkpoints/<tag> names, which may be missing; None: no such tag.
    A tag naming anything but a step directory beside it (`../elsewhere`) names nothing."""
    path = checkpoints / tag
    if path.is_symlink() or path.is_dir():  # an older run's link, or a checkpoint copied in
        return _resolved(path)  # its place (`cp -r` follows links)
    if not path.is_file():
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        name = f.read(64).strip()
    return _resolved(checkpoints / name) if _STEP_DIR.match(name) else None


def tagged_checkpoint(checkpoints: Path, tag: str) -> Path | None:
    """The step directory that checkpoints/<tag> names, where it exists. A run moves the tag on
    before it removes the step the tag named: a missing step is looked up in the tag again."""
    for _ in range(READ_TRIES):
        named = tagged(checkpoints, tag)
        if named is None or named.is_dir():
            return named
    return None


def _remove_unreferenced(checkpoints: Path) -> None:
    """Delete step directories no tag points at (this process's temporary ones are gone)."""
    keep = set()
    for tag in TAGS:
        with suppress(ValueError):  # a tag linked to itself keeps no step
            named = tagged(checkpoints, tag)
            if named:
                keep.add(named.name)
    for entry in checkpoints.iterdir():
        if entry.is_dir() and not entry.is_symlink() and _STEP_DIR.match(entry.name) \
                and entry.name not in keep:
            with _step_lock(entry, shared=False) as alone:
                if alone:  # one being read goes at the next save
                    shutil.rmtree(entry, ignore_errors=True)


@contextmanager
def _step_lock(step: Path, shared: bool) -> Iterator[bool]:
    """Inside, a flock on `step` (shared for a reader), never waited for: True where taken, or
    where directories cannot be locked (Windows) or `step` is gone (its reader meets that)."""
    try:
        fd = os.open(step, os.O_RDONLY) if fcntl else None
    except OSError:
        fd = None
    try:
        held = True
        if fd is not None:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                held = False
        yield held
    finally:
        if fd is not None:
            os.close(fd)


def _point_tags(checkpoints: Path, tags: tuple[str, ...], name: str) -> None:
    """Point each tag at `name`, all written before any is renamed: a full disk moves none."""
    with ExitStack() as renamed_on_exit:
        for tag in tags:
            tmp = renamed_on_exit.enter_context(replaced_atomically(checkpoints / tag))
            tmp.write_text(f"{name}\n", encoding="utf-8")


@contextmanager
def run_dir_lock(run_dir: str | Path) -> Iterator[None]:
    """Hold `run_dir`'s lock while writing it (RunDirInUse for a second process); the OS drops
    a killed holder's lock, and what it left half-written is swept here."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    with reported(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
    lock_file, pid_file = run_dir / LOCK_FILE, run_dir / LOCK_PID_FILE
    made = not lock_file.exists()
    lock = FileLock(lock_file)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        holder = pid_file.read_text().strip() if pid_file.is_file() else "unknown"
        raise RunDirInUse(f"{run_dir} is in use by another process (pid {holder}); wait for it "
                          "to end or choose another hydra.run.dir") from None
    ended = False
    try:
        stale = pid_file.read_text().strip() if pid_file.is_file() else ""
        with reported(pid_file):
            pid_file.write_text(f"{os.getpid()}\n")
        if stale.isdigit() and not psutil.pid_exists(int(stale)):
            log.info(f"removed a stale lock of pid {stale} (a killed run)")
        removed = sweep_leftovers(run_dir / CHECKPOINTS_DIR)
        if removed:
            log.info(f"removed what an interrupted save left in {run_dir / CHECKPOINTS_DIR}: "
                     f"{', '.join(removed)}")
        yield
        ended = True
    finally:
        pid_file.unlink(missing_ok=True)
        if made and not ended:
            # Removed while still held: a process that opened it meanwhile finds it unlinked
            # once it gets the lock, and makes a fresh one. Windows removes no open file:
            # filelock removes it there on release.
            with suppress(PermissionError):
                lock_file.unlink(missing_ok=True)
        lock.release()
        if created and [p.name for p in run_dir.iterdir()] in ([LOCK_FILE], []):
            # a run refused before its first file: leave no empty run directory behind
            lock_file.unlink(missing_ok=True)
            run_dir.rmdir()


def _save_trainer_state(state: dict, file: Path) -> None:
    """torch.save, raising the disk's own OSError: torch's zip writer reports a full disk as a
    RuntimeError, which keeps the OSError only when writing a file object."""
    with open(file, "wb") as f:
        try:
            torch.save(state, f)
        except RuntimeError as err:
            if isinstance(err.__context__, OSError):
                raise err.__context__ from None
            raise


def _refuse_non_finite(model: TinyLM, weights: Path | None = None) -> None:
    """Raise NonFiniteWeights naming the first weight of `model` (from `weights`) not finite."""
    bad = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
    if bad and weights is None:
        raise NonFiniteWeights(f"the weights are not finite ({bad} holds NaN or inf)")
    if bad:
        raise NonFiniteWeights(f"{weights} holds NaN or inf in {bad}: the model diverged or the "
                               "file was altered; load an earlier checkpoint of the run, or "
                               "download or export the model again")


def _sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def _records(model: TinyLM, tokenizer: Tokenizer, tokenizer_file: Path) -> dict[str, str]:
    """model.safetensors' metadata: what loading checks model_config.json and tokenizer.json
    against (a model_config.json with another n_head fits the same weights)."""
    kind = "char" if isinstance(tokenizer, CharTokenizer) else "bpe"
    # the model's shape: a run may continue with another dropout
    shape = {k: v for k, v in model.config.to_dict().items() if k != "dropout"}
    return {MODEL_RECORD: json.dumps(shape),
            TOKENIZER_RECORD: json.dumps({"kind": kind, "vocab_size": tokenizer.vocab_size,
                                          "sha256": _sha256(tokenizer_file)})}


def save_checkpoint(run_dir: str | Path, model: TinyLM, tokenizer: Tokenizer, run_config: dict,
                    step: int, trainer_state: dict | None = None,
                    tags: tuple[str, ...] = ("last",)) -> Path:
    """Write a complete checkpoint for `step` and point each tag at it; a refused write raises
    NotWritten naming the file, leaving nothing of this checkpoint and the tags as they were."""
    _refuse_non_finite(model)
    checkpoints = Path(run_dir) / CHECKPOINTS_DIR
    # a name no tag points at yet: saving the same step twice must not touch the first copy
    name, n = f"step-{step:07d}", 1
    while (checkpoints / name).exists():
        name, n = f"step-{step:07d}-{n}", n + 1
    final = checkpoints / name
    try:
        with published_atomically(final) as tmp:  # renamed onto `final` once complete
            def write(file: str, writer) -> None:
                with reported(tmp / file):  # named final/<file> by published_atomically
                    writer(tmp / file)

            write(TOKENIZER_FILE, tokenizer.save)  # first: the weights record its sha256
            # save_model (not save_file) handles the tied embedding / LM head
            write(WEIGHTS_FILE, lambda f: safetensors.torch.save_model(
                model, str(f), metadata=_records(model, tokenizer, tmp / TOKENIZER_FILE)))
            write(MODEL_CONFIG_FILE,
                  lambda f: f.write_text(json.dumps(model.config.to_dict(), indent=2) + "\n"))
            write(RUN_CONFIG_FILE,
                  lambda f: f.write_text(yaml.safe_dump(run_config, sort_keys=False)))
            if trainer_state is not None:
                write(TRAINER_STATE_FILE, lambda f: _save_trainer_state(trainer_state, f))
        _point_tags(checkpoints, tags, name)
    except BaseException:  # a full disk, or Ctrl-C: nothing of this checkpoint stays
        if checkpoints.is_dir():  # the new step, if it was renamed but never tagged
            _remove_unreferenced(checkpoints)
        raise
    _remove_unreferenced(checkpoints)
    return final


def resolve_checkpoint_dir(path: str | Path, prefer: str = "best") -> Path:
    """The checkpoint directory meant by `path`: a run dir, its checkpoints/, one checkpoint, or
    a tag (`checkpoints/best`); within a run, tag `prefer` where it exists, else the other."""
    path = Path(path)
    if not path.exists():
        _resolved(path)  # a link to itself does not "exist" either: say what it is
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
    if not path.is_dir():  # README.md, or model.safetensors itself: not what checkpoint= takes
        raise FileNotFoundError(f"{path} is a file, not a checkpoint: checkpoint= takes a run "
                                "directory, its checkpoints/, one checkpoint directory, a Hugging "
                                "Face folder or hf:<id>")
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


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    prefer: str = "best") -> Checkpoint:
    """Rebuild model and tokenizer from a checkpoint (see resolve_checkpoint_dir) or hf:<id> or
    its folder; one superseded and removed while it was read is read again, the newest."""
    if is_pretrained(path):
        model, tokenizer, directory = load_pretrained(path)
        _refuse_non_finite(model, directory / WEIGHTS_FILE)
        return Checkpoint(directory, model.to(device), model.config, tokenizer, {}, None)
    for _ in range(READ_TRIES):
        directory = resolve_checkpoint_dir(path, prefer)
        try:
            with _step_lock(directory, shared=True) as held:
                if not held:
                    raise FileNotFoundError(f"{directory} is being removed: a newer checkpoint "
                                            "superseded it")
                return _read_checkpoint(directory, device)
        except Exception:  # unless it was superseded and removed meanwhile: its own error
            if directory.is_dir() and resolve_checkpoint_dir(path, prefer) == directory:
                raise
    raise FileNotFoundError(f"the checkpoint of {path} was superseded and removed while it was "
                            f"read, {READ_TRIES} times: the run saves faster than it can be read; "
                            "copy a checkpoint directory elsewhere and load that")


def _read_checkpoint(directory: Path, device: str | torch.device) -> Checkpoint:
    """The checkpoint in step directory `directory`."""
    for name, what in ((WEIGHTS_FILE, "weights file"), (TOKENIZER_FILE, "tokenizer"),
                       (TRAINER_STATE_FILE, None)):  # a FIFO is refused before anything is read
        if not is_there_as_file(directory / name) and what:
            raise FileNotFoundError(f"checkpoint is missing its {what} {directory / name}")
    weights, tokenizer_file = directory / WEIGHTS_FILE, directory / TOKENIZER_FILE
    config, records = read_model_config(directory / MODEL_CONFIG_FILE, weights)
    tokenizer = load_tokenizer(str(tokenizer_file))
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"{tokenizer_file} has {tokenizer.vocab_size} tokens but "
                         f"{directory / MODEL_CONFIG_FILE} says vocab_size={config.vocab_size}")
    saved = recorded(records, TOKENIZER_RECORD, weights)
    if saved and _sha256(tokenizer_file) != saved.get("sha256"):
        # as many tokens, other ids: a tokenizer.json copied from another corpus
        raise ValueError(f"{tokenizer_file} is not the tokenizer {weights} was trained with (a "
                         f"{saved.get('kind')} tokenizer of {saved.get('vocab_size')} tokens, "
                         f"sha256 {str(saved.get('sha256'))[:16]}...); put back the "
                         "tokenizer.json of the run that trained it")
    model = build(config)
    try:
        safetensors.torch.load_model(model, str(weights), strict=True)
    except (SafetensorError, RuntimeError, OSError) as err:
        raise ValueError(f"{weights} cannot be loaded into the model that "
                         f"{directory / MODEL_CONFIG_FILE} describes (truncated or mismatched?):"
                         f" {err}") from err
    _refuse_non_finite(model, weights)
    state = directory / TRAINER_STATE_FILE
    model.to(device).eval()
    run_config = read_run_config(directory / RUN_CONFIG_FILE)
    return Checkpoint(directory, model, config, tokenizer, run_config,
                      state if state.is_file() else None)


def default_logdir(checkpoint_dir: Path, kind: str = "inspect") -> Path:
    """<run dir>/<kind>/<timestamp>, or runs/pretrained/<name>/<kind>/<timestamp>."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    if is_pretrained(checkpoint_dir):
        return Path("runs") / "pretrained" / model_name(checkpoint_dir) / kind / stamp
    run_dir = Path(checkpoint_dir).parent
    if run_dir.name == "checkpoints":
        run_dir = run_dir.parent
    return run_dir / kind / stamp
