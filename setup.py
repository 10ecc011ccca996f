"""Only the simulator's compiled core: everything else about the package is in pyproject.toml.

mypyc compiles the engine simulation (the step loop a study spends ~80% of its time in) from
its own typed source, 3-4x faster per simulated request and the same to the float. The same
source runs as plain Python where it is not compiled: with AUTOTUNE_PURE_PYTHON=1 at build
time, or where the build has no mypyc or no C compiler (the install goes on without them).
runners/sim/__init__.py runs the source instead of a build of other source (the build records
each compiled source's hash: runners/sim/compiled.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent / "runners" / "sim"))
from compiled import COMPILED, SOURCES, source_hashes  # runners/sim/compiled.py, uninstalled

SIM = Path(__file__).resolve().parent / "runners" / "sim"


def compiled_core() -> list:
    if os.environ.get("AUTOTUNE_PURE_PYTHON"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("autotune: mypyc not found, the simulator runs as plain Python", file=sys.stderr)
        return []
    # Imports outside the compiled modules are not followed (their names read as Any there),
    # which keeps the build to seconds instead of type-checking numpy and pydantic.
    paths = [f"runners/sim/{name}.py" for name in COMPILED]
    try:
        modules = mypycify(["--follow-imports=skip", *paths], opt_level="3")
    except (Exception, SystemExit) as error:  # mypyc exits on a type error
        why = f"autotune: not compiled ({error}), the simulator runs as plain Python"
        print(why, file=sys.stderr)
        return []
    for module in modules:
        # A module the C compiler fails on is left out, not the install: the check at import
        # then runs every module from its source (runners/sim/compiled.py).
        module.optional = True
    # What the compiled modules were built from, for that check.
    (SIM / SOURCES).write_text(json.dumps(source_hashes(SIM), indent=1))
    return modules


setup(ext_modules=compiled_core())
