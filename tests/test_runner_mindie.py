"""The mindie runner. MindIE needs Ascend NPUs and cannot run here, so:

- the config.json rendering is checked against MindIE's documented fields and ranges;
- the process lifecycle runs a STAND-IN daemon that this test writes (`mindieservice_daemon`
  in a fake install folder): it reads the rendered config.json from MIES_CONFIG_JSON_PATH,
  refuses a bad one like MindIE would, prints MindIE's ready line and streams OpenAI
  completions with a fixed per-token delay. It stands in for MindIE; it measures nothing real.
"""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest

from objectives.userfile import InputError
from runners.engines.mindie import READY_LINE, MindIERunner, MindIESettings
from runners.engines.served import load_settings
from search_spaces.knobs import render
from tests.conftest import small_scenario
from tests.runner_contract import RunnerContract
from tuner.export import native_forms

INSTALLED = {  # the shape of MindIE 1.x's conf/config.json, trimmed
    "Version": "1.0.0",
    "ServerConfig": {
        "ipAddress": "0.0.0.0",
        "port": 1025,
        "managementPort": 1026,
        "metricsPort": 1027,
        "httpsEnabled": True,
    },
    "BackendConfig": {
        "npuDeviceIds": [[0]],
        "ModelDeployConfig": {
            "maxSeqLen": 2560,
            "maxInputTokenLen": 2048,
            "ModelConfig": [{"modelName": "qwen", "modelWeightPath": "/data/qwen", "worldSize": 1}],
        },
        "ScheduleConfig": {
            "maxBatchSize": 200,
            "maxPrefillBatchSize": 50,
            "maxPrefillTokens": 8192,
            "supportSelectBatch": False,
            "prefillTimeMsPerReq": 150,
            "decodeTimeMsPerReq": 50,
            "maxQueueDelayMicroseconds": 5000,
        },
    },
}

STAND_IN_DAEMON = r"""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

config = json.load(open(os.environ["MIES_CONFIG_JSON_PATH"]))
schedule = config["BackendConfig"]["ScheduleConfig"]
deploy = config["BackendConfig"]["ModelDeployConfig"]
if schedule["maxPrefillTokens"] < deploy["maxInputTokenLen"]:
    print("config check failed: maxPrefillTokens < maxInputTokenLen", flush=True)
    sys.exit(1)
print("stand-in daemon: ScheduleConfig", json.dumps(schedule, sort_keys=True), flush=True)
server_config = config["ServerConfig"]

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        time.sleep(0.002 * len(body["prompt"].split()) / 16)
        for _ in range(body["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": " x"}]}\n\n')
            self.wfile.flush()
            time.sleep(0.001)
        usage = {
            "prompt_tokens": len(body["prompt"].split()),
            "completion_tokens": body["max_tokens"],
        }
        last = json.dumps({"choices": [], "usage": usage})
        self.wfile.write(("data: " + last + "\n\ndata: [DONE]\n\n").encode())
        self.close_connection = True

httpd = ThreadingHTTPServer((server_config["ipAddress"], server_config["port"]), Handler)
print("Daemon start success!", flush=True)
httpd.serve_forever()
"""


@pytest.fixture(scope="module")
def mindie_install(tmp_path_factory, tiny_model) -> Path:
    install = tmp_path_factory.mktemp("mindie-service")
    (install / "conf").mkdir()
    (install / "conf" / "config.json").write_text(json.dumps(INSTALLED, indent=2))
    daemon = install / "bin" / "mindieservice_daemon"
    daemon.parent.mkdir()
    import sys

    daemon.write_text(f"#!{sys.executable}\n" + textwrap.dedent(STAND_IN_DAEMON))
    daemon.chmod(0o755)
    return install


def _runner(install: Path, model: Path, tmp: Path, **extra) -> MindIERunner:
    settings = MindIESettings(
        install_dir=install, model=model, log_dir=tmp / "logs", warmup_requests=1, **extra
    )
    return MindIERunner(settings, hardware="stand-in")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class TestMindIEStandInDaemon(RunnerContract):
    """The runner contract against the stand-in daemon (MindIE itself cannot run here)."""

    @pytest.fixture(scope="class")
    @classmethod
    def runner(cls, mindie_install, tiny_model, tmp_path_factory):
        return _runner(mindie_install, tiny_model, tmp_path_factory.mktemp("mindie"))

    @pytest.fixture(scope="class")
    @classmethod
    def good_config(cls):
        return {
            "batch_size": 16,
            "select_batch": "decode-first",
            "max_prefill_tokens": 4096,
            "quantization": "bf16",
            "kv_compression": 1.0,
            "max_prefill_batch_size": 8,
        }

    @pytest.fixture(scope="class")
    @classmethod
    def impossible_config(cls):
        return {
            "batch_size": 16,
            "select_batch": "prefill-first",
            "max_prefill_tokens": 64,
            "quantization": "bf16",
        }

    @pytest.fixture(scope="class")
    @classmethod
    def workload(cls):
        return small_scenario(requests=40).workload


def test_rendered_config_carries_the_knobs_and_leaves_the_installed_file_alone(
    mindie_install, tiny_model, tmp_path
):
    installed = mindie_install / "conf" / "config.json"
    before = _digest(installed)
    runner = _runner(mindie_install, tiny_model, tmp_path, weights={"w8a8": tmp_path / "qwen-w8a8"})
    config = {
        "batch_size": 24,
        "select_batch": "decode-first",
        "max_prefill_tokens": 4096,
        "quantization": "w8a8",
        "kv_compression": 1.0,
        "max_prefill_batch_size": 6,
        "prefill_time_ms_per_req": 120,
        "decode_time_ms_per_req": 40,
    }
    rendered = runner.render_config(render("mindie", config), (9001, 9002, 9003), (768, 1024))
    schedule = rendered["BackendConfig"]["ScheduleConfig"]
    assert schedule == {
        "maxBatchSize": 24,
        "maxPrefillBatchSize": 6,
        "maxPrefillTokens": 4096,
        "supportSelectBatch": True,
        "prefillTimeMsPerReq": 120,
        "decodeTimeMsPerReq": 40,
        "maxQueueDelayMicroseconds": 5000,
    }
    model = rendered["BackendConfig"]["ModelDeployConfig"]
    assert model["ModelConfig"][0]["modelWeightPath"] == str(tmp_path / "qwen-w8a8")
    assert model["ModelConfig"][0]["worldSize"] == 1  # untouched fields of the installation survive
    assert model["maxSeqLen"] == 1024 and model["maxInputTokenLen"] == 768
    assert rendered["ServerConfig"] | {} == {
        "ipAddress": "127.0.0.1",
        "port": 9001,
        "managementPort": 9002,
        "metricsPort": 9003,
        "httpsEnabled": False,
    }
    assert rendered["BackendConfig"]["npuDeviceIds"] == [[0]]
    assert _digest(installed) == before


def test_assumptions_name_the_installed_version_and_config_stand_in(tmp_path, tiny_model):
    """MindIE itself cannot run here (a stand-in install): what a MindIE study's figures stand
    on includes the installation's version file and the installed config.json's content, so a
    MindIE upgrade or an edited installed config is named when a run resumes the study."""
    from tuner.assumptions import changed

    install = tmp_path / "mindie-service"
    (install / "conf").mkdir(parents=True)
    (install / "conf" / "config.json").write_text(json.dumps(INSTALLED, indent=2))
    (install / "version").write_text("Ascend-mindie-service 2.3.0\n")
    before = _runner(install, tiny_model, tmp_path).assumptions()
    assert before["engine version"] == "Ascend-mindie-service 2.3.0"
    reindented = json.dumps(INSTALLED)  # the same content: no change
    (install / "conf" / "config.json").write_text(reindented)
    assert changed(before, _runner(install, tiny_model, tmp_path).assumptions()) == []
    edited = json.loads(reindented)
    edited["ServerConfig"] = {**edited.get("ServerConfig", {}), "maxLinkNum": 7}
    (install / "conf" / "config.json").write_text(json.dumps(edited))
    (install / "version").write_text("Ascend-mindie-service 2.3.1\n")
    after = _runner(install, tiny_model, tmp_path).assumptions()
    assert [line.split(" ->")[0] for line in changed(before, after)] == [
        "engine version Ascend-mindie-service 2.3.0",
        f"installed config.json sha256 {before['installed config.json sha256']}",
    ]


def test_a_field_outside_mindies_range_is_refused(mindie_install, tiny_model, tmp_path):
    runner = _runner(mindie_install, tiny_model, tmp_path)
    with pytest.raises(InputError, match=r"maxBatchSize: 6000 is outside MindIE's range 1\.\.5000"):
        runner.render_config(render("mindie", {"batch_size": 6000}), (1, 2, 3), (10, 20))


def test_stand_in_daemon_got_the_rendered_schedule(mindie_install, tiny_model, tmp_path):
    runner = _runner(mindie_install, tiny_model, tmp_path)
    config = {
        "batch_size": 12,
        "select_batch": "prefill-first",
        "max_prefill_tokens": 2048,
        "quantization": "bf16",
    }
    m = runner.run(config, small_scenario(requests=10).workload)
    assert m.fault is None, m.fault
    log = Path(m.extra["engine_log"]).read_text()
    assert READY_LINE in log
    assert '"maxBatchSize": 12' in log and '"supportSelectBatch": false' in log
    assert m.extra["stop_s"] < 5


def test_precisions_without_weights_leave_the_space(mindie_install, tiny_model, tmp_path):
    from search_spaces.space import SearchSpace

    runner = _runner(mindie_install, tiny_model, tmp_path, weights={"w8a8": tmp_path})
    space = runner.adapt(SearchSpace.load("mindie"))
    assert space.ranges["quantization"].choices == ["bf16", "w8a8"]
    assert any("quantization limited" in note for note in space.notes)


def test_runner_config_file_is_validated(tmp_path):
    path = tmp_path / "runner.yaml"
    path.write_text("install_dir: /opt/mindie\nready_timeout_s: -1\n")
    with pytest.raises(
        InputError, match=r"runner.yaml: ready_timeout_s: Input should be greater than 0"
    ):
        load_settings(MindIESettings, path)
    path.write_text("instal_dir: /opt/mindie\n")
    with pytest.raises(InputError, match=r"instal_dir: Extra inputs are not permitted"):
        load_settings(MindIESettings, path)


def test_the_export_nests_as_the_runner_writes(mindie_install, tiny_model, tmp_path):
    """MindIE 1.0 and later read ScheduleConfig and ModelDeployConfig under BackendConfig (the
    installation's config.json here is in that form): the export's config_json, merged into the
    installed file, must land where the runner's own rendering puts the knobs (issue 30, item
    5; the export used to put them at the top level, where MindIE ignores them)."""
    runner = _runner(mindie_install, tiny_model, tmp_path)
    config = {
        "batch_size": 24,
        "select_batch": "decode-first",
        "max_prefill_tokens": 4096,
        "quantization": "bf16",
        "kv_compression": 1.0,
        "max_prefill_batch_size": 6,
    }
    workload = small_scenario(requests=40).workload
    exported = native_forms(config, workload, "mindie", None, None)["mindie"]["config_json"]
    sizes = (workload.longest_prompt, workload.longest_request)
    rendered = runner.render_config(render("mindie", config), (9001, 9002, 9003), sizes)
    assert set(exported) == {"BackendConfig"}
    for section in ("ScheduleConfig", "ModelDeployConfig"):
        for name, value in exported["BackendConfig"][section].items():
            assert rendered["BackendConfig"][section][name] == value, (section, name)
