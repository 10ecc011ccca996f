"""Quality through prompt_logprobs on MindIE's runner, against a STAND-IN daemon (MindIE needs
Ascend NPUs and cannot run here; this tests the runner's path, not MindIE): the stand-in reads
the trial's config.json like tests/test_runner_mindie.py's, and answers /v1/completions with
fixed next-token distributions chosen by the weights it was given and by RazorAttention (the
KV knob), so the expected KL and agreement are computed by hand below. Also: a server without
prompt_logprobs, and an openai runner that cannot start the reference, give their reasons."""

from __future__ import annotations

import copy
import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

from runners.engines.mindie import MindIERunner, MindIESettings
from runners.engines.openai import OpenAIRunner, OpenAISettings
from runners.quality import QualityUnavailable, load_eval_prompts
from tests.conftest import small_scenario
from tests.test_runner_mindie import INSTALLED

STAND_IN = r"""
import json, math, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

config = json.load(open(os.environ["MIES_CONFIG_JSON_PATH"]))
weights = config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"]
razor = os.environ.get("ATB_LLM_RAZOR_ATTENTION_ENABLE") == "1"
# Next-token distribution over tokens 1, 2, 3 at every position.
if weights.endswith("w8a8"):
    probs = (0.3, 0.5, 0.2)
else:
    probs = (0.45, 0.35, 0.2) if razor else (0.5, 0.3, 0.2)
with_logprobs = config.get("standInPromptLogprobs", True)

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass
    def _send(self, data):
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._send({"data": [{"id": "autotune-model"}]})
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        choice = {"index": 0, "text": " x"}
        if with_logprobs and request.get("prompt_logprobs"):
            entries = [None]
            for token in request["prompt"][1:]:
                entry = {
                    str(t): {"logprob": math.log(p), "rank": r + 1}
                    for r, (t, p) in enumerate(zip((1, 2, 3), probs))
                }
                entry.setdefault(str(token), {"logprob": -9999.0, "rank": 4})
                entries.append(entry)
            choice["prompt_logprobs"] = entries
        usage = {"prompt_tokens": len(request["prompt"]), "completion_tokens": 1}
        self._send({"choices": [choice], "usage": usage})

server = config["ServerConfig"]
httpd = ThreadingHTTPServer((server["ipAddress"], server["port"]), Handler)
print("Daemon start success!", flush=True)
httpd.serve_forever()
"""


def _install(folder: Path, with_logprobs: bool = True) -> Path:
    installed = copy.deepcopy(INSTALLED) | {"standInPromptLogprobs": with_logprobs}
    (folder / "conf").mkdir(parents=True)
    (folder / "conf" / "config.json").write_text(json.dumps(installed))
    daemon = folder / "bin" / "mindieservice_daemon"
    daemon.parent.mkdir()
    daemon.write_text(f"#!{sys.executable}\n" + textwrap.dedent(STAND_IN))
    daemon.chmod(0o755)
    return folder


def _runner(install: Path, model: Path, tmp: Path) -> MindIERunner:
    settings = MindIESettings(
        install_dir=install,
        model=model,
        log_dir=tmp / "logs",
        quality_cache=tmp / "quality",
        weights={"w8a8": tmp / "qwen-w8a8"},
        warmup_requests=1,
    )
    return MindIERunner(settings, hardware="stand-in")


def _measure(runner: MindIERunner, config: dict, prompts: list[str]):
    with runner.session(config, small_scenario(requests=4).workload) as session:
        return runner.measure_quality(config, session, prompts)


def _positions(tokenizer, prompts: list[str], window: int = 64) -> int:
    """Each prompt of n tokens is cut into ceil(n / window) windows, and every window's first
    token has no distribution: n - ceil(n / window) scored positions."""
    return sum(n - math.ceil(n / window) for n in (len(tokenizer(p)["input_ids"]) for p in prompts))


BASE = {"batch_size": 8, "select_batch": "decode-first", "max_prefill_tokens": 4096}


def test_standin_mindie_measures_against_a_reference_it_starts_once(tiny_model, tmp_path):
    """Stand-in daemon, not MindIE. A w8a8 trial's quality needs the reference: the runner starts
    a second (reference) daemon once, keeps its distributions, and later trials reuse them."""
    runner = _runner(_install(tmp_path / "mindie"), tiny_model, tmp_path)
    prompts = load_eval_prompts(None)
    positions = _positions(runner.tokenizer(), prompts)
    w8a8 = _measure(runner, BASE | {"quantization": "w8a8", "kv_compression": 1.0}, prompts)
    # At every position the reference is (.5, .3, .2) and w8a8 (.3, .5, .2) over tokens 1, 2, 3:
    # KL = .5 ln(.5/.3) + .3 ln(.3/.5) = .2 ln(5/3) = 0.102165; the top token always differs.
    assert w8a8.kl == pytest.approx(0.102165, abs=1e-6)
    assert w8a8.top1_agreement == 0.0 and w8a8.samples == positions
    assert w8a8.source == "measured" and "prompt_logprobs" in w8a8.note
    assert len(list((tmp_path / "logs").iterdir())) == 2  # the trial's daemon and the reference's

    razor = _measure(runner, BASE | {"quantization": "bf16", "kv_compression": 0.5}, prompts)
    # RazorAttention: (.45, .35, .2): .5 ln(.5/.45) + .3 ln(.3/.35) = 0.052680 - 0.046245
    assert razor.kl == pytest.approx(0.006435, abs=1e-6) and razor.top1_agreement == 1.0
    reference = _measure(runner, BASE | {"quantization": "bf16", "kv_compression": 1.0}, prompts)
    assert reference.kl == 0.0 and reference.top1_agreement == 1.0
    assert (
        len(list((tmp_path / "logs").iterdir())) == 4
    )  # one daemon per trial, no second reference


def test_standin_mindie_reference_prepared_before_any_trial_engine(tiny_model, tmp_path):
    """Stand-in daemon, not MindIE. prepare_quality measures the reference with no trial engine
    running (one accelerator need not hold two engines); the trial then starts only its own."""
    runner = _runner(_install(tmp_path / "mindie"), tiny_model, tmp_path)
    prompts = load_eval_prompts(None)
    config = BASE | {"quantization": "w8a8", "kv_compression": 1.0}
    runner.prepare_quality(config, prompts)
    assert len(list((tmp_path / "logs").iterdir())) == 1
    assert _measure(runner, config, prompts).kl == pytest.approx(0.102165, abs=1e-6)
    assert len(list((tmp_path / "logs").iterdir())) == 2


def test_standin_server_without_prompt_logprobs_is_not_measured_and_says_why(tiny_model, tmp_path):
    """Stand-in daemon, not MindIE: one that ignores prompt_logprobs."""
    runner = _runner(_install(tmp_path / "mindie", with_logprobs=False), tiny_model, tmp_path)
    with pytest.raises(QualityUnavailable, match="returns no prompt_logprobs"):
        _measure(
            runner, BASE | {"quantization": "bf16", "kv_compression": 1.0}, load_eval_prompts(None)
        )
    assert not list((tmp_path / "quality").rglob("*.json"))  # nothing half-measured is kept


def test_openai_runner_on_a_running_server_has_no_reference_to_compare_with(tmp_path):
    runner = OpenAIRunner(
        OpenAISettings(base_url="http://127.0.0.1:9", log_dir=tmp_path), hardware="x"
    )
    with pytest.raises(QualityUnavailable, match="the server at base_url is already running"):
        runner.measure_quality({}, None, ["text"])
