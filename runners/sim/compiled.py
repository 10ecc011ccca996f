"""Which of the simulator's modules mypyc compiles (setup.py), and the rule that a build of other
source than the one beside it is not run: runners/sim/__init__.py then imports these modules from
their source, so an edited simulator never runs stale compiled code (rebuild: pip install -e .).
The build records each source's hash in SOURCES (file times would not do: a wheel's install
writes its files in any order).
AUTOTUNE_PURE_PYTHON=1 runs the source too, compiled or not (a reference, or a profile that
sees inside the step loop). Kept free of package imports: setup.py reads COMPILED before the
package is installed."""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# Compiled together (one compiled class has one compiled base): Simulation's layers, what they
# call on every step, and the simulations built on it.
COMPILED = (
    "scheduler",
    "costs",
    "prefix_cache",
    "swap",
    "admission",
    "arrivals",
    "decode_run",
    "engine",
    "prefill_only",
    "disaggregated",
)
HERE = Path(__file__).resolve().parent
PACKAGE = "runners.sim"
SOURCES = "compiled-sources.json"  # beside the build: each compiled module's source hash


def source_hashes(folder: Path = HERE) -> dict[str, str]:
    return {
        name: hashlib.sha256((folder / f"{name}.py").read_bytes()).hexdigest() for name in COMPILED
    }


def builds(folder: Path = HERE) -> dict[str, Path]:
    """The compiled module beside each source, where there is one."""
    found = {}
    for name in COMPILED:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = folder / f"{name}{suffix}"
            if path.exists():
                found[name] = path
                break
    return found


def stale(found: dict[str, Path], folder: Path = HERE) -> list[str]:
    """Modules whose source is not the one they were compiled from (or whose build recorded
    none), or that were not compiled with the rest (compiled classes cannot stand on
    interpreted bases)."""
    if not found:
        return []
    try:
        built = json.loads((folder / SOURCES).read_text())
    except (OSError, ValueError):
        built = {}
    now = source_hashes(folder)
    return [name for name in COMPILED if name not in found or built.get(name) != now[name]]


class SourceFirst(importlib.abc.MetaPathFinder):
    """Imports the compiled modules from their .py files."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != PACKAGE or name not in COMPILED:
            return None
        return importlib.util.spec_from_file_location(fullname, HERE / f"{name}.py")


def choose() -> str:
    """Install the source-first import where the compiled core must not run; which runs."""
    found = builds()
    if not found:
        return "source (not compiled)"
    if os.environ.get("AUTOTUNE_PURE_PYTHON"):
        why = "source (AUTOTUNE_PURE_PYTHON)"
    elif outdated := stale(found):
        built = ", ".join(outdated)
        why = f"source (the compiled {built} built from other source: pip install -e .)"
        print(f"autotune: the simulator runs from its {why}", file=sys.stderr)
    else:
        return "compiled"
    if not any(isinstance(finder, SourceFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, SourceFirst())
    return why
