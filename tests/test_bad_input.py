"""Bad input: one clear line naming what is wrong, exit status 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import run_autotune


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _scenario_with(tmp_path: Path, scenario_file: Path, edit) -> str:
    data = yaml.safe_load(scenario_file.read_text())
    edit(data)
    return _write(tmp_path / "edited.yaml", yaml.safe_dump(data))


CASES = {
    "unknown scenario": (lambda tmp, sc: ["--scenario", "no-such-thing"], "customer-service"),
    "missing scenario file": (lambda tmp, sc: ["--scenario", str(tmp / "nope.yaml")], "file not found"),
    "malformed yaml": (lambda tmp, sc: ["--scenario", _write(tmp / "bad.yaml", "name: [unclosed\n")], "malformed YAML"),
    "invalid field": (
        lambda tmp, sc: ["--scenario", _scenario_with(tmp, sc, lambda d: d["workload"].update(num_requests="many"))],
        "workload.num_requests",
    ),
    "unknown field": (
        lambda tmp, sc: ["--scenario", _scenario_with(tmp, sc, lambda d: d["sla"].update(ttft_p95_ms=3))],
        "sla.ttft_p95_ms",
    ),
    "negative sla": (
        lambda tmp, sc: ["--scenario", _scenario_with(tmp, sc, lambda d: d["sla"].update(ttft_p99_ms=-5))],
        "sla.ttft_p99_ms",
    ),
    "zero sla": (
        lambda tmp, sc: ["--scenario", _scenario_with(tmp, sc, lambda d: d["sla"].update(ttft_p99_ms=0))],
        "sla.ttft_p99_ms",
    ),
    "reversed length bounds": (
        lambda tmp, sc: ["--scenario", _scenario_with(tmp, sc, lambda d: d["workload"].update(
            input_tokens={"kind": "uniform", "low": 900, "high": 100}))],
        "must not exceed",
    ),
    "reversed knob range": (
        lambda tmp, sc: ["--scenario", str(sc), "--space",
                         _write(tmp / "space.yaml", "knobs:\n  batch_size: {low: 64, high: 8}\n")],
        "knobs.batch_size",
    ),
    "empty choices": (
        lambda tmp, sc: ["--scenario", str(sc), "--space", _write(tmp / "space.yaml", "knobs:\n  quantization: {choices: []}\n")],
        "choices is empty",
    ),
    "knob outside limits": (
        lambda tmp, sc: ["--scenario", str(sc), "--space", _write(tmp / "space.yaml", "knobs:\n  kv_compression: {low: 0.5, high: 2.0}\n")],
        "outside the allowed range",
    ),
    "unknown knob": (
        lambda tmp, sc: ["--scenario", str(sc), "--space", _write(tmp / "space.yaml", "knobs:\n  warp_speed: {value: 9}\n")],
        "unknown knob",
    ),
    "unknown quantization": (
        lambda tmp, sc: ["--scenario", str(sc), "--space", _write(tmp / "space.yaml", "knobs:\n  quantization: {choices: [int3]}\n")],
        "allowed",
    ),
    "prefill range below every prompt": (
        lambda tmp, sc: ["--scenario", str(sc), "--space", _write(tmp / "space.yaml", "knobs:\n  max_prefill_tokens: {low: 64, high: 128}\n")],
        "longest prompt",
    ),
    "unknown sampler": (lambda tmp, sc: ["--scenario", str(sc), "--sampler", "annealing"], "--sampler"),
    "unknown runner": (lambda tmp, sc: ["--scenario", str(sc), "--runner", "tensorrt"], "--runner"),
    "unknown engine": (lambda tmp, sc: ["--scenario", str(sc), "--engine", "tgi"], "--engine"),
    "unknown hardware": (lambda tmp, sc: ["--scenario", str(sc), "--hardware", "tpu-v9"], "--hardware"),
    "zero trials": (lambda tmp, sc: ["--scenario", str(sc), "--trials", "0"], "--trials"),
    "storage dir missing": (lambda tmp, sc: ["--scenario", str(sc), "--storage", f"sqlite:///{tmp}/no/dir/s.db"], "--storage"),
    "storage not a url": (lambda tmp, sc: ["--scenario", str(sc), "--storage", "studies.db"], "--storage"),
    "storage unreachable": (
        lambda tmp, sc: ["--scenario", str(sc), "--storage", "postgresql+psycopg://127.0.0.1:1/test"], "--storage"),
    "export dir missing": (lambda tmp, sc: ["--scenario", str(sc), "--export", f"{tmp}/no/dir/best.yaml"], "--export"),
    "engine runner without a command": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "vllm", "--model", str(tmp)], "--engine-cmd"),
    "engine model not a directory": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "llamacpp", "--engine-cmd", "/bin/true",
                         "--model", str(tmp / "no-model")], "--model"),
    "engine command not found": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "vllm", "--engine-cmd", str(tmp / "no-vllm"),
                         "--model", str(tmp)], "--engine-cmd"),
    "llama.cpp converter not found": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "llamacpp", "--engine-cmd", "/bin/true",
                         "--model", str(tmp)], "convert_script"),
    "runner config unknown field": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "vllm", "--runner-config",
                         _write(tmp / "runner.yaml", f"engine_cmd: [vllm]\nmodel: {tmp}\nportt: 8000\n")],
        "runner.yaml: portt: Extra inputs are not permitted"),
    "runner config port out of range": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "vllm", "--runner-config",
                         _write(tmp / "runner.yaml", f"engine_cmd: [vllm]\nmodel: {tmp}\nport: 70000\n")],
        "runner.yaml: port:"),
    "runner config unknown precision": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "vllm", "--runner-config",
                         _write(tmp / "runner.yaml", f"engine_cmd: [vllm]\nmodel: {tmp}\nweights: {{w3a3: {tmp}}}\n")],
        "runner.yaml: weights.w3a3"),
    "runner config missing": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "llamacpp", "--runner-config", str(tmp / "nope.yaml")],
        "file not found"),
    "sim given an engine command": (lambda tmp, sc: ["--scenario", str(sc), "--engine-cmd", "vllm"], "--engine-cmd"),
    "sim with an engine it cannot simulate": (lambda tmp, sc: ["--scenario", str(sc), "--engine", "llamacpp"], "--engine"),
    "openai with neither command nor url": (lambda tmp, sc: ["--scenario", str(sc), "--runner", "openai"], "base_url"),
    "mindie installation missing": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "mindie", "--runner-config",
                         _write(tmp / "runner.yaml", f"install_dir: {tmp}/no-mindie\n")], "install_dir"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_with_one_line(case: str, tmp_path: Path, scenario_file: Path):
    make_args, expected = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    result = run_autotune(*make_args(tmp_path, scenario_file), cwd=work)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("autotune: error:")
    assert expected in lines[0]
    assert list(work.iterdir()) == [], "nothing may be written on bad input"


def test_not_a_database_file(tmp_path: Path, scenario_file: Path):
    junk = tmp_path / "junk.db"
    junk.write_text("this is not sqlite")
    result = run_autotune("--scenario", str(scenario_file), "--storage", f"sqlite:///{junk}", cwd=tmp_path)
    assert result.returncode == 2
    assert "--storage" in result.stderr
    assert junk.read_text() == "this is not sqlite"
    assert not (tmp_path / "best-config.yaml").exists()


def test_pareto_unknown_study(tmp_path: Path, scenario_file: Path):
    db = f"sqlite:///{tmp_path / 's.db'}"
    assert run_autotune("--scenario", str(scenario_file), "--trials", "2", "--storage", db, cwd=tmp_path).returncode in (0, 3)
    result = run_autotune("pareto", "--storage", db, "--study", "nope", cwd=tmp_path)
    assert result.returncode == 2
    assert "small-cs" in result.stderr  # lists the studies that do exist
