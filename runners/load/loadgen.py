"""The load generator every real runner shares: a scenario's requests against an
OpenAI-compatible streaming `/v1/completions` endpoint (asyncio + httpx).

Per request it records send, first-token and finish times, the server's own token counts and
the gaps between streamed chunks (ITL); errors and timeouts are kept as failed requests, never
dropped. Metric definitions live in runners/load/measurement.py.

Early rejection: Optuna cannot prune multi-objective trials, so a load asked to stop early
stops as soon as its SLA is certainly missed, counting as the metrics do: the TTFT p99 covers
successful requests after the warm-up, the success rate counts every failed one, and a late
request still in flight may end either way (runners.load.measurement.load_certainly_fails).

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
from typing import Any, NamedTuple

import httpx
import numpy as np

from objectives.scenario import SLA
from runners.load.measurement import Measurement, load_certainly_fails, warmup_requests
from runners.load.workload import Requests

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


class LateTally(NamedTuple):
    """Where a load stands against its TTFT bound (runners.load.measurement.load_certainly_fails):
    the first three count the requests after the warm-up."""

    late_ok: int  # successful requests whose first token came after the bound
    late_in_flight: int  # requests still in flight that have waited past the bound
    failed: int  # failed requests
    warmup_failed: int = 0  # failed requests of the warm-up


class LoadResult(NamedTuple):
    measurement: Measurement
    rejected: str | None  # why the load was stopped early; None when it ran whole


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
    rank: int = -1  # its place in the send order (the warm-up is the first sent)
    prompt: str = ""  # as sent (a session's turn carries its history)
    # the streamed text, kept where a later turn of its session sends it on
    answer: list[str] | None = None

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
        # The load's own warm-up, its first requests; `run`'s warm-up prompts come before it.
        self.warmup_requests = warmup_requests(len(requests))
        self.rejection = rejection
        self.rejected: str | None = None
        self.sent = 0
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

    def prompt_for(self, index: int) -> str:
        """The request's prompt: with sessions, the history (the previous turn's prompt and
        answer, as the server streamed it) and then its own text."""
        sessions = self.requests.sessions
        if sessions is None:
            return self.prompts[index]
        if sessions.following[index] >= 0:
            self.records[index].answer = []
        if sessions.previous[index] < 0:
            return self.prompts[index]
        previous = self.records[int(sessions.previous[index])]
        history = previous.prompt + "".join(previous.answer or [])
        previous.prompt, previous.answer = "", None  # sent on: the history is this turn's now
        return history + self.prompts[index]

    async def send(self, client: httpx.AsyncClient, index: int) -> None:
        record = self.records[index]
        record.rank, self.sent = self.sent, self.sent + 1
        record.prompt = self.prompt_for(index)
        body = self.payload(record.prompt, int(self.requests.output_tokens[index]))
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
        last_text_s = None
        text_chunks = 0

        # Built (JSON encoded) before the send time is stamped: TTFT starts when the request
        # leaves, stamped where GuideLLM stamps it: as httpcore starts writing its headers (the
        # trace extension), after the client's own send path and any connection set-up.
        async def trace(event: str, info: dict[str, Any]) -> None:
            if event == "http11.send_request_headers.started":
                record.send = self.now()

        request = client.build_request(
            "POST",
            f"{self.target.base_url}/v1/completions",
            json=body,
            extensions={"trace": trace},
        )
        record.send = self.now()  # restamped by the trace; kept where no trace fires
        response = await client.send(request, stream=True)
        try:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for line in response.aiter_lines():
                stamp = self.now()  # as the line arrives, before it is decoded
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
                if choices and math.isnan(record.first_chunk):
                    record.first_chunk = stamp
                if choices and choices[0].get("text"):
                    if record.answer is not None:
                        record.answer.append(choices[0]["text"])
                    if last_text_s is None:
                        record.first = stamp
                        self._check_rejection()
                    else:
                        record.gaps.append(stamp - last_text_s)
                    last_text_s = stamp
                    text_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = int(usage["prompt_tokens"])
                    record.output_tokens = int(usage["completion_tokens"])
        finally:
            await response.aclose()
        if record.error:
            return
        if record.output_tokens == 0:
            record.output_tokens = text_chunks  # a server without usage: one chunk per token
        if record.output_tokens == 0:
            record.error = "the stream ended without a token"
        elif last_text_s is None or record.first_chunk < record.first:
            record.first_invisible = True
            if last_text_s is None:  # generated tokens (per usage), none of them visible text
                record.first = record.first_chunk

    def tally(self, ttft_bound_s: float) -> LateTally:
        """The sent requests counted against a TTFT bound: late ones (by outcome) and failed."""
        now = self.now()
        late_ok = late_in_flight = failed = warmup_failed = 0
        for record in self.records:
            if math.isnan(record.send):
                continue
            warming = 0 <= record.rank < self.warmup_requests
            if record.error:
                if warming:
                    warmup_failed += 1
                else:
                    failed += 1
                continue
            if warming:
                continue
            # A token that streamed as empty text is a token: its chunk ends the wait too.
            first = record.first if not math.isnan(record.first) else record.first_chunk
            waited = (now if math.isnan(first) else first) - record.send
            if waited > ttft_bound_s:
                late_ok += record.ok
                late_in_flight += record.in_flight
        return LateTally(late_ok, late_in_flight, failed, warmup_failed)

    def _check_rejection(self) -> None:
        rule = self.rejection
        if rule is None or self.rejected:
            return
        tally = self.tally(rule.ttft_bound_s)
        if load_certainly_fails(
            len(self.records),
            tally.late_ok,
            tally.late_in_flight,
            tally.failed,
            rule.min_success_rate,
            self.warmup_requests,
            tally.warmup_failed,
        ):
            self.rejected = (
                f"SLA certainly broken (TTFT p99 bound {rule.ttft_bound_s * 1000:g} ms, "
                f"success rate >= {rule.min_success_rate:g}): of {len(self.records)} planned "
                f"requests, after a warm-up of {self.warmup_requests}, {tally.late_ok} "
                f"succeeded late, {tally.late_in_flight} are late in flight, "
                f"{tally.failed + tally.warmup_failed} failed"
            )
            self.done.set()

    async def watch(self) -> None:
        while not self.done.is_set():
            self._check_rejection()
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def open_loop(self, client: httpx.AsyncClient, arrival_s: np.ndarray) -> None:
        tasks = []
        for i, arrival in enumerate(arrival_s):
            delay = arrival - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.done.is_set():
                break
            tasks.append(asyncio.create_task(self.send(client, i)))
        await asyncio.gather(*tasks)

    async def session(self, client: httpx.AsyncClient, first: int, start_s: float) -> None:
        """A session's turns in order, each a think time after the previous answer and, in an
        open loop, not before its planned time (runners.load.sessions); a turn that failed
        leaves the rest of its session unsent, counted failed."""
        sessions = self.requests.sessions
        assert sessions is not None, "a workload with sessions"
        planned = self.requests.arrival_s
        delay = start_s - self.now()
        if delay > 0:
            await asyncio.sleep(delay)
        index = first
        while not self.done.is_set():
            await self.send(client, index)
            index = int(sessions.following[index])
            if index < 0:
                return
            if not self.records[int(sessions.previous[index])].ok:
                self._unsent_turns(index)
                return
            wait = float(sessions.think_s[index])
            if planned is not None:
                wait = max(wait, float(planned[index]) - self.now())
            await asyncio.sleep(wait)

    def _unsent_turns(self, index: int) -> None:
        sessions = self.requests.sessions
        assert sessions is not None, "a workload with sessions"
        while index >= 0:
            record = self.records[index]
            record.rank, self.sent = self.sent, self.sent + 1
            record.send = record.finish = self.now()
            record.error = "not sent: an earlier turn of its session failed"
            index = int(sessions.following[index])
        self._check_rejection()

    async def sessions_open(self, client: httpx.AsyncClient, arrival_s: np.ndarray) -> None:
        sessions = self.requests.sessions
        assert sessions is not None, "a workload with sessions"
        await asyncio.gather(
            *(self.session(client, int(f), float(arrival_s[f])) for f in sessions.firsts)
        )

    async def sessions_closed(self, client: httpx.AsyncClient, users: int) -> None:
        sessions = self.requests.sessions
        assert sessions is not None, "a workload with sessions"
        pending = iter(sessions.firsts.tolist())

        async def user() -> None:
            for first in pending:
                if self.done.is_set():
                    return
                await self.session(client, first, 0.0)

        await asyncio.gather(*(user() for _ in range(users)))

    async def closed_loop(self, client: httpx.AsyncClient, concurrency: int) -> None:
        pending = iter(range(len(self.requests)))

        async def user() -> None:
            for i in pending:
                if self.done.is_set():
                    return
                await self.send(client, i)

        await asyncio.gather(*(user() for _ in range(concurrency)))

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
            arrival_s, concurrency = self.requests.arrival_s, self.requests.concurrency
            with_sessions = self.requests.sessions is not None
            if arrival_s is not None:
                drive = (self.sessions_open if with_sessions else self.open_loop)(client, arrival_s)
            elif concurrency is not None:
                closed = self.sessions_closed if with_sessions else self.closed_loop
                drive = closed(client, concurrency)
            else:  # make_requests gives one or the other
                raise ValueError("requests without arrival times need a concurrency")
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
) -> LoadResult:
    """Run the load; the measurement and, when it was stopped early (by `rejection`), why."""
    load = _Load(target, prompts, requests, rejection)
    asyncio.run(load.run(warmup))
    records = load.records
    order = [i for i, record in enumerate(records) if not math.isnan(record.send)]
    if requests.sessions is not None:  # turns go out as answers come, not in index order
        order.sort(key=lambda i: records[i].send)
    sent = [records[i] for i in order]
    if load.rejected:
        for record in sent:  # cancelled in flight: unfinished, not successful
            if record.ok is False and not record.error:
                record.error = "stopped by early rejection"
    planned_inputs = requests.input_tokens[order]
    inputs = np.array(
        [
            record.prompt_tokens if record.prompt_tokens >= 0 else planned
            for record, planned in zip(sent, planned_inputs, strict=True)
        ],
        dtype=np.int64,
    )
    gaps = [gap for record in sent if record.ok for gap in record.gaps]
    measurement = Measurement(
        send_s=np.array([record.send for record in sent]),
        first_token_s=np.array([record.first for record in sent]),
        finish_s=np.array([record.finish if record.ok else math.nan for record in sent]),
        input_tokens=inputs,
        output_tokens=np.array([record.output_tokens for record in sent], dtype=np.int64),
        ok=np.array([record.ok for record in sent], dtype=bool),
        itl_s=np.array(gaps),
        warmup=min(load.warmup_requests, len(sent)),
        burst_mask=None if requests.burst is None else requests.burst[order],
        planned_index=None if requests.sessions is None else np.array(order, dtype=np.int64),
        due_s=requests.due_s(order),
    )
    errors = [record.error for record in sent if record.error]
    measurement.extra["requests_planned"] = len(records)
    measurement.extra["errors"] = len(errors)
    measurement.extra["invisible_first_tokens"] = sum(
        record.first_invisible for record in sent if record.ok
    )
    stalls = [record.error for record in sent if record.stalled]
    measurement.extra["stalled"] = len(stalls)
    if stalls:
        measurement.extra["first_stall"] = stalls[0]
    if errors:
        measurement.extra["first_error"] = errors[0]
    return LoadResult(measurement, load.rejected)
