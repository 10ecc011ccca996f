"""A real llama-server serves a trial's last load as fast as its first (issue 30, item 9).

As shipped before, llama-server ran at `-lv 4` with its RAM prompt cache on: every request
added its prompt to the cache and a log line per cached prompt, and in one batch-1 trial the
server's TTFT p50 rose from 5.7 to 42 ms while its log reached 3 GB; capacities came out 3-13x
low and in the wrong order (16 slots below 4). These tests load one server with a few thousand
requests and compare its quarters, then search two configs' capacities."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from objectives.scenario import Scenario
from testing.engines import engine_scenario
from tests.test_runner_llamacpp import make_runner

CONFIG = {"max_prefill_tokens": 512, "quantization": "bf16", "kv_compression": 1.0}
QUARTER = 500  # requests per quarter: 2,000 in all
RATE = 50.0  # req/s: a batch-1 server keeps up with it on short answers (capacity ~170 here)


def _counter(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


def test_the_last_quarter_is_served_as_fast_as_the_first(
    llama_server, tiny_model, tmp_path, gguf_cache
):
    import httpx

    runner = make_runner(llama_server, tiny_model, tmp_path, gguf_cache)
    scenario = engine_scenario(requests=QUARTER, rate=RATE, ttft_ms=1000)
    ttft_p50_ms, prompt_ms, sent = [], [], 0
    with runner.session({**CONFIG, "batch_size": 1}, scenario.workload) as session:
        metrics_url = f"{session.base_url}/metrics"  # type: ignore[attr-defined]
        for quarter in range(4):
            before = httpx.get(metrics_url).text
            m = session.measure(scenario.at_rate(RATE, quarter))  # fresh arrivals, fresh text
            after = httpx.get(metrics_url).text
            assert m.fault is None and m.ok.all()
            sent += m.sent
            ttft_p50_ms.append(float(np.median(m.first_token_s - m.send_s)) * 1000)
            # The server's own prompt processing per request, from its Prometheus counters.
            seconds = _counter(after, "llamacpp:prompt_seconds_total") - _counter(
                before, "llamacpp:prompt_seconds_total"
            )
            prompt_ms.append(seconds / m.sent * 1000)
        log = Path(session.extra["engine_log"])  # type: ignore[attr-defined]
    print(f"TTFT p50 by quarter {ttft_p50_ms} ms; server prompt time {prompt_ms} ms")
    # The server's own time, within noise: the growing cache made the last quarter 1.5x slower
    # after 800 requests, 7x over a whole trial. The client's TTFT (printed) also carries the
    # load generator's share of a busy machine: beside the other test worker it read 2.8 ->
    # 5.0 ms by quarter while the server's own time read 1.10 -> 1.29 ms.
    assert prompt_ms[3] < 1.5 * prompt_ms[0], prompt_ms
    # Quiet under load: warnings and errors only, nothing per request (-lv 4 wrote ~2.2 kB each).
    assert log.stat().st_size / sent < 50, log.stat().st_size


def test_sixteen_slots_batch_what_one_slot_queues(llama_server, tiny_model, tmp_path, gguf_cache):
    """Sixteen users at once, each sending its next request when its answer (256-512 tokens)
    is done (a closed loop): one slot serves them in turn, so a request waits for the answers
    of most of the other fifteen before its first token; 16 slots start each request in the
    next step beside the others' decoding. As shipped before issue 30 the cache-growing server
    ranked 16 slots below 4.

    The figure is the median TTFT under a closed loop, not a capacity nor an open rate: on the
    tiny model decoding is compute-bound on the CPU, so 16 slots serve only somewhat more
    than one, and an open rate between the two (1.2 or 2 times what one slot served alone)
    left the comparison to the neighbour test worker's load (1.85x once; at 2x, 1,382 against
    1,069 ms). A closed loop's queue is the users', whatever the machine's speed."""
    data = engine_scenario(requests=64, ttft_ms=1000, output=(256, 512)).model_dump(mode="json")
    data["workload"]["arrival"] = {"kind": "closed", "concurrency": 16}
    data["load"] = {"mode": "fixed"}
    scenario = Scenario.model_validate(data)
    runner = make_runner(llama_server, tiny_model, tmp_path, gguf_cache)
    ttft_p50_ms = {}
    for slots in (1, 16):
        with runner.session({**CONFIG, "batch_size": slots}, scenario.workload) as session:
            m = session.measure(scenario.workload)
        assert m.fault is None and m.ok.all(), m.fault
        ttft_p50_ms[slots] = float(np.median(m.first_token_s - m.send_s)) * 1000
    print(f"TTFT p50 ms by slots, 16 users: {ttft_p50_ms}")
    assert ttft_p50_ms[16] * 4 < ttft_p50_ms[1], ttft_p50_ms
