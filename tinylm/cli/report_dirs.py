"""Where a report of inspect=true or tinylm-probe goes: a folder of its own, never one that holds
another report already (the attention tab would show the tokens of one beside the weights of the
other, the pairs of one probe file beside the effects of another)."""

from __future__ import annotations

import time
from pathlib import Path

from tinylm.checkpoint import default_logdir


def _free(folder: Path) -> bool:
    """Nothing is there, or an empty folder (a file there is left for the writer to name)."""
    return not folder.is_dir() or not any(folder.iterdir())


def _unused(parent: Path, name: str) -> Path:
    """parent/name, or the first free parent/name-2, name-3, ..."""
    n = 1
    while not _free(chosen := parent / (name if n == 1 else f"{name}-{n}")):
        n += 1
    return chosen


def report_dir(logdir: str | None, checkpoint_dir: Path, kind: str) -> tuple[Path, str]:
    """(the folder to write a report of `kind` to, a note for stderr or ""): logdir=, or by
    default <run dir>/<kind>/<timestamp>. Where logdir= holds something already, a subfolder of
    it named by the time, which TensorBoard opened on logdir= shows as a run of its own."""
    if logdir is None:
        default = default_logdir(checkpoint_dir, kind)
        return _unused(default.parent, default.name), ""  # two in one second: <timestamp>-2
    given = Path(logdir)
    if _free(given):
        return given, ""
    chosen = _unused(given, time.strftime("%Y-%m-%d_%H-%M-%S"))
    return chosen, (f"note: logdir={logdir} holds an earlier report; this one goes to {chosen}, "
                    "a run of its own beside it")
