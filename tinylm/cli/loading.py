"""How the commands that read a checkpoint (generate, probe, explain, export) load it: the
checkpoint or hf:<id>, on the device asked for, then torch's threads, and the start-up line."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinylm.checkpoint import Checkpoint, load_checkpoint
from tinylm.device import resolve_device
from tinylm.train.threads import ThreadChoice, apply_threads, start_sample


@dataclass
class Loaded:
    """A checkpoint loaded for a command, the device it is on and the threads chosen (if any)."""

    checkpoint: Checkpoint
    device: torch.device
    threads: ThreadChoice | None

    def line(self, what: str) -> str:
        """The start-up line, e.g. "loaded <dir> (<what>) on cpu, 2 threads (auto: ...)"."""
        threads = self.threads.suffix_on(self.device) if self.threads else ""
        return f"loaded {self.checkpoint.directory} ({what}) on {self.device}{threads}"


def load_for_command(checkpoint: str | None, device: str = "cpu", prefer: str = "best",
                     threads: int | str | None = None) -> Loaded:
    """Load `checkpoint` (a run directory, one checkpoint directory, or hf:<id>) onto `device`,
    then give torch `threads` (None: leave them as they are)."""
    if not checkpoint:
        raise ValueError("checkpoint= is required: a run directory or a checkpoint directory")
    # threads=auto watches the cores while the checkpoint loads, and leaves those busy elsewhere
    cpu_sample = start_sample() if threads is not None else None
    resolved = resolve_device(device)
    ckpt = load_checkpoint(checkpoint, device=resolved, prefer=prefer)
    chosen = apply_threads(threads, cpu_sample) if threads is not None else None
    return Loaded(ckpt, resolved, chosen)
