"""What an engine says its version is (runners/engines/versions.py), read for a study's
assumptions: a Python package's version from the environment a program runs in (a console
script's, pip's long-path wrapper's, an interpreter's own), and an installation's version file.
Real interpreters and real installed distributions; the expected versions come from
importlib.metadata in this process, not from the code under test."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from runners.engines.versions import interpreter_of, package_versions, version_file

OPTUNA = importlib.metadata.version("optuna")
OPTUNA_SCRIPT = Path(sys.executable).with_name("optuna")  # the console script pip wrote


def test_an_interpreter_runs_on_itself_and_a_console_script_on_its_shebang_s():
    assert interpreter_of(sys.executable) == sys.executable
    assert OPTUNA_SCRIPT.is_file(), "optuna installs its command-line script"
    assert Path(interpreter_of(str(OPTUNA_SCRIPT))).resolve() == Path(sys.executable).resolve()


def test_pip_s_wrapper_for_a_long_interpreter_path_names_its_interpreter(tmp_path: Path):
    wrapper = tmp_path / "vllm"
    wrapper.write_text(f"#!/bin/sh\n'''exec' {sys.executable} \"$0\" \"$@\"\n' '''\nimport x\n")
    assert interpreter_of(str(wrapper)) == sys.executable


def test_versions_of_the_installed_distributions_only():
    for program in (sys.executable, str(OPTUNA_SCRIPT)):
        found = package_versions(program, ("optuna", "no-such-distribution-here"))
        assert found == {"optuna": OPTUNA}


def test_a_program_that_is_no_python_or_is_missing_tells_nothing(tmp_path: Path):
    assert package_versions("/bin/sh", ("optuna",)) == {}
    assert package_versions(str(tmp_path / "missing"), ("optuna",)) == {}


def test_an_installation_s_version_file_the_first_named_that_exists(tmp_path: Path):
    assert version_file(tmp_path, ("version", "version.info")) is None
    (tmp_path / "version.info").write_text("MindIE LLM\n  2.3.0 \n")
    assert version_file(tmp_path, ("version", "version.info")) == "MindIE LLM 2.3.0"
    (tmp_path / "version").write_text("Ascend-mindie-service 2.3.0\n")
    assert version_file(tmp_path, ("version", "version.info")) == "Ascend-mindie-service 2.3.0"
