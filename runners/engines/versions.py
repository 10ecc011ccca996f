"""What an engine says its version is, for a study's assumptions (tuner/assumptions.py): an
upgraded or rebuilt engine measures otherwise under the same settings. Each reader returns None
where it cannot tell (the engine is missing: its first trial then says why it does not start).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

VERSION_TIMEOUT_S = 30.0
VERSION_FILE_CHARS = 200  # a version file's text kept, at most


def _run(argv: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def program_version(program: str, marker: str = "version:") -> str | None:
    """The line of `program --version` that starts with `marker` (llama-server's form)."""
    done = _run([program, "--version"])
    lines = [] if done is None else (done.stdout + done.stderr).splitlines()
    return next((line.strip() for line in lines if line.startswith(marker)), None)


def interpreter_of(program: str) -> str | None:
    """The Python a program runs on: itself if it is one, else the one its first line names (a
    console script, pip's `#!/bin/sh` wrapper for long paths included)."""
    found = shutil.which(program) or program
    if Path(found).name.startswith("python"):
        return found
    try:
        with open(found, "rb") as script:  # its first lines, not a whole binary
            head = script.read(1024).decode(errors="replace").splitlines()[:3]
    except OSError:
        return None
    if head and head[0].startswith("#!") and "python" in head[0]:
        return head[0][2:].strip().split()[0]
    for line in head[1:]:  # '''exec' /path/to/python "$0" "$@"
        if line.startswith("'''exec' "):
            return line.split()[1]
    return None


def package_versions(program: str, distributions: tuple[str, ...]) -> dict[str, str]:
    """The installed versions of those of `distributions` present in the environment `program`
    runs in, read from their metadata (importing vLLM itself takes seconds)."""
    python = interpreter_of(program)
    if python is None:
        return {}
    code = (
        "import importlib.metadata as m, json, sys\n"
        "found = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        found[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "print(json.dumps(found))"
    )
    done = _run([python, "-c", code, *distributions])
    if done is None or done.returncode != 0:
        return {}
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}
    return {str(name): str(version) for name, version in found.items()}


def version_file(folder: Path, names: tuple[str, ...]) -> str | None:
    """The text of the first of `names` in `folder` (an installation's version file)."""
    for name in names:
        try:
            text = (folder / name).read_text(errors="replace")
        except OSError:
            continue
        return " ".join(text.split())[:VERSION_FILE_CHARS] or None
    return None
