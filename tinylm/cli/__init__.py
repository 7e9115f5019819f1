"""Thin Hydra entry points behind the tinylm-* console scripts."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_or_exit(command: str, action: Callable[[], T], interrupted: str = "interrupted",
                errors: tuple[type[Exception], ...] = (ValueError, FileNotFoundError)) -> T:
    """Run `action`; a bad input exits with one line `<command>: error: ...`, not a traceback."""
    try:
        return action()
    except errors as err:
        sys.exit(f"{command}: error: {err}")
    except KeyboardInterrupt:
        sys.exit(f"\n{command}: {interrupted}")
