"""What the commands that read a checkpoint (generate, probe, explain, export) share: loading it
(or hf:<id>) on the device asked for, with torch's threads chosen beside it (tinylm.device), and
the folder a report goes to."""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig

from tinylm.checkpoint import (
    CHECKPOINTS_DIR,
    Checkpoint,
    default_logdir,
    load_checkpoint,
    tagged_checkpoint,
)
from tinylm.cli import key_and_value, shell_word
from tinylm.device import ThreadChoice, apply_threads, resolve_device, start_sample


@dataclass
class Loaded:
    """A checkpoint loaded for a command, the device it is on and the threads chosen (if any)."""

    checkpoint: Checkpoint
    device: torch.device
    threads: ThreadChoice

    def line(self, what: str) -> str:
        """The start-up line, e.g. "loaded <dir> (<what>) on cpu, 2 threads (auto: ...)"."""
        return f"loaded {self.checkpoint.directory} ({what}) on {self.device}" \
               f"{self.threads.suffix_on(self.device)}"


def load_for_command(checkpoint: str | None, device: str = "cpu", prefer: str = "best",
                     threads: int | str = "auto") -> Loaded:
    """Load `checkpoint` (a run directory, one checkpoint directory, or hf:<id>) onto `device`,
    then give torch `threads`."""
    if not checkpoint:
        raise ValueError(checkpoint_required())
    # threads=auto watches the cores while the checkpoint loads, and leaves those busy elsewhere
    cpu_sample = start_sample()
    resolved = resolve_device(device)
    ckpt = load_checkpoint(checkpoint, device=resolved, prefer=prefer)
    return Loaded(ckpt, resolved, apply_threads(threads, cpu_sample))


def checkpoint_required() -> str:
    """What a command says when checkpoint= is missing, with the command for the newest run
    under runs/ here, if there is one."""
    said = "checkpoint= is required: a run directory or a checkpoint directory; train one " \
           "first with tinylm-train"
    run = newest_run(Path("runs"))
    if run is None or not HydraConfig.initialized():
        return said
    others = [shlex.quote(arg) for arg in sys.argv[1:] if key_and_value(arg)[0] != "checkpoint"]
    prog = f"tinylm-{HydraConfig.get().job.config_name}"  # each command composes conf/<name>.yaml
    return f"{said}, or use the newest run here, e.g. " + \
        " ".join([prog, shell_word("checkpoint", str(run)), *others])


def newest_run(runs: Path) -> Path | None:
    """The run under `runs` (at most four folders deep: runs/multirun/<day>/<time>/<job>) whose
    last checkpoint was written last; None if none has one."""
    newest, when = None, 0.0
    for depth in range(1, 5):
        for checkpoints in runs.glob("/".join(["*"] * depth + [CHECKPOINTS_DIR])):
            try:  # a tag a careless folder holds (a link to itself) names no checkpoint
                last = tagged_checkpoint(checkpoints, "last")
                written = os.stat(last).st_mtime if last else 0.0
            except (OSError, RuntimeError, ValueError):
                continue
            if written > when:
                newest, when = checkpoints.parent, written
    return newest


def report_dir(logdir: str | None, checkpoint_dir: Path, kind: str) -> tuple[Path, str]:
    """(the folder for a report of `kind`, a note for stderr or ""): logdir=, by default
    <run dir>/<kind>/<timestamp>; never one holding a report already (the attention tab would
    mix the two), but a new folder beside it, or in logdir= (TensorBoard shows it as a run)."""
    def free(folder: Path) -> bool:  # a file there is left for the writer to name
        return not folder.is_dir() or not any(folder.iterdir())

    def unused(parent: Path, name: str) -> Path:  # parent/name, or parent/name-2, name-3, ...
        n = 1
        while not free(chosen := parent / (name if n == 1 else f"{name}-{n}")):
            n += 1
        return chosen

    if logdir is None:
        default = default_logdir(checkpoint_dir, kind)
        return unused(default.parent, default.name), ""  # two in one second: <timestamp>-2
    if free(Path(logdir)):
        return Path(logdir), ""
    chosen = unused(Path(logdir), time.strftime("%Y-%m-%d_%H-%M-%S"))
    return chosen, (f"note: logdir={logdir} holds an earlier report; this one goes to {chosen}, "
                    "a run of its own beside it")
