"""The openai runner (any OpenAI-compatible server), with a real llama-server behind it: started
per trial from an argument-list template, or already running (base_url)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runners.engines.openai import OpenAIRunner, OpenAISettings
from runners.engines.process import EngineProcess, choose_port, http_ready
from search_spaces.space import SearchSpace
from testing.engines import engine_scenario
from tests.runner_contract import RunnerContract
from tests.test_runner_llamacpp import make_runner


@pytest.fixture(scope="module")
def bf16_gguf(llama_server, tiny_model, tmp_path_factory, gguf_cache):
    return make_runner(
        llama_server, tiny_model, tmp_path_factory.mktemp("convert"), gguf_cache
    ).gguf("bf16")


def template(server, gguf) -> list[str]:
    return [
        str(server),
        "-m",
        str(gguf),
        "--host",
        "{host}",
        "--port",
        "{port}",
        "-np",
        "{batch_size}",
        "-c",
        "4096",
        "-t",
        "1",
        "{select_batch}",
    ]


class TestOpenAITemplate(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def runner(cls, llama_server, bf16_gguf, tiny_model, tmp_path_factory):
        settings = OpenAISettings(
            engine_cmd=template(llama_server, bf16_gguf),
            tokenizer=tiny_model,
            ready_path="/health",
            log_dir=tmp_path_factory.mktemp("openai") / "logs",
            warmup_requests=1,
            # decode-first becomes a flag llama-server does not know: the impossible config below.
            knob_values={"select_batch": {"prefill-first": "", "decode-first": "--no-such-flag"}},
        )
        return OpenAIRunner(settings, hardware="cpu")

    @pytest.fixture(scope="class")
    @classmethod
    def good_config(cls):
        return {"batch_size": 4, "select_batch": "prefill-first"}

    @pytest.fixture(scope="class")
    @classmethod
    def impossible_config(cls):
        return {"batch_size": 4, "select_batch": "decode-first"}

    @pytest.fixture(scope="class")
    @classmethod
    def workload(cls):
        return engine_scenario().workload

    def test_template_filled_and_unused_knobs_dropped(self, runner, measured):
        log = Path(measured.extra["engine_log"]).read_text()
        assert "n_slots = 4" in log
        space = runner.adapt(SearchSpace.load("vllm"))
        assert set(space.ranges) == {"batch_size", "select_batch"}
        assert any("quantization dropped: no placeholder" in note for note in space.notes)


def test_already_running_server_is_measured_as_it_is(llama_server, bf16_gguf, tiny_model, tmp_path):
    port = choose_port(None)
    argv = [
        str(llama_server),
        "-m",
        str(bf16_gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        "2",
        "-t",
        "1",
        "--alias",
        "already-up",
    ]
    with EngineProcess(argv, os.environ, tmp_path / "server.log") as server:
        server.wait_ready(http_ready(f"http://127.0.0.1:{port}/health"), timeout_s=30)
        runner = OpenAIRunner(
            OpenAISettings(
                base_url=f"http://127.0.0.1:{port}/",
                tokenizer=tiny_model,
                log_dir=tmp_path / "logs",
                warmup_requests=0,
            ),
            hardware="cpu",
        )
        # It says what it talks to: llama-server's models are owned by "llamacpp" (its
        # /v1/models), whatever the runner's knob vocabulary (vLLM's) is called.
        assert runner.assumptions()["server"]["owned_by"] == "llamacpp"
        preset = SearchSpace.load("vllm")
        space = runner.adapt(preset)
        assert space.ranges == {} and len(space.notes) == len(preset.ranges)  # one per knob
        assert all(note.endswith("dropped: the server is already running") for note in space.notes)
        workload = engine_scenario(requests=8).workload
        m = runner.run({}, workload)
        assert m.fault is None, m.fault
        assert m.ok.all() and m.sent == 8
        assert server.exited() is None  # not ours to stop
    assert "engine_pid" not in m.extra
