"""Only the simulator's compiled core: everything else about the package is in pyproject.toml.

mypyc compiles the engine simulation (the step loop a study spends ~80% of its time in) from
its own typed source, 3-4x faster per simulated request and the same to the float. The same
source runs as plain Python where it is not compiled: with AUTOTUNE_PURE_PYTHON=1 at build
time, or where the build has no mypyc or no C compiler (setup goes on without it).
runners/sim/__init__.py runs the source instead of a build older than it.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "runners", "sim"))
from compiled import COMPILED  # runners/sim/compiled.py, before the package is installed


def compiled_core() -> list:
    if os.environ.get("AUTOTUNE_PURE_PYTHON"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("autotune: mypyc not found, the simulator runs as plain Python", file=sys.stderr)
        return []
    # Imports outside the compiled modules are not followed: their types are only looked up,
    # which keeps the build to seconds instead of type-checking numpy and pydantic.
    paths = [f"runners/sim/{name}.py" for name in COMPILED]
    try:
        return mypycify(["--follow-imports=skip", *paths], opt_level="3")
    except (Exception, SystemExit) as error:  # mypyc exits on a type error
        why = f"autotune: not compiled ({error}), the simulator runs as plain Python"
        print(why, file=sys.stderr)
        return []


setup(ext_modules=compiled_core())
