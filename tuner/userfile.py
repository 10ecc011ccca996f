"""Loading the files a user writes: one place that turns bad input into one clear line."""

from __future__ import annotations

from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class InputError(Exception):
    """Bad user input (a file, field or flag). The CLI prints it as one line and exits 2."""


def describe_validation_error(source: str, error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{source}: {where}: {first['msg']}{more}"


def validate(model: type[M], data: object, source: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise InputError(describe_validation_error(source, error)) from None


def read_yaml(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: file not found") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise InputError(f"{path}: malformed YAML{where}: {problem}") from None


def load_yaml(path: Path, model: type[M]) -> M:
    return validate(model, read_yaml(path), str(path))


def preset_names(folder: Traversable) -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_preset_or_file(folder: Traversable, name_or_path: str, model: type[M], unknown: str) -> M:
    """A preset shipped in `folder` by name, or the path of a user's YAML file.

    `unknown` starts the error for a name that is neither (the flag and what it names)."""
    names = preset_names(folder)
    if name_or_path in names:
        with resources.as_file(folder / f"{name_or_path}.yaml") as path:
            return load_yaml(path, model)
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_yaml(path, model)
    raise InputError(f"{unknown} {name_or_path!r}; presets: {', '.join(names)} (or the path of a YAML file)")
