"""The tinylm-* commands (one module each: its config, what it loads, prints and writes, its
Hydra entry point), and what they share: how a command ends on bad input or a signal (here),
and the check of its command line before Hydra runs it (tinylm/cli/command_line.py).

This package's own import stays light (no Hydra, no torch): the process that draws a training
run's figures is spawned, imports the training command's module again, and needs neither.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import tinylm.threads  # noqa: F401  (threads=auto watches the cores' load from here on)

T = TypeVar("T")

# At exit the interpreter collects its garbage; after torch (and torch._dynamo, which any torch
# optimizer imports) that walk over millions of objects took 0.4-0.9 s of every command's wall
# time. Frozen objects are left out of it; the commands close their files themselves, and
# what is freed by reference counting still is.
atexit.register(gc.freeze)


def run_or_exit(command: str, action: Callable[[], T], interrupted: str = "interrupted",
                errors: tuple[type[Exception], ...] = (ValueError, FileNotFoundError)) -> T:
    """Run `action`; a bad input exits with one line `<command>: error: ...`, not a traceback.

    Ctrl-C exits with 130 and SIGTERM with 143 (128 + the signal), as a shell reports a process
    the signal ended: a script running the command sees that it was stopped, not that it failed.
    """
    try:
        return action()
    except errors as err:
        sys.exit(f"{command}: error: {err}")
    except KeyboardInterrupt as err:
        print(f"\n{command}: {interrupted}", file=sys.stderr)
        sys.exit(128 + getattr(err, "signum", signal.SIGINT))


def write_json_atomic(path: Path, data: dict) -> None:
    """Write a report as JSON to a temporary file, then rename it into place: never a
    half-written report (tinylm-probe, tinylm-bench)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
