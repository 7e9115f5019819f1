"""The files tinylm ships, what it reads from outside, and how every output is written: whole or
not at all (a temporary name beside its place, flushed, renamed onto it). A refused write gives one
NotWritten line naming the file and the free space; what a killed writer left is swept by the next
write in the same place (`sweep_leftovers`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
from safetensors import SafetensorError

PACKAGE_DIR = Path(__file__).resolve().parent


def project_root() -> Path | None:
    """The checkout that holds conf/, or None when tinylm runs from an installed wheel."""
    root = PACKAGE_DIR.parent
    return root if (root / "conf" / "config.yaml").is_file() else None


def shipped_dir(in_checkout: str, in_wheel: str) -> Path:
    """A shipped folder: `in_checkout` of a checkout, or `in_wheel` of the installed package."""
    root = project_root()
    return root / in_checkout if root is not None else PACKAGE_DIR / in_wheel


class NotWritten(OSError):
    """A refused write: one line naming the file and the free space; its place is intact."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code  # ENOSPC: the disk is full


def not_written(path: str | Path, err: BaseException) -> NotWritten:
    """The NotWritten reporting `err` at `path`. A writer without errno (safetensors) on a disk
    with no room left is taken as having met a full disk."""
    lines = str(err).strip().splitlines()
    reason = getattr(err, "strerror", None) or (lines[0] if lines else type(err).__name__)
    disk, errno_ = Path(os.path.abspath(path)), getattr(err, "errno", None)
    while not os.path.ismount(disk) and disk != disk.parent:  # the mount that holds `path`
        disk = disk.parent
    try:
        free = shutil.disk_usage(disk).free
        space = f"{free / 2**20:,.1f} MiB free on {disk}"
        if errno_ is None and free < 2**20:
            errno_ = errno.ENOSPC
    except OSError:
        space = f"free space on {disk} unknown"
    return NotWritten(f"{path} could not be written: {reason} ({space})", errno_)


@contextmanager
def reported(path: str | Path) -> Iterator[None]:
    """Turn a write's failure inside the block into NotWritten naming `path`."""
    try:
        yield
    except NotWritten:
        raise
    # safetensors raises its own SafetensorError (torch.save's RuntimeError: its caller names it)
    except (OSError, SafetensorError) as err:
        raise not_written(path, err) from err


def fsync(path: str | Path) -> None:
    """Flush a file, or a directory's entries, to the disk."""
    path = Path(path)
    windows = os.name == "nt"
    if windows and path.is_dir():
        return  # Windows cannot open a directory as a file; NTFS journals the renames in it
    # Windows flushes only a file opened for writing
    fd = os.open(path, (os.O_RDWR | getattr(os, "O_BINARY", 0)) if windows else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path, label: str = "tmp") -> Path:
    """`.<name>.<label>-<pid>-<hex>` beside `path`: sweep_leftovers knows it once pid is gone."""
    return path.with_name(f".{path.name}.{label}-{os.getpid()}-{secrets.token_hex(4)}")


_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<label>tmp|old)-(?P<pid>\d+)-[0-9a-f]+$")


def sweep_leftovers(directory: str | Path, name: str | None = None) -> list[str]:
    """Remove what killed processes left in `directory` (of `name` only, if given) and return
    the names; a folder moved aside (`.old`) whose place is empty is put back: the only copy."""
    directory = Path(directory)
    removed = []
    for entry in directory.iterdir() if directory.is_dir() else ():
        match = _LEFTOVER.match(entry.name)
        if not match or name not in (None, match["name"]) or psutil.pid_exists(int(match["pid"])):
            continue
        with suppress(OSError):  # best effort: what cannot go now goes at a later write
            if match["label"] == "old" and not os.path.lexists(directory / match["name"]):
                os.rename(entry, directory / match["name"])
                continue
            remove(entry)
            removed.append(entry.name)
    return removed


def remove(path: Path) -> None:
    """Remove a file or a link, or a folder with all it holds (never what a link points at)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def nearest_folder(directory: Path, key: str, value: object, purpose: str) -> Path:
    """The folder `directory` is made in: its parent, or the nearest existing one above. A file
    or a dangling link where a folder must be is refused in one line naming `key`."""
    place = directory
    while not place.is_dir():
        if os.path.lexists(place):
            what = f"a link to {os.readlink(place)}, which leads to no folder" \
                if place.is_symlink() else "a file"
            raise ValueError(f"{key}={value} {purpose}: {place} is {what}; name a folder with "
                             f"{key}=/path/to/folder")
        place = place.parent
    return directory.parent if place == directory else place


def plain_mode(file: Path) -> None:
    """Give `file` the mode the umask gives a new file: safetensors makes its own 0600."""
    mask = os.umask(0o077)  # os.umask reads the mask only by setting one
    os.umask(mask)
    os.chmod(file, 0o666 & ~mask)


@contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; when the block ends, flush it and rename it
    onto `path`. A failed block leaves `path` as it was (a refused write: NotWritten). The
    temporary name keeps no suffix: a writer that picks its format by suffix must be told."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with reported(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            sweep_leftovers(path.parent, path.name)
            yield tmp
            plain_mode(tmp)
            fsync(tmp)
            os.replace(tmp, path)
    finally:
        remove(tmp)


@contextmanager
def published_atomically(directory: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `directory` to fill; when the block ends, flush it and
    publish it: renamed into place, or each file moved into an existing `directory`, or with
    `replace` swapped whole for it. A failed block leaves `directory` as it was."""
    directory = Path(directory)
    build, old = temporary_name(directory), temporary_name(directory, "old")
    made = [p for p in Path(os.path.abspath(directory)).parents if not p.exists()]
    try:
        with reported(directory):
            sweep_leftovers(directory.parent, directory.name)
            build.mkdir(parents=True)
            yield build
            for path in [*build.rglob("*"), build]:
                if path.is_file():
                    plain_mode(path)
                fsync(path)
            if replace and directory.exists():
                os.rename(directory, old)  # moved back below if the new one cannot go in
            if directory.exists():
                for file in sorted(build.rglob("*")):
                    if file.is_file():
                        target = directory / file.relative_to(build)
                        target.parent.mkdir(parents=True, exist_ok=True)
                        os.replace(file, target)
            else:
                os.rename(build, directory)
            fsync(directory)
            fsync(directory.parent)
    except NotWritten as err:  # a file written into the folder: named where it was to go
        if str(build) not in str(err):
            raise
        raise NotWritten(str(err).replace(str(build), str(directory)), err.errno) \
            from err.__cause__
    finally:
        remove(build)
        if old.exists() and not directory.exists():
            os.rename(old, directory)
        remove(old)
        for folder in made:  # the parents this call made, if nothing arrived there
            with suppress(OSError):
                folder.rmdir()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` whole or not at all."""
    with replaced_atomically(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write a report as indented JSON to `path` whole or not at all."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


# ---- what comes in from outside: one rule, one helper -------------------------------------------
# A file is judged by its stat, never opened first: a FIFO waits for a writer forever, a device
# may never end, a huge file would fill the memory.


def is_there_as_file(file: Path) -> bool:
    """Whether `file` is there; one that is not a regular file is refused in one line."""
    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        return False
    except OSError as err:  # a symlink loop, no permission
        raise ValueError(f"{file} cannot be read: {err.strerror}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{file} is not a regular file (a FIFO, device or folder): put the "
                         f"model's {file.name} there as a file")
    return True


def read_regular_file(path: str | Path, max_bytes: int, what: str) -> bytes:
    """The bytes of `path`, a regular file of at most max_bytes; anything else is refused in one
    line naming it as `what` (e.g. "prompt_file")."""
    path = Path(path)

    def refuse(status: os.stat_result) -> None:
        if not stat.S_ISREG(status.st_mode):
            kind = "a folder" if stat.S_ISDIR(status.st_mode) else "a pipe or device"
            raise ValueError(f"{what} {path} is {kind}, not a regular file; give a file")
        if status.st_size > max_bytes:
            raise ValueError(f"{what} {path} holds {status.st_size:,} bytes, more than the "
                             f"{max_bytes:,} it may have")
    try:
        refuse(path.stat())
        # opened without waiting (a FIFO put in its place meanwhile), then checked again
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        fd = os.open(path, flags)
        with open(fd, "rb") as f:
            refuse(os.fstat(fd))
            return f.read(max_bytes + 1)[:max_bytes]  # a file growing meanwhile stops here
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except OSError as err:  # a symlink loop, no permission
        raise ValueError(f"{what} {path} cannot be read: {err.strerror}") from None


def json_number(x) -> float | None:
    """A number for JSON, which has no NaN or infinity: those become None (null)."""
    x = float(x)
    return x if math.isfinite(x) else None


def json_numbers(values) -> list | float | None:
    """Nested lists of json_number, from an array or nested sequences of numbers."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, list | tuple):
        return [json_numbers(v) for v in values]
    return json_number(values)
