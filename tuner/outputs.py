"""The files autotune writes (export, report, .prev): checked before any work, written
atomically."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from objectives.userfile import InputError


def _parent(path: Path) -> Path:
    # The folder the file itself lives in (a symlink is replaced there, as `mv` would).
    return Path(os.path.abspath(path.expanduser())).parent


def _check_existing(path: Path, flag: str) -> None:
    """An output that exists must be a regular file (through a link too): the atomic write
    replaces it, and replacing a device such as /dev/null, a pipe or a socket with a file
    would break whatever uses it."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return  # a new file, or a link to nothing: written in its place
    except OSError as error:  # e.g. a name longer than the filesystem allows
        raise InputError(f"{flag}: {_shown(path)}: {error.strerror}") from None
    if stat.S_ISDIR(mode):
        raise InputError(f"{flag}: {path} is a directory")
    if not stat.S_ISREG(mode):
        raise InputError(
            f"{flag}: {path} exists and is not a regular file (a device, pipe or socket); "
            "give a file path"
        )


def _shown(path: Path) -> str:
    """A path short enough for one line of an error."""
    text = str(path)
    return (
        text if len(text) <= 80 else f"{text[:40]}...{text[-20:]} ({len(path.name)}-character name)"
    )


def check_writable(path: Path, flag: str) -> None:
    """Fail before the study runs if `path` cannot be written, by creating (and removing) the
    temporary file the atomic write will use: permission bits alone lie for root and for
    filesystems such as /proc and /sys."""
    parent = _parent(path)
    try:
        parent_is_dir = parent.is_dir()
    except OSError as error:  # e.g. a folder name longer than the filesystem allows
        raise InputError(f"{flag}: {_shown(parent)}: {error.strerror}") from None
    if not parent_is_dir:
        nearest = next(p for p in [parent, *parent.parents] if p.exists())
        if not nearest.is_dir():
            raise InputError(f"{flag}: {nearest} is a file, not a directory")
        raise InputError(f"{flag}: directory {parent} does not exist")
    _check_existing(path.expanduser(), flag)
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise InputError(f"{flag}: cannot write in {parent}: {error.strerror}") from None


def _same(a: Path, b: Path) -> bool:
    a, b = a.expanduser(), b.expanduser()
    if a.exists() and b.exists():
        return os.path.samefile(a, b)  # symlinks and hard links too
    return os.path.realpath(a) == os.path.realpath(b)


def check_distinct(outputs: dict[str, Path], inputs: dict[str, Path | None]) -> None:
    """No output may overwrite an input (the study database, a scenario) or another output."""
    named = list(outputs.items())
    for i, (flag, path) in enumerate(named):
        for other_flag, other in named[i + 1 :]:
            if _same(path, other):
                raise InputError(f"{flag}: {path} is also {other_flag}; give them different files")
        for input_flag, source in inputs.items():
            if source is not None and _same(path, source):
                raise InputError(
                    f"{flag}: {path} is the {input_flag} file; writing it would destroy it"
                )


def write_atomic(path: Path, text: str) -> None:
    """Write beside the target, then rename over it: readers see the old file or the new one.
    The file gets the mode a plain write would give it (the old file's, else 0666 less umask),
    so a service running as another user can read a deployed config."""
    path = path.expanduser()
    if path.exists():
        mode = path.stat().st_mode & 0o777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=_parent(path), prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
