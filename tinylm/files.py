"""The files tinylm ships, and output files written whole or not at all.

A run killed while it writes a report, a figure or the inspection's arrays must not leave a
half-written file where the last good one was: each is written to a temporary file beside its
place and renamed onto it (`os.replace`: one step on Linux, macOS and Windows). Checkpoints, a
directory of files, do the same with a directory (tinylm.checkpoint).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def project_root() -> Path | None:
    """The checkout that holds conf/, or None when tinylm runs from an installed wheel."""
    root = PACKAGE_DIR.parent
    return root if (root / "conf" / "config.yaml").is_file() else None


def shipped_dir(in_checkout: str, in_wheel: str) -> Path:
    """A folder of files tinylm ships: `in_checkout` under the checkout's root, or `in_wheel`
    inside the installed package (pyproject's force-include maps one to the other)."""
    root = project_root()
    return root / in_checkout if root is not None else PACKAGE_DIR / in_wheel


@contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; when the block ends, rename it onto `path`.

    If the block raises, `path` keeps what it held before and the temporary file is removed. The
    temporary name keeps no suffix of `path`'s: writers that choose a format from the suffix must
    be told it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` whole or not at all."""
    with replaced_atomically(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | Path, data: dict,
                      default: Callable[[object], object] | None = None) -> None:
    """Write a report as indented JSON to `path` whole or not at all (tinylm-probe,
    tinylm-bench, the inspection's inspect.json); `default` as in json.dumps, for values JSON
    has no type for."""
    write_text_atomic(path, json.dumps(data, indent=2, default=default) + "\n")
