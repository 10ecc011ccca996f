"""Bad input: one clear line naming what is wrong, exit status 2, nothing written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_autotune


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _write_bytes(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _hardware_with(tmp: Path, figure: str, value: float | None) -> str:
    """The h100 profile with one figure set to `value` (None: left out)."""
    from runners.sim.profiles import load_hardware

    data = load_hardware("h100").model_dump(mode="json")
    if value is None:
        del data[figure]
    else:
        data[figure]["value"] = value
    return _write(tmp / "hw.yaml", yaml.safe_dump(data))


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return str(path)


def _touch(path: Path) -> Path:
    path.touch()
    return path


def _link(target: Path, path: Path, hard: bool) -> str:
    os.link(target, path) if hard else path.symlink_to(target)
    return str(path)


def _model_without_tokenizer(tmp: Path) -> str:
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(
        '{"model_type": "qwen2", "max_position_embeddings": 4096}'
    )
    return str(tmp / "model")


def _scenario_with(tmp_path: Path, scenario_file: Path, edit) -> str:
    data = yaml.safe_load(scenario_file.read_text())
    edit(data)
    return _write(tmp_path / "edited.yaml", yaml.safe_dump(data))


def _quality_table(tmp: Path, edit) -> str:
    """The shipped Qwen2-7B quality table, edited."""
    from objectives.quality import find_shipped

    data = find_shipped("qwen2-7b")[1].model_dump(mode="json")
    edit(data["models"][0]["entries"])
    return _write(tmp / "quality.yaml", yaml.safe_dump(data))


CASES = {
    "unknown scenario": (lambda tmp, sc: ["--scenario", "no-such-thing"], "customer-service"),
    "a closed loop of 10^12 users": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: d["workload"].update(arrival={"kind": "closed", "concurrency": 10**12}),
            ),
        ],
        "workload.arrival.closed.concurrency",
    ),
    # the battery: it ran, and no trial could meet a TPOT bound no request had a TPOT for
    "a TPOT bound on one-token answers": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: (
                    d["workload"].update(output_tokens={"kind": "fixed", "value": 1})
                    or d["sla"].update(tpot_p99_ms=50)
                ),
            ),
        ],
        "every answer is 1 token (workload.output_tokens)",
    ),
    # an empty name is no path (the battery: it read the current directory)
    "empty scenario": (lambda tmp, sc: ["--scenario", ""], "--scenario: unknown scenario ''"),
    "missing scenario file": (
        lambda tmp, sc: ["--scenario", str(tmp / "nope.yaml")],
        "file not found",
    ),
    "malformed yaml": (
        lambda tmp, sc: ["--scenario", _write(tmp / "bad.yaml", "name: [unclosed\n")],
        "malformed YAML",
    ),
    "invalid field": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d["workload"].update(num_requests="many")),
        ],
        "workload.num_requests",
    ),
    "unknown field": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d["sla"].update(ttft_p95_ms=3)),
        ],
        "sla.ttft_p95_ms",
    ),
    # issue 29: a shared prefix is the start of a prompt, shared by a share of them
    "shared prefix no shorter than the longest prompt": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp, sc, lambda d: d["workload"].update(shared_prefix={"tokens": 1_000_000})
            ),
        ],
        "shared_prefix.tokens (1000000) must be below the longest prompt",
    ),
    "burst longer than the test": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: d["workload"].update(
                    burst={"after": 100, "requests": 100, "multiple": 3.0}
                ),
            ),
        ],
        "must end before the test's last request (num_requests 200)",
    ),
    "burst in a capacity search": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: d["workload"].update(
                    burst={"after": 50, "requests": 50, "multiple": 3.0}
                ),
            ),
        ],
        "workload.burst needs load.mode fixed",
    ),
    "host tier beyond the profile's host memory": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d["workload"].update(shared_prefix={"tokens": 64})),
            "--engine",
            "vllm",
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  kv_host_gb: {value: 500}\n"),
        ],
        "knobs.kv_host_gb: 500 GiB is more than ascend-910b2's host memory for one chip (96 GB",
    ),
    "burst on a chip budget": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: (
                    d["workload"].update(burst={"after": 50, "requests": 50, "multiple": 3.0}),
                    d.update(load={"mode": "fixed"}),
                ),
            ),
            "--chips",
            "4",
        ],
        "--chips: a burst (workload.burst of --scenario",
    ),
    "a knob the engine lacks, fixed in --space": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--engine",
            "vllm",
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  swap_preemptions: {value: 4}\n"),
        ],
        "knobs.swap_preemptions: vllm cannot express it (vLLM V1 preempts by recompute only",
    ),
    "sessions of 0 turns": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: d["workload"].update(sessions={"turns": {"kind": "fixed", "value": 0}}),
            ),
        ],
        "workload.sessions.turns.fixed.value",
    ),
    "sessions on a chip budget": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: d["workload"].update(sessions={"turns": {"kind": "fixed", "value": 3}}),
            ),
            "--chips",
            "4",
        ],
        "--chips: sessions (workload.sessions of --scenario",
    ),
    "shared prefix share above 1": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: d["workload"].update(shared_prefix={"tokens": 8, "share": 1.5}),
            ),
        ],
        "workload.shared_prefix.share",
    ),
    "negative sla": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d["sla"].update(ttft_p99_ms=-5)),
        ],
        "sla.ttft_p99_ms",
    ),
    "zero sla": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d["sla"].update(ttft_p99_ms=0)),
        ],
        "sla.ttft_p99_ms",
    ),
    "reversed length bounds": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: d["workload"].update(
                    input_tokens={"kind": "uniform", "low": 900, "high": 100}
                ),
            ),
        ],
        "must not exceed",
    ),
    "capacity ceiling below the nominal rate": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(load={"max_rate": 3})),
        ],
        "load.max_rate (3) is below the nominal rate (6)",
    ),
    "capacity floor above the nominal rate": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(load={"min_rate": 9})),
        ],
        "load.min_rate (9) is above the nominal rate (6)",
    ),
    "capacity bounds reversed": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(load={"min_rate": 6, "max_rate": 6})),
        ],
        "load.max_rate (6) must be above load.min_rate (6)",
    ),
    "capacity floor zero": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(load={"min_rate": 0})),
        ],
        "load.min_rate",
    ),
    "peak rate not positive": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(load={"peak_rate": -10})),
        ],
        "load.peak_rate",
    ),
    "unknown load mode": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(load={"mode": "max"})),
        ],
        "load.mode",
    ),
    "infinite rate": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d["workload"]["arrival"].update(rate=float("inf"))),
        ],
        "workload.arrival.rate: must be a finite number",
    ),
    "nan sla": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d["sla"].update(ttft_p99_ms=float("nan"))),
        ],
        "sla.ttft_p99_ms: must be a finite number",
    ),
    "scenario not utf-8": (
        lambda tmp, sc: ["--scenario", _write_bytes(tmp / "utf16.yaml", b"\xff\xfe\x00n\x00a")],
        "not UTF-8",
    ),
    "scenario not utf-8, no suffix": (
        lambda tmp, sc: ["--scenario", _write_bytes(tmp / "utf16", b"\xff\xfe\x00n")],
        "not UTF-8",
    ),
    "space not utf-8": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write_bytes(tmp / "s.yaml", b"\xff\xfe"),
        ],
        "not UTF-8",
    ),
    "hardware not utf-8": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--hardware",
            _write_bytes(tmp / "h.yaml", b"\xff\xfe"),
        ],
        "not UTF-8",
    ),
    "baseline not utf-8": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--baseline",
            _write_bytes(tmp / "b.yaml", b"\xff\xfe"),
        ],
        "not UTF-8",
    ),
    "runner config not utf-8": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "vllm",
            "--runner-config",
            _write_bytes(tmp / "r.yaml", b"\xff\xfe"),
        ],
        "not UTF-8",
    ),
    "scenario is a fifo": (
        lambda tmp, sc: ["--scenario", _fifo(tmp / "pipe.yaml")],
        "not a regular file",
    ),
    "scenario too large": (
        lambda tmp, sc: ["--scenario", _write(tmp / "big.yaml", "# " + "x" * 10_000_000 + "\n")],
        "at most 1,000,000 bytes",
    ),
    "request longer than the model's context": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: d["workload"].update(
                    input_tokens={"kind": "fixed", "value": 30000},
                    output_tokens={"kind": "fixed", "value": 8000},
                ),
            ),
        ],
        "30000 input + 8000 output = 38000 tokens) exceeds the context of qwen2-7b (32768 tokens",
    ),
    "infinite knob bound": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write(tmp / "s.yaml", "knobs:\n  batch_size: {low: 1, high: .inf}\n"),
        ],
        "knobs.batch_size.high: must be a finite number",
    ),
    "export under /proc": (
        lambda tmp, sc: ["--scenario", str(sc), "--export", "/proc/autotune-best.yaml"],
        "--export: cannot write in /proc",
    ),
    "export under a file": (
        lambda tmp, sc: ["--scenario", str(sc), "--export", str(sc / "best.yaml")],
        "is a file, not a directory",
    ),
    "export over the study database": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--storage",
            f"sqlite:///{_touch(tmp / 's.db')}",
            "--export",
            str(tmp / "s.db"),
        ],
        "is the --storage file",
    ),
    "export over the study database via a symlink": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--storage",
            f"sqlite:///{_touch(tmp / 's.db')}",
            "--export",
            _link(tmp / "s.db", tmp / "link.yaml", hard=False),
        ],
        "is the --storage file",
    ),
    "export over the study database via a hard link": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--storage",
            f"sqlite:///{_touch(tmp / 's.db')}",
            "--export",
            _link(tmp / "s.db", tmp / "hard.yaml", hard=True),
        ],
        "is the --storage file",
    ),
    "export over the new study database": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--storage",
            f"sqlite:///{tmp / 'new.db'}",
            "--export",
            str(tmp / "new.db"),
        ],
        "is the --storage file",
    ),
    "export over the scenario": (
        lambda tmp, sc: ["--scenario", str(sc), "--export", str(sc)],
        "is the --scenario file",
    ),
    "engine model folder without config.json": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "vllm",
            "--engine-cmd",
            "/bin/true",
            "--model",
            str(tmp),
        ],
        "has no config.json",
    ),
    "engine model folder without a tokenizer": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "vllm",
            "--engine-cmd",
            "/bin/true",
            "--model",
            _model_without_tokenizer(tmp),
        ],
        "no tokenizer in",
    ),
    "prefill range below every prompt names its sources": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  max_prefill_tokens: {low: 64, high: 128}\n"),
        ],
        "space.yaml: knobs.max_prefill_tokens: the whole range 64..128 is below the longest prompt "
        "of --scenario",
    ),
    "kv values the engine cannot run name --space and --engine": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--engine",
            "vllm",
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  kv_compression: {choices: [0.75]}\n"),
        ],
        "space.yaml: knobs.kv_compression: none of [0.75] can run here "
        "(--engine vllm takes only these values)",
    ),
    "reversed knob range": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  batch_size: {low: 64, high: 8}\n"),
        ],
        "knobs.batch_size",
    ),
    "empty choices": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  quantization: {choices: []}\n"),
        ],
        "choices is empty",
    ),
    "knob outside limits": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  kv_compression: {low: 0.5, high: 2.0}\n"),
        ],
        "outside the allowed range",
    ),
    "unknown knob": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  warp_speed: {value: 9}\n"),
        ],
        "unknown knob",
    ),
    "unknown quantization": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  quantization: {choices: [int3]}\n"),
        ],
        "allowed",
    ),
    "prefill range below every prompt": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  max_prefill_tokens: {low: 64, high: 128}\n"),
        ],
        "longest prompt",
    ),
    "unknown sampler": (
        lambda tmp, sc: ["--scenario", str(sc), "--sampler", "annealing"],
        "--sampler",
    ),
    "unknown runner": (lambda tmp, sc: ["--scenario", str(sc), "--runner", "tensorrt"], "--runner"),
    "unknown engine": (lambda tmp, sc: ["--scenario", str(sc), "--engine", "tgi"], "--engine"),
    "unknown hardware": (
        lambda tmp, sc: ["--scenario", str(sc), "--hardware", "tpu-v9"],
        "--hardware",
    ),
    "zero trials": (lambda tmp, sc: ["--scenario", str(sc), "--trials", "0"], "--trials"),
    "storage dir missing": (
        lambda tmp, sc: ["--scenario", str(sc), "--storage", f"sqlite:///{tmp}/no/dir/s.db"],
        "--storage",
    ),
    "storage not a url": (
        lambda tmp, sc: ["--scenario", str(sc), "--storage", "studies.db"],
        "--storage",
    ),
    "storage unreachable": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--storage",
            "postgresql+psycopg://127.0.0.1:1/test",
        ],
        "--storage",
    ),
    "export dir missing": (
        lambda tmp, sc: ["--scenario", str(sc), "--export", f"{tmp}/no/dir/best.yaml"],
        "--export",
    ),
    "engine runner without a command": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "vllm", "--model", str(tmp)],
        "--engine-cmd",
    ),
    "engine model not a directory": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "llamacpp",
            "--engine-cmd",
            "/bin/true",
            "--model",
            str(tmp / "no-model"),
        ],
        "--model",
    ),
    "engine command not found": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "vllm",
            "--engine-cmd",
            str(tmp / "no-vllm"),
            "--model",
            str(tmp),
        ],
        "--engine-cmd",
    ),
    "llama.cpp converter not found": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "llamacpp",
            "--engine-cmd",
            "/bin/true",
            "--model",
            _model_without_tokenizer(tmp),
        ],
        "convert_script",
    ),
    "runner config unknown field": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "vllm",
            "--runner-config",
            _write(tmp / "runner.yaml", f"engine_cmd: [vllm]\nmodel: {tmp}\nportt: 8000\n"),
        ],
        "runner.yaml: portt: Extra inputs are not permitted",
    ),
    "runner config port out of range": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "vllm",
            "--runner-config",
            _write(tmp / "runner.yaml", f"engine_cmd: [vllm]\nmodel: {tmp}\nport: 70000\n"),
        ],
        "runner.yaml: port:",
    ),
    "runner config unknown precision": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "vllm",
            "--runner-config",
            _write(
                tmp / "runner.yaml", f"engine_cmd: [vllm]\nmodel: {tmp}\nweights: {{w3a3: {tmp}}}\n"
            ),
        ],
        "runner.yaml: weights.w3a3",
    ),
    "runner config missing": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "llamacpp",
            "--runner-config",
            str(tmp / "nope.yaml"),
        ],
        "file not found",
    ),
    "sim given an engine command": (
        lambda tmp, sc: ["--scenario", str(sc), "--engine-cmd", "vllm"],
        "--engine-cmd",
    ),
    "sim with an engine it cannot simulate": (
        lambda tmp, sc: ["--scenario", str(sc), "--engine", "sglang"],
        "the simulator knows: mindie, vllm, llamacpp",
    ),
    "hardware figure zero": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--hardware",
            _hardware_with(tmp, "bf16_tflops", 0),
        ],
        "hw.yaml: bf16_tflops.value: Input should be greater than 0",
    ),
    "hardware figure negative": (
        lambda tmp, sc: ["--scenario", str(sc), "--hardware", _hardware_with(tmp, "mbu", -0.5)],
        "hw.yaml: mbu.value: Input should be greater than 0",
    ),
    "hardware figure missing": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--hardware",
            _hardware_with(tmp, "bandwidth_tbs", None),
        ],
        "hw.yaml: bandwidth_tbs: Field required",
    ),
    "screen on the simulator itself": (
        lambda tmp, sc: ["--scenario", str(sc), "--screen", "sim", "--screen-hardware", "h100"],
        "--screen: the study's runner is already the simulator",
    ),
    "screen hardware without screen": (
        lambda tmp, sc: ["--scenario", str(sc), "--screen-hardware", "h100"],
        "--screen-hardware: given without --screen sim",
    ),
    "unknown screen": (lambda tmp, sc: ["--scenario", str(sc), "--screen", "vidur"], "'--screen'"),
    "profile-hardware on a device that is not here": (
        lambda tmp, sc: ["profile-hardware", "--device", "cuda", "-o", "hw.yaml"],
        "--device cuda: PyTorch sees no CUDA device",
    ),
    "profile-hardware npu without torch_npu": (
        lambda tmp, sc: ["profile-hardware", "--device", "npu", "-o", "hw.yaml"],
        "--device npu needs torch_npu",
    ),
    "profile-hardware unknown device": (
        lambda tmp, sc: ["profile-hardware", "--device", "tpu", "-o", "hw.yaml"],
        "'--device'",
    ),
    "profile-hardware unknown model": (
        lambda tmp, sc: ["profile-hardware", "--model", "llama-9000", "-o", "hw.yaml"],
        "--model",
    ),
    "profile-hardware output dir missing": (
        lambda tmp, sc: ["profile-hardware", "-o", f"{tmp}/no/dir/hw.yaml"],
        "-o: directory",
    ),
    "openai with neither command nor url": (
        lambda tmp, sc: ["--scenario", str(sc), "--runner", "openai"],
        "base_url",
    ),
    "mindie installation missing": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "mindie",
            "--runner-config",
            _write(tmp / "runner.yaml", f"install_dir: {tmp}/no-mindie\n"),
        ],
        "install_dir (default $MIES_INSTALL_PATH)",
    ),
    "quality table without a precision the space searches": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--quality",
            _quality_table(
                tmp,
                lambda entries: entries.remove(
                    next(e for e in entries if e["quantization"] == "w8a8")
                ),
            ),
        ],
        "quality.yaml: models[0] (qwen2-7b): no entry for precision w8a8, "
        "which the search space searches",
    ),
    "quality table entry without its source": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--quality",
            _quality_table(tmp, lambda entries: entries[1].pop("source")),
        ],
        "quality.yaml: models.0.entries.1.source: Field required",
    ),
    "quality table not utf-8": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--quality",
            _write_bytes(tmp / "q.yaml", b"\xff\xfe"),
        ],
        "q.yaml: not UTF-8",
    ),
    "quality table naming another model": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--quality",
            _write(
                tmp / "q.yaml",
                yaml.safe_dump(
                    {
                        "models": [
                            {
                                "names": ["llama-3-8b"],
                                "entries": [
                                    {
                                        "quantization": "bf16",
                                        "accuracy_drop": 0,
                                        "source": "published",
                                        "note": "reference",
                                    }
                                ],
                            }
                        ]
                    }
                ),
            ),
        ],
        "q.yaml: models: no entry names the model 'qwen2-7b'",
    ),
    "quality SLO below zero": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(quality={"max_accuracy_drop": -1})),
        ],
        "quality.max_accuracy_drop: Input should be greater than or equal to 0",
    ),
    "quality SLO agreement above one": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(quality={"min_top1_agreement": 1.5})),
        ],
        "quality.min_top1_agreement: Input should be less than or equal to 1",
    ),
    "quality SLO the simulator cannot answer": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(quality={"max_kl": 0.05})),
        ],
        "quality.max_kl: the sim runner measures no quality and shipped quality table "
        "qwen2-7b.yaml gives no kl for bf16@1; supply the figure with --quality FILE",
    ),
    "quality SLO no searched precision meets": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(quality={"max_accuracy_drop": 0.5})),
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  quantization: {choices: [w8a8, w4a16]}\n"),
        ],
        "edited.yaml: quality: no precision searched meets it",
    ),
    "quality prompts for the simulator": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--quality-prompts",
            _write(tmp / "p.yaml", "prompts: [hello]\n"),
        ],
        "--quality-prompts: the sim runner measures no quality",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_with_one_line(case: str, tmp_path: Path, scenario_file: Path):
    make_args, expected = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    args = make_args(tmp_path, scenario_file)
    before = sorted(tmp_path.iterdir())
    result = run_autotune(*args, cwd=work, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("autotune: error:")
    assert expected in lines[0]
    assert list(work.iterdir()) == [], "nothing may be written on bad input"
    after = sorted(tmp_path.iterdir())
    assert after == before, "nothing may be written beside the inputs either"
    assert all(p.stat().st_size == 0 for p in after if p.suffix == ".db"), (
        "no study database may be created"
    )


def test_not_a_database_file(tmp_path: Path, scenario_file: Path):
    junk = tmp_path / "junk.db"
    junk.write_text("this is not sqlite")
    result = run_autotune(
        "--scenario", str(scenario_file), "--storage", f"sqlite:///{junk}", cwd=tmp_path
    )
    assert result.returncode == 2
    assert "--storage" in result.stderr
    assert junk.read_text() == "this is not sqlite"
    assert not (tmp_path / "best-config.yaml").exists()


def test_pareto_unknown_study(tmp_path: Path, scenario_file: Path):
    db = f"sqlite:///{tmp_path / 's.db'}"
    assert run_autotune(
        "--scenario", str(scenario_file), "--trials", "2", "--storage", db, cwd=tmp_path
    ).returncode in (0, 3)
    result = run_autotune("pareto", "--storage", db, "--study", "nope", cwd=tmp_path)
    assert result.returncode == 2
    assert "small-cs" in result.stderr  # lists the studies that do exist


@pytest.mark.parametrize("command", [["history"], ["pareto"], ["export", "--export", "x.yaml"]])
def test_read_only_commands_never_create_a_database(command: list[str], tmp_path: Path):
    result = run_autotune(*command, "--storage", f"sqlite:///{tmp_path / 'nope.db'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert (
        "--storage: no database at" in result.stderr
        and len(result.stderr.strip().splitlines()) == 1
    )
    assert not (tmp_path / "nope.db").exists() and not (tmp_path / "x.yaml").exists()


def test_nightly_report_folder_missing_names_report(tmp_path: Path, scenario_file: Path):
    result = run_autotune(
        "nightly",
        "--scenario",
        str(scenario_file),
        "--storage",
        f"sqlite:///{tmp_path / 'n.db'}",
        "--report",
        str(tmp_path / "no" / "r.md"),
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert (
        result.stderr.startswith("autotune: error: --report: directory")
        and "--export" not in result.stderr
    )
    assert not (tmp_path / "n.db").exists()


def test_missing_postgres_driver_says_what_to_install(tmp_path: Path, scenario_file: Path):
    hide_psycopg = (
        "import sys; sys.modules['psycopg'] = None; sys.argv[0] = 'autotune'; "
        "from tuner.cli import main; main()"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            hide_psycopg,
            "--scenario",
            str(scenario_file),
            "--storage",
            "postgresql+psycopg://127.0.0.1:5432/test",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert (
        "pip install 'autotune[postgres]'" in result.stderr
        and len(result.stderr.strip().splitlines()) == 1
    )


def test_export_is_readable_by_others_and_summary_counts_sla_misses(
    tmp_path: Path, scenario_file: Path
):
    data = yaml.safe_load(scenario_file.read_text())
    data["sla"]["ttft_p99_ms"] = 60  # below one prefill on the default profile: no config meets it
    impossible = tmp_path / "impossible.yaml"
    impossible.write_text(yaml.safe_dump(data))
    missed = run_autotune(
        "--scenario", str(impossible), "--trials", "4", "--polish", "0", cwd=tmp_path
    )
    assert missed.returncode == 3, missed.stderr
    line = next(line for line in missed.stdout.splitlines() if "trials this run" in line)
    met, miss, norun, failed = (
        int(x) for x in re.findall(r"(\d+) (?:met|missed|could|failed)", line)
    )
    assert met == 0 and miss + norun + failed == 4 and miss > 0, line

    good = tmp_path / "good-space.yaml"
    good.write_text(
        "knobs:\n  batch_size: {value: 128}\n  max_prefill_batch_size: {value: 32}\n"
        "  quantization: {value: w8a8}\n"
    )
    done = run_autotune(
        "--scenario",
        str(scenario_file),
        "--trials",
        "1",
        "--space",
        str(good),
        "--storage",
        "sqlite:///ok.db",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    mode = (tmp_path / "best-config.yaml").stat().st_mode & 0o777
    assert mode == 0o666 & ~_umask(), oct(mode)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_full_stdout_is_one_line_not_a_traceback(tmp_path: Path):
    """The battery: `autotune scenarios` with stdout on a full device ended in an ENOSPC
    traceback. /dev/full fails every write with ENOSPC."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "tuner", "scenarios"],
            cwd=tmp_path,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0], result.stderr
