"""How the load generator reads a stream, against a stand-in OpenAI-compatible server on
loopback that sends exactly the chunks a case needs (no engine streams an all-empty answer on
demand). Real engines are driven by test_loadgen.py and the runner tests."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from objectives.scenario import SLA
from runners.load.loadgen import RejectionRule, Target, drive
from runners.load.workload import Requests

TOKENS = 32


def _chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


# What the stand-in streams for a prompt; a 32-token answer reported by `usage` in each case.
STREAMS = {
    # llama-server on a random model: 32 tokens, sent as one chunk with no text.
    "all-empty": [_chunk("", "length")],
    # A first token inside a multi-byte character: empty text first, the character next.
    "empty-then-text": [
        _chunk(""),
        _chunk("你"),
        *[_chunk("x") for _ in range(30)],
        _chunk("", "length"),
    ],
    "plain": [*[_chunk("x") for _ in range(TOKENS)], _chunk("", "length")],
}


class _StandIn(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] == "overloaded":
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b'{"error": "server busy"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in STREAMS[body["prompt"]]:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": TOKENS}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def stand_in():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Target(f"http://127.0.0.1:{server.server_address[1]}", "stand-in", request_timeout_s=5)
    server.shutdown()


def _load(target: Target, prompts: list[str], rejection: RejectionRule | None = None):
    n = len(prompts)
    requests = Requests(np.full(n, 5), np.full(n, TOKENS), np.arange(n) * 0.02, None)
    return drive(target, prompts, requests, [], rejection)


def test_answers_whose_tokens_stream_as_empty_text_are_successes(stand_in):
    m, rejected = _load(stand_in, ["all-empty", "empty-then-text", "plain"])
    assert rejected is None
    assert m.ok.all(), m.extra
    assert list(m.output_tokens) == [TOKENS] * 3  # the server's count, not the chunks with text
    assert m.extra["invisible_first_tokens"] == 2  # the two whose first token had no text
    assert np.isfinite(m.first_token_s).all() and (m.first_token_s >= m.send_s).all()


def test_a_refused_request_is_a_failure_the_load_goes_on_after(stand_in):
    m, rejected = _load(stand_in, ["plain", "overloaded", "plain", "plain"])
    assert rejected is None and m.sent == 4
    assert list(m.ok) == [True, False, True, True]
    assert m.extra["errors"] == 1 and "HTTP 503" in m.extra["first_error"]


def test_a_refused_request_stops_a_load_that_must_all_succeed(stand_in):
    """Without min_success_rate every request must succeed: the first 503 settles the load."""
    rule = RejectionRule.of(SLA(ttft_p99_ms=5000))
    m, rejected = _load(stand_in, ["overloaded"] + ["plain"] * 30, rule)
    assert rejected is not None and "1 failed" in rejected
    assert m.sent < 31
    tolerant = RejectionRule.of(SLA(ttft_p99_ms=5000, min_success_rate=0.9))
    m, rejected = _load(stand_in, ["overloaded"] + ["plain"] * 30, tolerant)
    assert rejected is None and m.sent == 31


class _RefusesAll(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(503)
        self.end_headers()
        self.wfile.write(b'{"error": "server busy"}')

    def log_message(self, *args) -> None:
        pass


def test_a_live_server_refusing_every_request_is_a_miss_not_an_engine_fault(tiny_model, tmp_path):
    """An overloaded server may refuse a whole step: that step misses the success rate (the
    capacity search bisects on it); only an engine that dies or hangs is a fault."""
    from objectives.scenario import SLA as Sla
    from runners.engines.openai import OpenAIRunner, OpenAISettings
    from testing.engines import engine_scenario

    server = ThreadingHTTPServer(("127.0.0.1", 0), _RefusesAll)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        runner = OpenAIRunner(
            OpenAISettings(
                base_url=f"http://127.0.0.1:{server.server_address[1]}",
                tokenizer=tiny_model,
                log_dir=tmp_path / "logs",
                warmup_requests=0,
                served_model="stand-in",
            ),
            hardware="cpu",
        )
        m = runner.run({}, engine_scenario(requests=6).workload, Sla(ttft_p99_ms=1000))
    finally:
        server.shutdown()
    assert m.fault is None, m.fault
    assert m.sent == 6 and not m.ok.any() and "HTTP 503" in m.extra["first_error"]
