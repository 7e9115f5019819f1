"""The tinylm-* commands (one module each: its config, what it loads, prints and writes, its
Hydra entry point), and what they share: how a command ends on bad input or a signal, how its
process frees memory and collects garbage (here), and the check of its command line before
Hydra runs it (tinylm/cli/command_line.py).

This package's own import stays light (no Hydra, no torch): the process that draws a training
run's figures is spawned, imports the training command's module again, and needs neither.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

import tinylm.train.threads  # noqa: F401  (threads=auto watches the cores' load from here on)

T = TypeVar("T")

# At exit the interpreter collects its garbage; after torch (and torch._dynamo, which any torch
# optimizer imports) that walk over millions of objects took 0.4-0.9 s of every command's wall
# time. Frozen objects are left out of it; the commands close their files themselves, and
# what is freed by reference counting still is.
atexit.register(gc.freeze)


def keep_freed_memory() -> None:
    """Let glibc's malloc keep the memory a process frees, for its next allocations.

    By default glibc hands freed memory at the top of its heap back to the system once over
    128 KiB of it is free there, and serves blocks from 128 KiB up from fresh mappings until it
    has seen such a block freed. A forward that returns attention weights makes and frees
    ~14 MB of (B, n_head, T, T) intermediates at B=4, T=128, and each call took those pages
    anew from the kernel: ~3,300 page faults and 10-17 ms of system time a call on a Zen 3,
    where the whole forward takes ~30 ms. A default training step faulted ~6,000 pages.
    Blocks up to 64 MiB now come from the heap (full fp32 logits of a (16, 128) batch over
    4,096 tokens are 32 MiB; glibc versions that refuse more than 32 MiB get 32), and up to
    1 GiB may stay free in it for reuse (docs/benchmarks.md). Elsewhere (macOS, Windows, musl)
    the system's allocator is left as it is.
    """
    if sys.platform != "linux":
        return
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library (musl): its allocator as it is
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    # mallopt returns 0 for a value it refuses. Setting either threshold stops glibc from
    # raising the mapping threshold by itself, so the trim threshold is set only once a mapping
    # threshold has been accepted.
    if mallopt(m_mmap_threshold, 64 << 20) or mallopt(m_mmap_threshold, 32 << 20):
        mallopt(m_trim_threshold, 1 << 30)


keep_freed_memory()


def print_what_stdout_can() -> None:
    """Print "?" for a character stdout's encoding has no code for, instead of stopping there.

    Windows encodes redirected output (`tinylm-generate ... > out.txt`, a pipe) in its ANSI code
    page, cp1252 say, which has no √ or · for tinylm-explain, nor the U+FFFD that a barely
    trained model's broken characters decode to.
    """
    if hasattr(sys.stdout, "reconfigure"):  # not where a caller put another stream in its place
        sys.stdout.reconfigure(errors="replace")


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
