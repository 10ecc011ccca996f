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


def validate(model: type[M], data: object, source: str, base_dir: Path | None = None) -> M:
    """`base_dir`: where the file's relative paths start (its own folder; a trace's file)."""
    try:
        context = None if base_dir is None else {"base_dir": base_dir}
        return model.model_validate(data, context=context)
    except ValidationError as error:
        raise InputError(describe_validation_error(source, error)) from None


MAX_USER_FILE_BYTES = 1_000_000  # every file a user writes here is a few kB


def regular_file(
    path: Path, what: str = "file", error: type[Exception] = InputError
) -> os.stat_result:
    """A user's path, checked to be a regular file (a FIFO or device would block for ever, a
    directory is none): its stat, or `error` with one clear line saying why not."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except OSError as failure:
        raise error(f"{path}: cannot read: {failure.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise error(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path}: not a regular file (a pipe, socket or device); give a {what}")
    return info


def read_text(path: Path, what: str = "file") -> str:
    """A user's file as text: a regular UTF-8 file of sane size, or one clear line saying why not.
    A FIFO or device would block for ever, so only regular files are opened."""
    info = regular_file(path, what)
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


# What a file a user writes here can hold, once its YAML aliases are expanded: a scenario is a
# few dozen nodes, four deep. A 1 kB "billion laughs" file expands to billions (the walks over
# it ran for minutes), and a self-containing alias (`&a [*a]`) to infinity.
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 100


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_shape(path: Path, text: str) -> None:
    """Refuse, before anything is built from it, YAML whose aliases expand past
    MAX_YAML_NODES nodes or MAX_YAML_DEPTH levels, or refer to a node that contains them. The
    composed graph shares each anchored node: its expanded size is counted once per node, in
    one pass that recurses into nothing."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise InputError(f"{path}: nested too deeply; at most {MAX_YAML_DEPTH} levels") from None
    if root is None:
        return
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_nodes: set[int] = set()  # on the path from the root: an alias back to one is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, closing = stack.pop()
        key = id(node)
        if closing:
            open_nodes.discard(key)
            kids = _children(node)
            size[key] = 1 + sum(size[id(kid)] for kid in kids)
            depth[key] = 1 + max((depth[id(kid)] for kid in kids), default=0)
            if size[key] > MAX_YAML_NODES:
                raise InputError(
                    f"{path}: its aliases expand to more than {MAX_YAML_NODES:,} values; "
                    "write the values out"
                )
            if depth[key] > MAX_YAML_DEPTH:
                raise InputError(f"{path}: nested too deeply; at most {MAX_YAML_DEPTH} levels")
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise InputError(f"{path}: a YAML alias refers to a node that contains it")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((kid, False) for kid in _children(node) if id(kid) not in size)


def read_yaml(path: Path) -> object:
    text = read_text(path)
    try:
        _check_shape(path, text)
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
    return validate(model, read_yaml(path), str(path), path.parent)


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
    # An empty name is no path: Path("") is the current directory.
    named = bool(name_or_path.strip())
    if named and (path.suffix in (".yaml", ".yml") or os.path.lexists(path)):
        return load_yaml(path, model)
    raise InputError(
        f"{unknown} {name_or_path!r}; presets: {', '.join(names)} (or the path of a YAML file)"
    )
