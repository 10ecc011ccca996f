"""An OpenAI-compatible stand-in whose first chunk leaves a known time after the request
arrived: it records, per prompt, the request's arrival (headers and body read) and the moment
the first chunk was written, on its own clock. Run as its own process (so the load generator's
event loop and the server never share a GIL): `python testing/timed_stand_in.py PORT_FILE
LOG_FILE DELAY_MS`; it writes its port to PORT_FILE and, per request, a line "prompt arrived
first_written" (perf_counter seconds) to LOG_FILE."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

DELAY_MS = 20.0  # the stand-in's wait before its first chunk


def overhead_ms(tmp_path: Path, requests: int) -> list[float]:
    """Per request: the load generator's TTFT less the stand-in's own wait, in ms (the stand-in
    run in its own process in `tmp_path`, one request at a time, 50 ms apart)."""
    from runners.load.loadgen import Target, drive
    from runners.load.workload import Requests

    port_file, log_file = tmp_path / "port", tmp_path / "log"
    server = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            str(port_file),
            str(log_file),
            str(DELAY_MS),
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline and server.poll() is None, "stand-in did not start"
            time.sleep(0.05)
        target = Target(
            f"http://127.0.0.1:{port_file.read_text()}", "stand-in", request_timeout_s=5
        )
        prompts = [f"p{i}" for i in range(requests)]
        # one at a time, 50 ms apart: no queue at the server, each wait the stand-in's own
        plan = Requests(
            np.full(requests, 5), np.full(requests, 1), np.arange(requests) * 0.05, None
        )
        result = drive(target, prompts, plan, [], None)
    finally:
        server.terminate()
        server.wait(timeout=10)
    m = result.measurement
    assert m.sent == requests and m.ok.all(), m.extra
    served = {}
    for line in log_file.read_text().splitlines():
        prompt, arrived, written = line.split()
        served[prompt] = float(written) - float(arrived)
    ttft = (m.first_token_s - m.send_s)[m.warmup :]
    waits = [served[p] for p in prompts[m.warmup :]]
    return [(t - w) * 1000 for t, w in zip(ttft, waits, strict=True)]


def main() -> None:
    port_file, log_file, delay_ms = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    log = log_file.open("a", buffering=1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            arrived = time.perf_counter()
            time.sleep(delay_ms / 1000)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
            self._send(f"data: {json.dumps(chunk)}\n\n")
            written = time.perf_counter()
            # logged before the rest: a client that has read [DONE] may close the connection
            log.write(f"{body['prompt']} {arrived:.9f} {written:.9f}\n")
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
            try:
                self._send(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client read [DONE] and went

        def _send(self, text: str) -> None:
            data = text.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_file.write_text(str(server.server_address[1]))
    server.serve_forever()


if __name__ == "__main__":
    main()
