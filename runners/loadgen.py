"""The load generator every real runner shares: a scenario's requests against an
OpenAI-compatible streaming `/v1/completions` endpoint (asyncio + httpx).

Per request it records send, first-token and finish times, the server's own token counts and
the gaps between streamed chunks (ITL); errors and timeouts are kept as failed requests, never
dropped. Metric definitions live in runners/measurement.py.

Early rejection: Optuna cannot prune multi-objective trials, so a load asked to stop early
stops as soon as its SLA is certainly missed, counting as the metrics do: the TTFT p99 covers
successful requests, the success rate counts failed ones, and a late request still in flight
may end either way (runners.measurement.load_certainly_fails).

A token is counted when the server says it was generated, not when it shows text: a token that
ends inside a multi-byte character (or a random model's special token) streams as empty text.
TTFT is the first visible text; where a request's first token came without text, its first
token chunk stands in, and the record counts it (`invisible_first_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from objectives.scenario import SLA
from runners.measurement import Measurement, load_certainly_fails
from runners.workload import Requests

WATCH_INTERVAL_S = 0.05


@dataclass
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str  # the `model` field of each request
    extra_body: dict[str, Any] = field(default_factory=dict)  # e.g. logit_bias for a random model
    request_timeout_s: float = 120.0  # also the longest silence between two chunks


@dataclass(frozen=True)
class RejectionRule:
    """When a load may stop: its TTFT p99 bound and the share of requests that must succeed."""

    ttft_bound_s: float
    min_success_rate: float

    @classmethod
    def of(cls, sla: SLA) -> RejectionRule:
        return cls(sla.ttft_p99_ms / 1000, sla.required_success_rate)


@dataclass
class _Record:
    send: float = math.nan
    first: float = math.nan
    finish: float = math.nan
    prompt_tokens: int = -1
    output_tokens: int = 0
    ok: bool = False
    error: str = ""
    first_chunk: float = math.nan  # the first chunk carrying a token, text or not
    first_invisible: bool = False  # the first token streamed as empty text
    stalled: bool = False  # timed out waiting for the server (not refused by it)
    gaps: list[float] = field(default_factory=list)

    @property
    def in_flight(self) -> bool:
        return not self.ok and not self.error


class _Load:
    def __init__(
        self,
        target: Target,
        prompts: list[str],
        requests: Requests,
        rejection: RejectionRule | None,
    ):
        self.target = target
        self.prompts = prompts
        self.requests = requests
        self.records = [_Record() for _ in range(len(requests))]
        self.rejection = rejection
        self.rejected: str | None = None
        self.done = asyncio.Event()
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def payload(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.target.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
            **self.target.extra_body,
        }

    async def send(self, client: httpx.AsyncClient, i: int) -> None:
        record = self.records[i]
        body = self.payload(self.prompts[i], int(self.requests.output_tokens[i]))
        try:
            await asyncio.wait_for(
                self._stream(client, body, record), self.target.request_timeout_s * 4
            )
        except asyncio.TimeoutError:
            record.error = f"no answer within {self.target.request_timeout_s * 4:g} s"
            record.stalled = True
        except httpx.TimeoutException:
            record.error = f"stalled: nothing streamed for {self.target.request_timeout_s:g} s"
            record.stalled = True
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as error:
            record.error = f"{type(error).__name__}: {error}"
        if math.isnan(record.send):  # failed before it was sent
            record.send = self.now()
        record.finish = self.now()
        record.ok = not record.error
        self._check_rejection()

    async def _stream(self, client: httpx.AsyncClient, body: dict, record: _Record) -> None:
        last = None
        chunks = 0
        # Built (JSON encoded) before the send time is stamped: TTFT starts when the request leaves.
        request = client.build_request("POST", f"{self.target.base_url}/v1/completions", json=body)
        record.send = self.now()
        response = await client.send(request, stream=True)
        try:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"server error: {str(chunk['error'])[:200]}"
                    return
                choices = chunk.get("choices")
                stamp = self.now()
                if choices and math.isnan(record.first_chunk):
                    record.first_chunk = stamp
                if choices and choices[0].get("text"):
                    if last is None:
                        record.first = stamp
                        self._check_rejection()
                    else:
                        record.gaps.append(stamp - last)
                    last = stamp
                    chunks += 1
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = int(usage["prompt_tokens"])
                    record.output_tokens = int(usage["completion_tokens"])
        finally:
            await response.aclose()
        if record.error:
            return
        if record.output_tokens == 0:
            record.output_tokens = chunks  # a server without usage: one chunk per token
        if record.output_tokens == 0:
            record.error = "the stream ended without a token"
        elif last is None or record.first_chunk < record.first:
            record.first_invisible = True
            if last is None:  # generated tokens (per usage), none of them visible text
                record.first = record.first_chunk

    def tally(self) -> tuple[int, int, int]:
        """(successful requests that were late, late requests still in flight, failed requests)."""
        bound = self.rejection.ttft_bound_s
        now = self.now()
        late_ok = late_in_flight = failed = 0
        for r in self.records:
            if math.isnan(r.send):
                continue
            if r.error:
                failed += 1
                continue
            # A token that streamed as empty text is a token: its chunk ends the wait too.
            first = r.first if not math.isnan(r.first) else r.first_chunk
            waited = (now if math.isnan(first) else first) - r.send
            if waited > bound:
                late_ok += r.ok
                late_in_flight += r.in_flight
        return late_ok, late_in_flight, failed

    def _check_rejection(self) -> None:
        if self.rejection is None or self.rejected:
            return
        late_ok, late_in_flight, failed = self.tally()
        rule = self.rejection
        if load_certainly_fails(
            len(self.records), late_ok, late_in_flight, failed, rule.min_success_rate
        ):
            self.rejected = (
                f"SLA certainly broken (TTFT p99 bound {rule.ttft_bound_s * 1000:g} ms, success rate "
                f">= {rule.min_success_rate:g}): of {len(self.records)} planned requests {late_ok} "
                f"succeeded late, {late_in_flight} are late in flight, {failed} failed"
            )
            self.done.set()

    async def watch(self) -> None:
        while not self.done.is_set():
            self._check_rejection()
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def open_loop(self, client: httpx.AsyncClient) -> None:
        tasks = []
        for i, at in enumerate(self.requests.arrival_s):
            delay = at - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.done.is_set():
                break
            tasks.append(asyncio.create_task(self.send(client, i)))
        await asyncio.gather(*tasks)

    async def closed_loop(self, client: httpx.AsyncClient) -> None:
        pending = iter(range(len(self.requests)))

        async def user() -> None:
            for i in pending:
                if self.done.is_set():
                    return
                await self.send(client, i)

        await asyncio.gather(*(user() for _ in range(self.requests.concurrency)))

    async def run(self, warmup: list[str]) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.target.request_timeout_s, connect=10.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            for prompt in warmup:  # compile, allocate, fill caches: excluded from the metrics
                warm = _Record()
                await self._stream(client, self.payload(prompt, 4), warm)
                if warm.error:
                    raise httpx.HTTPError(f"warm-up request failed: {warm.error}")
            self.t0 = time.perf_counter()
            drive = (
                self.open_loop(client)
                if self.requests.arrival_s is not None
                else self.closed_loop(client)
            )
            load = asyncio.create_task(drive)
            watcher = asyncio.create_task(self.watch())
            stopper = asyncio.create_task(self.done.wait())
            await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
            self.done.set()
            for task in (load, watcher, stopper):
                task.cancel()
            await asyncio.gather(load, watcher, stopper, return_exceptions=True)


def drive(
    target: Target,
    prompts: list[str],
    requests: Requests,
    warmup: list[str],
    rejection: RejectionRule | None,
) -> tuple[Measurement, str | None]:
    """Run the load; the measurement and, when it was stopped early (by `rejection`), why."""
    load = _Load(target, prompts, requests, rejection)
    asyncio.run(load.run(warmup))
    records = load.records
    sent = [r for r in records if not math.isnan(r.send)]
    if load.rejected:
        for r in sent:  # cancelled in flight: unfinished, not successful
            if r.ok is False and not r.error:
                r.error = "stopped by early rejection"
    planned_inputs = requests.input_tokens[: len(sent)]
    inputs = np.array(
        [
            r.prompt_tokens if r.prompt_tokens >= 0 else planned
            for r, planned in zip(sent, planned_inputs)
        ],
        dtype=np.int64,
    )
    gaps = [g for r in sent if r.ok for g in r.gaps]
    measurement = Measurement(
        send_s=np.array([r.send for r in sent]),
        first_token_s=np.array([r.first for r in sent]),
        finish_s=np.array([r.finish if r.ok else math.nan for r in sent]),
        input_tokens=inputs,
        output_tokens=np.array([r.output_tokens for r in sent], dtype=np.int64),
        ok=np.array([r.ok for r in sent], dtype=bool),
        itl_s=np.array(gaps),
    )
    errors = [r.error for r in sent if r.error]
    measurement.extra["requests_planned"] = len(records)
    measurement.extra["errors"] = len(errors)
    measurement.extra["invisible_first_tokens"] = sum(r.first_invisible for r in sent if r.ok)
    stalls = [r.error for r in sent if r.stalled]
    measurement.extra["stalled"] = len(stalls)
    if stalls:
        measurement.extra["first_stall"] = stalls[0]
    if errors:
        measurement.extra["first_error"] = errors[0]
    return measurement, load.rejected
