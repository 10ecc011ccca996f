"""Loading the files a user writes: one place that turns bad input into one clear line.

It sits at the bottom of the import graph (objectives/ imports nothing else of ours), so every
layer above can raise InputError and read user files the same way."""

from __future__ import annotations

import math
import os
import stat
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class InputError(Exception):
    """Bad user input (a file, field or flag). The CLI prints it as one line and exits 2."""


def first_line(error: BaseException) -> str:
    """An exception's message for one line of ours: its first line (third-party messages run
    on with advice), or its type when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def describe_validation_error(source: str, error: ValidationError) -> str:
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    where = f"{loc}: " if loc else ""
    message = first["msg"].removeprefix(
        "Value error, "
    )  # a validator's own sentence names its fields
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{source}: {where}{message}{more}"


def validate(model: type[M], data: object, source: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise InputError(describe_validation_error(source, error)) from None


MAX_USER_FILE_BYTES = 1_000_000  # every file a user writes here is a few kB


def read_text(path: Path, what: str = "file") -> str:
    """A user's file as text: a regular UTF-8 file of sane size, or one clear line saying why not.
    A FIFO or device would block for ever, so only regular files are opened."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise InputError(f"{path}: {what} not found") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise InputError(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{path}: not a regular file (a pipe, socket or device); give a {what}")
    if info.st_size > MAX_USER_FILE_BYTES:
        raise InputError(
            f"{path}: {info.st_size:,} bytes; "
            f"a {what} here is at most {MAX_USER_FILE_BYTES:,} bytes"
        )
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror}") from None


def _non_finite(data: object, where: str = "") -> str | None:
    """The first path to an infinite or NaN number: no figure a user writes may be one."""
    if isinstance(data, float) and not math.isfinite(data):
        return where or "(top level)"
    items = (
        data.items()
        if isinstance(data, dict)
        else enumerate(data)
        if isinstance(data, list)
        else ()
    )
    for key, value in items:
        found = _non_finite(value, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def read_yaml(path: Path) -> object:
    text = read_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise InputError(f"{path}: malformed YAML{where}: {problem}") from None
    bad = _non_finite(data)
    if bad:
        raise InputError(f"{path}: {bad}: must be a finite number (not .inf or .nan)")
    return data


def load_yaml(path: Path, model: type[M]) -> M:
    return validate(model, read_yaml(path), str(path))


def preset_names(folder: Traversable) -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def load_preset_or_file(folder: Traversable, name_or_path: str, model: type[M], unknown: str) -> M:
    """A preset shipped in `folder` by name, or the path of a user's YAML file.

    `unknown` starts the error for a name that is neither (the flag and what it names)."""
    names = preset_names(folder)
    if name_or_path in names:
        with resources.as_file(folder / f"{name_or_path}.yaml") as path:
            return load_yaml(path, model)
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.path.lexists(path):
        return load_yaml(path, model)
    raise InputError(
        f"{unknown} {name_or_path!r}; presets: {', '.join(names)} (or the path of a YAML file)"
    )
