"""Measurement: the one currency between runners and everything downstream.

Metric definitions, stated once (as in vLLM's `benchmarks/serve.py`):
- TTFT: from sending a request to its first output token.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), for requests with more than one output token.
- ITL: the gaps between consecutive streamed chunks that carry text (real engines only).
- E2EL: from sending a request to its last output token.
- duration: from the first request sent to the last request finished.
- output throughput: output tokens of successful requests / duration; total adds input tokens.
- goodput (DistServe): successful requests that meet every SLO of the scenario / duration.
- success rate: successful requests / requests sent.
- offered rate: (requests sent - 1) / (last send - first send), what the load really sent (a
  session load whose turns fell behind their plan sent less than it planned; the delivered
  share below compares with the planned rate).
- warm-up: the first tenth of a load's requests (send order; `warmup_requests`) meet an empty
  engine, which flatters them (customer-service near capacity: the first 50 of 1,000 wait half
  as long as the rest). They are served and count in throughput, goodput and the success
  rate, but not in the latency percentiles (TTFT, TPOT, E2EL; ITL gaps are not kept per
  request and cover every request) nor in early rejection's count of late requests.
- delivered rate: the offered rate less the backlog's growth rate over the second half of the
  measured window (from the first request after the warm-up to the last one sent), both over
  the successful requests (a failed one leaves the backlog; the success rate judges it): the
  backlog is the requests due and not yet finished, taken when each is due, its growth rate
  their least-squares slope. A request is due when it is sent, except an open loop's session
  turn, due at its planned time (runners.load.sessions): one that waits for a late answer is
  backlog, and the offered rate is the planned one. The first half is left out because an
  engine that starts empty fills up to its steady backlog (rate x latency) before it delivers
  what it is offered.
  `delivered_share` is the delivered over the offered rate of that half: 1 when the engine
  keeps up, below when its queue or running batch is still growing (runners.load.capacity requires
  it within objectives.scoring.sustain_tolerance of 1); None when the half holds fewer than
  DELIVERED_MIN_SAMPLES sends.
- TTFT trend: the Spearman rank correlation between the order of eight consecutive slices of
  the measured successful requests and their median TTFT (0 when the medians lie within 1% of
  each other); near 1 when the queue is still growing when the load ends (runners.load.capacity
  decides what that means for a verdict).
- idle TTFT trend: the same over the measured successful requests that were sent when no
  request was in flight (sent and not yet finished): their TTFT is the engine's own time to a
  first token, with no queue in it, so near 1 means the engine itself is slowing down (a cache
  or a log growing with every request), not its queue growing; None when fewer than eighty
  requests found the engine idle (a loaded engine rarely is). `idle_ttft_rise`: their median
  TTFT over the last quarter of them against the first quarter's.
- per chip: throughputs, goodput and the offered rate are divided by the chips that served
  the requests (`Measurement.chips`: a co-located replica's measurement is one chip's; a
  disaggregated deployment's is one decode instance's requests, on its share of the prefill
  and decode chips: all of them over the decode instances), so deployments of
  different sizes compare (DistServe's per-GPU goodput).
- burst (a workload's `burst`, requests `after`..`after + requests - 1`; with sessions, the
  requests planned from its first session's start to its last's): burst TTFT p99 over
  all its requests, a failed one counting as the latest (the burst is judged whole, wherever
  the warm-up ends; None when the p99 reads a failed one), the burst's failed requests, and the
  recovery: from the burst's last send to the send of the first later request that met the
  TTFT bound and of which, with the RECOVERY_WINDOW (100) requests from it on (fewer where the
  test ends), at most 1% failed or missed it; 0 when none after the burst missed it; None
  (`burst_recovered` false) when no such request came before the test ended: the queue the
  burst left never drained, an avalanche. The steady TTFT percentiles leave the burst's
  requests out (the burst has its own bound); TPOT, E2EL and throughput keep them.
Percentiles use numpy's linear interpolation over successful requests and always carry the
number of samples they stand on; a p99 from fewer than 100 samples is flagged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from objectives.scenario import SLA, Burst

P99_MIN_SAMPLES = 100
WARMUP_SHARE = 0.1
TREND_SLICES = 8  # fewer slices than this many samples each give no trend
TREND_MIN_PER_SLICE = 10
TREND_FLAT = 0.01  # slice medians this close (relative to their mean) have no trend
DELIVERED_MIN_SAMPLES = 20


def warmup_requests(planned: int) -> int:
    """How many of a load's `planned` requests, the first ones sent, are its warm-up."""
    return int(WARMUP_SHARE * planned)


def p99_breaking_count(planned: int) -> int:
    """Fewest samples above a bound that put numpy's (linear) p99 of `planned` samples above it."""
    return planned - math.floor(0.99 * (planned - 1))


def load_certainly_fails(
    planned: int,
    late_ok: int,
    late_in_flight: int,
    failed: int,
    min_success_rate: float,
    warmup: int = 0,
    warmup_failed: int = 0,
) -> bool:
    """Whether a load of `planned` requests misses its SLA whatever its unfinished requests do.

    The TTFT p99 covers successful requests after the `warmup` first ones, and the success rate
    counts every failure, so a late request still in flight may end either way: late (a p99
    sample above the bound) or failed (one sample fewer, one failure more). The load certainly
    fails only if every split of those breaks one of the two; requests not yet answered in time
    may all still succeed. late_ok, late_in_flight and failed count requests after the warm-up;
    warmup_failed the warm-up's failures.
    """
    allowed_failures = math.floor((1.0 - min_success_rate) * planned + 1e-9)
    for failing in range(late_in_flight + 1):
        failures = failed + failing
        if failures + warmup_failed > allowed_failures:
            continue  # this future breaks the success rate
        successes_at_most = planned - warmup - failures
        if successes_at_most <= 0 or late_ok + late_in_flight - failing < p99_breaking_count(
            successes_at_most
        ):
            return False  # a future where both SLOs may still hold
    return True


@dataclass(frozen=True)
class Fault:
    """Why a trial produced no trustworthy measurement."""

    kind: str  # "infeasible", "start", "crash", "timeout", "error", "sla-violated"
    message: str
    log_tail: str = ""


@dataclass
class Measurement:
    """Per-request records (seconds from load start; NaN where a request never got there)."""

    send_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    ok: np.ndarray
    peak_kv_usage: float | None = None
    itl_s: np.ndarray | None = None  # every inter-chunk gap of successful requests
    fault: Fault | None = None
    warmup: int = 0  # the first requests sent, left out of the percentiles (warmup_requests)
    # The chips that served these requests (a share of a deployment's: a float): throughputs
    # and rates are per chip.
    chips: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)
    # Per request, whether the workload's burst sent it, where its indices do not say (sessions)
    burst_mask: np.ndarray | None = None
    # Per record, the planned request it measures, where records are not in planned order
    # (sessions: sorted by send time)
    planned_index: np.ndarray | None = None
    # Per record, when it was due, where a runner may send it later (Requests.due_s: an open
    # loop's session turns); None: when it was sent
    due_s: np.ndarray | None = None

    @classmethod
    def failed(cls, fault: Fault, extra: dict[str, Any] | None = None) -> Measurement:
        empty = np.empty(0)
        return cls(
            empty,
            empty,
            empty,
            empty.astype(int),
            empty.astype(int),
            empty.astype(bool),
            fault=fault,
            extra=extra or {},
        )

    @property
    def sent(self) -> int:
        return int(self.send_s.size)


def first_part(m: Measurement, records: int) -> Measurement:
    """Its first `records` records (sent first): what a shorter horizon of the same load reads
    (the inter-chunk gaps, pooled over requests, are left out). That horizon warms up on its own
    first tenth, as a load of `records` requests would: keeping the whole load's warm-up left a
    closed loop's start-up queue out of the part, which a load that short then failed on."""
    part = slice(0, records)

    def cut(values: np.ndarray | None) -> np.ndarray | None:
        return None if values is None else values[part]

    return replace(
        m,
        send_s=m.send_s[part],
        first_token_s=m.first_token_s[part],
        finish_s=m.finish_s[part],
        input_tokens=m.input_tokens[part],
        output_tokens=m.output_tokens[part],
        ok=m.ok[part],
        itl_s=None,
        warmup=min(m.warmup, warmup_requests(records)),
        burst_mask=cut(m.burst_mask),
        planned_index=cut(m.planned_index),
        due_s=cut(m.due_s),
    )


def _percentiles(name: str, samples: np.ndarray, qs: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {f"{name}_samples": int(samples.size)}
    for q in qs:
        out[f"{name}_p{q}_ms"] = float(np.percentile(samples, q) * 1000) if samples.size else None
    return out


def ttft_trend(ttft: np.ndarray) -> float | None:
    """Spearman's rank correlation of TREND_SLICES consecutive slices' median TTFT with their
    order: tied medians share their mean rank; medians within TREND_FLAT of each other (a
    constant TTFT's rounding, say) have none; None when a slice would hold fewer than
    TREND_MIN_PER_SLICE samples."""
    if ttft.size < TREND_SLICES * TREND_MIN_PER_SLICE:
        return None
    medians = np.array([np.median(part) for part in np.array_split(ttft, TREND_SLICES)])
    if np.ptp(medians) <= TREND_FLAT * abs(np.mean(medians)):
        return 0.0
    ranks = np.array([np.sum(medians < x) + (np.sum(medians == x) - 1) / 2 for x in medians])
    return float(np.corrcoef(ranks, np.arange(TREND_SLICES))[0, 1])


def in_flight_at_send(m: Measurement) -> np.ndarray:
    """Per request, how many successful requests sent before it were still unfinished when it
    was sent (a failed request's end is not recorded: it counts for none)."""
    ok = m.ok.astype(bool)
    sent_before = np.searchsorted(np.sort(m.send_s[ok]), m.send_s, side="left")
    finished_by = np.searchsorted(np.sort(m.finish_s[ok]), m.send_s, side="right")
    return np.maximum(sent_before - finished_by, 0)


def delivered(m: Measurement) -> tuple[float, float] | None:
    """(offered, delivered) requests/s over the second half of the measured window, per chip;
    None when that half is too short to tell (the module's definition)."""
    if m.sent <= m.warmup:
        return None
    due = m.send_s if m.due_s is None else m.due_s
    ranked = np.sort(due)
    start, end = float(ranked[m.warmup]), float(ranked[-1])
    ok = m.ok.astype(bool)
    ok_due = np.sort(due[ok])  # a failed request leaves the backlog: the success rate's business
    half = np.nonzero(ok_due >= (start + end) / 2)[0]
    times = ok_due[half]
    if half.size < DELIVERED_MIN_SAMPLES or times[-1] <= times[0]:
        return None
    finished = np.sort(m.finish_s[ok])
    backlog = half + 1 - np.searchsorted(finished, times, side="right")
    growth = float(np.polyfit(times, backlog, 1)[0])
    offered = (half.size - 1) / float(times[-1] - times[0])
    return offered / m.chips, (offered - growth) / m.chips


# A recovery holds for the next RECOVERY_WINDOW requests (fewer where the test ends first) with
# at most 1% of them late: the p99's allowance, over as many requests as a p99 needs.
RECOVERY_WINDOW = P99_MIN_SAMPLES
RECOVERED_LATE_SHARE = 0.01


def in_burst(m: Measurement, burst: Burst | None) -> np.ndarray:
    """Per request sent, whether the burst sent it."""
    if burst is not None and m.burst_mask is not None:
        return m.burst_mask.astype(bool)
    mask = np.zeros(m.sent, bool)
    if burst is not None:
        first, end = burst.indices()
        mask[first:end] = True
    return mask


def burst_metrics(m: Measurement, sla: SLA, burst: Burst) -> dict[str, Any]:
    """The burst's TTFT p99, failures and recovery (the module's definitions)."""
    mask = in_burst(m, burst)
    inside_at = np.flatnonzero(mask)
    end = int(inside_at[-1]) + 1 if inside_at.size else min(burst.indices()[1], m.sent)
    # A failed request never got its first token: it counts as the latest of all.
    ttft = m.first_token_s - m.send_s
    ttft = np.where(m.ok.astype(bool) & ~np.isnan(ttft), ttft, np.inf)
    inside = ttft[mask]
    ranked = np.sort(inside)
    # numpy's linear p99 reads the two samples about it: a failed one among them leaves none.
    at = 0.99 * (ranked.size - 1)
    p99 = None
    if ranked.size and math.isfinite(ranked[math.ceil(at)]):
        p99 = float(np.percentile(ranked, 99)) * 1000
    metrics: dict[str, Any] = {
        "burst_ttft_samples": int(inside.size),
        "burst_ttft_p99_ms": p99,
        "burst_failed": int(np.isinf(inside).sum()),
    }
    after = ttft[end:]
    late = after * 1000 > sla.ttft_p99_ms
    recovery: float | None = None
    for i in np.flatnonzero(~late):
        window = late[i : i + RECOVERY_WINDOW]
        if window.mean() <= RECOVERED_LATE_SHARE:
            # None late before it: the bound held straight after the burst.
            recovery = 0.0 if not late[:i].any() else float(m.send_s[end + i] - m.send_s[end - 1])
            break
    metrics["burst_recovery_s"] = recovery
    metrics["burst_recovered"] = recovery is not None
    return metrics


def summarize(m: Measurement, sla: SLA, burst: Burst | None = None) -> dict[str, Any]:
    """Every metric of a measurement, flat, ready to store as trial user attributes."""
    ok = m.ok.astype(bool)
    # The percentiles' samples: successful requests after the warm-up.
    measured = ok & (np.arange(m.sent) >= m.warmup)
    ttft_all = m.first_token_s - m.send_s
    e2el_all = m.finish_s - m.send_s
    ttft = ttft_all[measured]
    e2el = e2el_all[measured]
    multi = m.output_tokens[measured] > 1
    tpot = (e2el[multi] - ttft[multi]) / (m.output_tokens[measured][multi] - 1)
    out_tokens = m.output_tokens[ok]
    finished = m.finish_s[ok]
    duration = float(finished.max() - m.send_s.min()) if finished.size else 0.0
    per_s = (lambda x: float(x) / duration / m.chips) if duration > 0 else (lambda x: 0.0)
    send_span = float(m.send_s.max() - m.send_s.min()) if m.sent > 1 else 0.0

    meets = ttft_all[ok] * 1000 <= sla.ttft_p99_ms
    if sla.tpot_p99_ms is not None:
        gaps = (e2el_all[ok] - ttft_all[ok]) / np.maximum(out_tokens - 1, 1)
        meets &= np.where(out_tokens > 1, gaps, 0.0) * 1000 <= sla.tpot_p99_ms

    metrics: dict[str, Any] = {
        "requests_sent": m.sent,
        "warmup_requests": m.warmup,
        "requests_ok": int(ok.sum()),
        "success_rate": float(ok.sum() / m.sent) if m.sent else 0.0,
        "duration_s": duration,
        "output_tokens_per_s": per_s(out_tokens.sum()),
        "total_tokens_per_s": per_s(out_tokens.sum() + m.input_tokens[ok].sum()),
        "requests_per_s": per_s(ok.sum()),
        "goodput_rps": per_s(meets.sum()),
        "offered_rps": float((m.sent - 1) / send_span / m.chips) if send_span > 0 else None,
        "peak_kv_usage": m.peak_kv_usage,
    }
    rates = delivered(m)
    metrics["delivered_rps"] = None if rates is None else rates[1]
    metrics["delivered_share"] = None if rates is None else rates[1] / rates[0]
    # What the engine served: over the load's steady part where it is judged (ramp and drain
    # left out: at capacity a 1,000-request window's drain alone reads 15% below the rate),
    # else over the whole window.
    metrics["served_rps"] = metrics["requests_per_s"] if rates is None else rates[1]
    steady_ttft = ttft_all[measured & ~in_burst(m, burst)]  # the burst has its own bound
    metrics |= _percentiles("ttft", steady_ttft, (50, 90, 99))
    metrics |= _percentiles("tpot", tpot, (50, 99))
    metrics |= _percentiles("e2el", e2el, (50, 99))
    if m.itl_s is not None:
        metrics |= _percentiles("itl", m.itl_s, (50, 99))
    metrics["p99_low_samples"] = int(steady_ttft.size) < P99_MIN_SAMPLES
    metrics["ttft_trend"] = ttft_trend(steady_ttft)
    idle_ttft = ttft_all[measured & (in_flight_at_send(m) == 0)]
    metrics["idle_ttft_trend"] = ttft_trend(idle_ttft)
    quarter = idle_ttft.size // 4
    metrics["idle_ttft_rise"] = (
        float(np.median(idle_ttft[-quarter:]) / np.median(idle_ttft[:quarter]))
        if metrics["idle_ttft_trend"] is not None and np.median(idle_ttft[:quarter]) > 0
        else None
    )
    if burst is not None:
        metrics |= burst_metrics(m, sla, burst)
    return metrics
