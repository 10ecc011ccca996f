"""A scenario: the traffic to serve, the SLA to meet and the rule that picks the best config."""

from __future__ import annotations

import math
from importlib import resources
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from objectives import userfile
from objectives.trace import Trace

# A user's reading pace where the SLA bounds no TPOT: the middle of the seed article's
# 30-100 ms/token range for a streamed answer.
DEFAULT_READ_MS_PER_TOKEN = 50.0


class _Strict(BaseModel):
    # strict: a YAML `true` is no number (lax pydantic reads it as 1), nor "5" one
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class Fixed(_Strict):
    kind: Literal["fixed"]
    value: PositiveInt

    @property
    def bounds(self) -> tuple[int, int]:
        return self.value, self.value

    @property
    def typical(self) -> float:
        return float(self.value)


class Uniform(_Strict):
    kind: Literal["uniform"]
    low: PositiveInt
    high: PositiveInt

    @model_validator(mode="after")
    def _ordered(self):
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        return self

    @property
    def bounds(self) -> tuple[int, int]:
        return self.low, self.high

    @property
    def typical(self) -> float:
        return (self.low + self.high) / 2


class _Bounded(_Strict):
    min: PositiveInt
    max: PositiveInt

    @model_validator(mode="after")
    def _ordered(self):
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self

    @property
    def bounds(self) -> tuple[int, int]:
        return self.min, self.max


class Normal(_Bounded):
    kind: Literal["normal"]
    mean: PositiveFloat
    std: Annotated[float, Field(ge=0)]

    @property
    def typical(self) -> float:
        """The mean, within the bounds (the truncation's shift is ignored: sizes, not stats)."""
        return min(max(self.mean, self.min), self.max)


class LogNormal(_Bounded):
    """Parametrised by its median and the sigma of the underlying normal."""

    kind: Literal["lognormal"]
    median: PositiveFloat
    # At 10 the 99th percentile is already 10^10 times the median (min and max truncate it);
    # past about 37, exp(sigma^2 / 2) overflows a float.
    sigma: Annotated[float, Field(ge=0, le=10)]

    @property
    def typical(self) -> float:
        """The mean, within the bounds (the truncation's shift is ignored: sizes, not stats)."""
        return min(max(self.median * math.exp(self.sigma**2 / 2), self.min), self.max)


class Observed(_Bounded):
    """A trace's lengths as read (objectives.trace): a record of them, drawn from nothing."""

    kind: Literal["trace"]
    mean: PositiveFloat

    @property
    def typical(self) -> float:
        return self.mean


LengthDistribution = Annotated[
    Fixed | Uniform | Normal | LogNormal | Observed, Field(discriminator="kind")
]


# One request per 1,000 s: a test at a lower rate lasts days on a real engine, and near 1e-300
# the arrival times' arithmetic under- and overflows (a rate of 5e-324 never ended).
MIN_RATE = 0.001
# req/s: a million is beyond any one deployment's peak (and keeps fleet sizes readable numbers).
MAX_RATE = 1_000_000.0
Rate = Annotated[float, Field(ge=MIN_RATE, le=MAX_RATE)]  # requests per second
# Requests in flight: as many as a test's most requests (num_requests), and a closed loop of
# 10^12 users allocated 72.8 TiB before it failed.
MAX_CONCURRENCY = 1_000_000


class Poisson(_Strict):
    kind: Literal["poisson"]
    rate: Rate


class Gamma(_Strict):
    """Gamma inter-arrival times; burstiness 1 is Poisson, below 1 is burstier (as vLLM's bench)."""

    kind: Literal["gamma"]
    rate: Rate
    burstiness: PositiveFloat


class Closed(_Strict):
    """A fixed number of requests in flight: a new one is sent as soon as one completes."""

    kind: Literal["closed"]
    concurrency: Annotated[int, Field(ge=1, le=MAX_CONCURRENCY)]


class Replay(_Strict):
    """A trace's arrival times (objectives.trace), scaled to offer `rate` requests per second:
    the trace's own rate times its rate multiple."""

    kind: Literal["trace"]
    rate: Rate


Arrival = Annotated[Poisson | Gamma | Closed | Replay, Field(discriminator="kind")]


class SharedPrefix(_Strict):
    """A system prompt: the first `tokens` tokens of a `share` of the requests, each such request
    starting with one of `prompts` distinct texts (drawn uniformly). The prefix counts in the
    prompt's length, so a scenario's token counts stay as they were; a prompt drawn no longer
    than the prefix is lengthened to the prefix plus one token of its own."""

    tokens: PositiveInt
    share: Annotated[float, Field(ge=0, le=1)] = 1.0
    prompts: Annotated[int, Field(ge=1, le=10_000)] = 1


class Sessions(_Strict):
    """Multi-turn conversations: each session has `turns` turns (a distribution); a turn is sent
    when the previous one's answer has arrived and the user has thought for an exponential time
    of mean `think_time_s`; its prompt is the session's whole history (every earlier prompt and
    answer) and `input_tokens` new tokens, so contexts grow. `num_requests` counts turns (the
    last session may be cut short). An open loop's rate stays requests per second: sessions
    start at the rate over the mean turns per session, which by Little's law is the rate turns
    arrive at; a closed loop's concurrency is the sessions in progress (users, each thinking
    or waiting for an answer)."""

    turns: LengthDistribution
    think_time_s: Annotated[float, Field(ge=0, le=3600)] = 5.0
    # How long a user takes over an answer before thinking: the wait for its first token and a
    # pace per token of it (read as it streams). A later turn is planned this long after the
    # previous turn's plan (its answer at this pace, then the think time), and sent then, or
    # a think time after the real answer if that came later: a load offers its rate in full
    # only while the engine answers at this pace (runners.load.sessions). Unset: the
    # scenario's SLA, the answer the service promises (TTFT p99 and TPOT p99 bounds; without
    # a TPOT bound, DEFAULT_READ_MS_PER_TOKEN); a scenario written out (a study's record, the
    # report) states them. A workload outside a scenario, or 0 for both: answers planned as
    # instant, each turn due when it is sent.
    first_token_wait_ms: Annotated[float, Field(ge=0, le=3_600_000)] | None = None
    read_ms_per_token: Annotated[float, Field(ge=0, le=60_000)] | None = None

    @property
    def paces_answers(self) -> bool:
        """Whether a turn's plan counts its previous answer's time (else answers are planned
        as instant, and a turn is due only when it is sent)."""
        return bool(self.first_token_wait_ms or self.read_ms_per_token)

    def answer_s(self, output_tokens: np.ndarray) -> np.ndarray:
        """Per answer of `output_tokens` tokens, the time its user takes over it."""
        wait, pace = self.first_token_wait_ms or 0.0, self.read_ms_per_token or 0.0
        return (wait + pace * np.maximum(output_tokens - 1, 0)) / 1000.0

    def paced_by(self, sla: SLA) -> Sessions:
        """Unset paces taken from the SLA (the field's rule)."""
        wait, pace = self.first_token_wait_ms, self.read_ms_per_token
        if pace is None:
            pace = DEFAULT_READ_MS_PER_TOKEN if sla.tpot_p99_ms is None else sla.tpot_p99_ms
        return self.model_copy(
            update={
                "first_token_wait_ms": sla.ttft_p99_ms if wait is None else wait,
                "read_ms_per_token": pace,
            }
        )


class Burst(_Strict):
    """A burst in an open loop: after the first `after` requests, the next `requests` arrive at
    `multiple` times the arrival rate, then the rate returns (a 32 -> 96 burst is multiple 3).
    Counted in requests, not seconds, so it is the same burst at any rate the load runs at.
    With sessions it counts sessions (new conversations start that much faster) and the burst's
    requests are every turn planned between its first and last session's start."""

    after: Annotated[int, Field(ge=0)]
    requests: Annotated[int, Field(ge=2)]
    multiple: Annotated[float, Field(gt=1, le=1000)]

    def indices(self) -> tuple[int, int]:
        """The first request of the burst and the first one after it."""
        return self.after, self.after + self.requests


class Workload(_Strict):
    arrival: Arrival
    num_requests: Annotated[int, Field(ge=1, le=1_000_000)]
    input_tokens: LengthDistribution
    output_tokens: LengthDistribution
    seed: Annotated[int, Field(ge=0)] = 0  # numpy's generators take no negative seed
    # Unset: every prompt is text of its own (no engine serves any of it from a prefix cache).
    shared_prefix: SharedPrefix | None = None
    # Unset: every request is a conversation of one turn.
    sessions: Sessions | None = None
    burst: Burst | None = None
    # Set: the requests are a trace's (objectives.trace); arrival, num_requests and the
    # lengths are read from it (the window's count, its rate times the multiple, its lengths).
    trace: Trace | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_trace(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict) or data.get("trace") is None:
            return data
        from objectives.trace_formats import workload_from_trace

        return workload_from_trace(data, info.context)

    @model_validator(mode="after")
    def _burst_fits(self):
        burst = self.burst
        if burst is None:
            return self
        if isinstance(self.arrival, Closed):
            raise ValueError(
                "burst needs an open loop (arrival kind poisson or gamma): a closed loop's "
                "arrivals follow its completions"
            )
        end = burst.indices()[1]
        if self.sessions is not None:
            fewest = -(-self.num_requests // self.sessions.turns.bounds[1])
            if end >= fewest:
                raise ValueError(
                    f"burst (after {burst.after} + {burst.requests} sessions = {end}) must end "
                    f"before the test's last session (at least {fewest}: num_requests "
                    f"{self.num_requests} over at most {self.sessions.turns.bounds[1]} turns "
                    "each), so that its recovery is measured"
                )
            return self
        if end >= self.num_requests:
            raise ValueError(
                f"burst (after {burst.after} + {burst.requests} requests = {end}) must end "
                f"before the test's last request (num_requests {self.num_requests}), so that "
                "its recovery is measured"
            )
        return self

    @model_validator(mode="after")
    def _prefix_fits(self):
        prefix = self.shared_prefix
        longest_first = self.input_tokens.bounds[1]
        if prefix is not None and prefix.tokens >= longest_first:
            raise ValueError(
                f"shared_prefix.tokens ({prefix.tokens}) must be below the longest prompt "
                f"({longest_first} tokens, input_tokens' max): the prefix is the start "
                "of a prompt"
            )
        return self

    @property
    def trace_shares_prompts(self) -> bool:
        """A trace that names prompt blocks or conversations (a prefix cache can hit)."""
        if self.trace is None:
            return False
        from objectives.trace_formats import read_window

        return read_window(self.trace).shares_prompts

    def multiple_of(self, rate: float | None) -> float | None:
        """A trace's replay at `rate` req/s: how many times the trace's own rate that is
        (None: no trace, or no rate)."""
        if self.trace is None or rate is None:
            return None
        from objectives.trace_formats import read_window

        return rate / read_window(self.trace).rate

    @property
    def longest_prompt(self) -> int:
        """A session's last turn carries every earlier turn's prompt and answer."""
        return self.longest_request - self.output_tokens.bounds[1]

    @property
    def longest_request(self) -> int:
        turns = 1 if self.sessions is None else self.sessions.turns.bounds[1]
        return turns * (self.input_tokens.bounds[1] + self.output_tokens.bounds[1])

    @property
    def session_span_s(self) -> float:
        """How long a typical conversation lasts: its turns' answers at its users' pace and the
        thinking between them (0 without sessions)."""
        sessions = self.sessions
        if sessions is None:
            return 0.0
        turns = sessions.turns.typical
        answer = float(sessions.answer_s(np.array([round(self.output_tokens.typical)]))[0])
        return turns * answer + (turns - 1) * sessions.think_time_s

    @property
    def typical_request(self) -> float:
        """Tokens a typical request holds in the KV cache once it has generated its output (a
        session's turns hold on average (turns + 1) / 2 turns' worth)."""
        turns = 1.0 if self.sessions is None else (self.sessions.turns.typical + 1) / 2
        return turns * (self.input_tokens.typical + self.output_tokens.typical)


class SLA(_Strict):
    ttft_p99_ms: PositiveFloat
    tpot_p99_ms: PositiveFloat | None = None
    # Unset: every request must succeed (a failed request under load is a miss, not noise).
    min_success_rate: Annotated[float, Field(gt=0, le=1)] | None = None
    # TTFT p99 of the requests a workload's burst sends (unset: the burst is only recorded)
    burst_ttft_p99_ms: PositiveFloat | None = None

    @property
    def required_success_rate(self) -> float:
        return 1.0 if self.min_success_rate is None else self.min_success_rate

    def describe(self) -> str:
        """The bounds as a title states them: "TTFT p99 <= 500 ms, TPOT p99 <= 100 ms"."""
        bounds = [f"TTFT p99 <= {self.ttft_p99_ms:g} ms"]
        if self.tpot_p99_ms is not None:
            bounds.append(f"TPOT p99 <= {self.tpot_p99_ms:g} ms")
        if self.min_success_rate is not None:
            bounds.append(f"success >= {self.min_success_rate:.3g}")
        if self.burst_ttft_p99_ms is not None:
            bounds.append(f"burst TTFT p99 <= {self.burst_ttft_p99_ms:g} ms")
        return ", ".join(bounds)


class QualitySLO(_Strict):
    """How far a config may fall below the model's reference (bf16 weights, KV compression off).
    Every field is optional; each one set is a constraint beside the SLA (objectives.quality)."""

    # benchmark points below the reference
    max_accuracy_drop: Annotated[float, Field(ge=0)] | None = None
    # share of positions with the reference's top token
    min_top1_agreement: Annotated[float, Field(gt=0, le=1)] | None = None
    # mean KL divergence from the reference's next-token distribution (nats)
    max_kl: PositiveFloat | None = None
    # all: every bound set applies, and a run that cannot supply one of its figures is refused
    # (a scenario of your own). supplied: one SLO stated in several forms (the presets': points
    # for a quality table, KL and top-1 for a runner that measures them); each form applies
    # where the run's sources supply its figure, and at least one must.
    apply: Literal["all", "supplied"] = "all"

    @model_validator(mode="after")
    def _forms_to_apply(self):
        if self.apply == "supplied" and not self.bounds():
            raise ValueError(
                "apply: supplied needs a bound to apply: max_accuracy_drop, max_kl or "
                "min_top1_agreement"
            )
        return self

    def bounds(self) -> dict[str, float]:
        """The figure each set field bounds (objectives.quality.FIGURES) and its limit."""
        limits = {figure: getattr(self, field) for figure, field in QUALITY_SLO_FIELDS.items()}
        return {figure: limit for figure, limit in limits.items() if limit is not None}

    def only(self, figures: list[str]) -> QualitySLO:
        """The bounds on these figures, applied in full (what a run of a `supplied` SLO keeps)."""
        kept = {QUALITY_SLO_FIELDS[f]: limit for f, limit in self.bounds().items() if f in figures}
        return QualitySLO.model_validate(kept)

    def describe(self) -> str:
        bounds = ", ".join(
            f"{QUALITY_SLO_FIELDS[figure]} {limit:g}" for figure, limit in self.bounds().items()
        )
        return bounds + (" (each where supplied)" if self.apply == "supplied" else "")


# Each quality figure and the SLO field that bounds it (top-1 agreement from below, the others
# from above).
QUALITY_SLO_FIELDS = {
    "accuracy_drop": "max_accuracy_drop",
    "kl": "max_kl",
    "top1_agreement": "min_top1_agreement",
}


# The capacity search's default floor is the nominal rate over this: low enough that the
# configs users run today (the seed article's batch 8-16 serve 1/2-1/5 of customer-service's
# nominal rate) get a capacity, four halvings that stop early on a miss.
MIN_RATE_DIVISOR = 16


class Load(_Strict):
    """How a trial loads the engine.

    capacity: search the highest arrival rate (closed loop: concurrency) at which every SLO
    holds, from the scenario's nominal rate (its `rate` or `concurrency`, the traffic of a
    normal day) up to `max_rate`, bisecting to `precision`; below the nominal rate down to
    `min_rate` (default 1/16 of the nominal rate, so a config too slow for the nominal traffic
    still gets its capacity, shown beside its SLA miss). fixed: the nominal rate only;
    throughput is then what that rate delivers. The nominal load always runs whole (its TTFT
    p99 is an objective); the search's other steps stop as soon as the SLA is certainly missed,
    unless `early_rejection` is false.
    """

    mode: Literal["capacity", "fixed"] = "capacity"
    precision: Annotated[float, Field(gt=0, le=0.5)] = 0.05  # relative width of the final bracket
    min_rate: Rate | None = None  # default: nominal / MIN_RATE_DIVISOR
    max_rate: Rate | None = None  # default: 64 x the nominal rate
    max_trial_s: PositiveFloat | None = None  # stop a trial's search after this long (real engines)
    # req/s at peak: the front and export size the fleet
    peak_rate: Rate | None = None
    early_rejection: bool = True


class Scenario(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    workload: Workload
    sla: SLA
    # The two objectives are fixed by the product: minimise TTFT p99, maximise output tokens/s.
    # `pick` says which end of the SLA-feasible front is "best".
    pick: Literal["max-throughput", "min-ttft"] = "max-throughput"
    # Values within this relative distance count as a tie (open-loop load caps throughput at the
    # offered rate, so many configs tie on it and the second objective should decide).
    tie_tolerance: Annotated[float, Field(ge=0, le=0.5)] = 0.01
    load: Load = Load()
    # what the configs may cost in accuracy (absent or `none`: not constrained)
    quality: QualitySLO | None = None

    @field_validator("quality", mode="before")
    @classmethod
    def _none_means_unconstrained(cls, value: Any) -> Any:
        # `quality: none` says so in words where a preset's copy drops its quality SLO
        return None if value == "none" else value

    @model_validator(mode="before")
    @classmethod
    def _sessions_paced_by_the_sla(cls, data: Any, info: ValidationInfo) -> Any:
        # before: the models are frozen once built (Sessions' pace fields)
        if not isinstance(data, dict) or not isinstance(data.get("workload"), dict):
            return data
        if data["workload"].get("sessions") is None:
            return data  # (and a trace is not read twice)
        try:
            workload = Workload.model_validate(data["workload"], context=info.context)
            sla = SLA.model_validate(data["sla"])
        except (KeyError, ValueError):
            return data  # the fields' own validation says what is wrong
        if workload.sessions is None:
            return data
        paced = workload.model_copy(update={"sessions": workload.sessions.paced_by(sla)})
        return {**data, "workload": paced}

    @model_validator(mode="after")
    def _burst_in_a_fixed_load(self):
        if self.workload.burst is not None and self.load.mode != "fixed":
            raise ValueError(
                "workload.burst needs load.mode fixed: a capacity search scales the load and "
                "judges each window steady, which a burst is not"
            )
        if self.sla.burst_ttft_p99_ms is not None and self.workload.burst is None:
            raise ValueError("sla.burst_ttft_p99_ms bounds a burst: set workload.burst")
        return self

    @model_validator(mode="after")
    def _tpot_observable(self):
        # TPOT is the time between a request's tokens: with one-token answers none has any,
        # and a bound on a figure never observed can never be shown met.
        longest = self.workload.output_tokens.bounds[1]
        if self.sla.tpot_p99_ms is not None and longest < 2:
            raise ValueError(
                f"sla.tpot_p99_ms bounds the time between output tokens, but every answer is "
                f"{longest} token (workload.output_tokens): drop the bound or allow 2 or more"
            )
        return self

    @model_validator(mode="after")
    def _rate_bounds_bracket(self):
        nominal = self.nominal_rate
        low, high = self.rate_bounds
        if low > nominal:
            raise ValueError(
                f"load.min_rate ({low:g}) is above the nominal rate ({nominal:g}); "
                "it must not exceed it"
            )
        if high < nominal:
            raise ValueError(
                f"load.max_rate ({high:g}) is below the nominal rate ({nominal:g}); "
                "it must be at least that"
            )
        if self.closed_loop:
            for field, value in (
                ("min_rate", self.load.min_rate),
                ("max_rate", self.load.max_rate),
            ):
                if value is not None and value != int(value):
                    raise ValueError(
                        f"load.{field} ({value:g}) must be a whole number: a closed loop's "
                        "rate is the number of requests in flight"
                    )
        if self.load.mode == "capacity" and high <= low:
            raise ValueError(
                f"load.max_rate ({high:g}) must be above load.min_rate ({low:g}) "
                "for a capacity search"
            )
        return self

    @property
    def closed_loop(self) -> bool:
        return isinstance(self.workload.arrival, Closed)

    @property
    def nominal_rate(self) -> float:
        """The traffic of a normal day: requests per second, or requests in flight (closed loop)."""
        arrival = self.workload.arrival
        return float(arrival.concurrency if isinstance(arrival, Closed) else arrival.rate)

    @property
    def rate_bounds(self) -> tuple[float, float]:
        nominal = self.nominal_rate
        high = self.load.max_rate
        if high is None:  # a closed loop's window grows with it (runners.load.capacity)
            high = nominal * 64
        low = self.load.min_rate
        if low is None:  # a closed loop keeps at least one request in flight
            low = (
                max(1.0, nominal // MIN_RATE_DIVISOR)
                if self.closed_loop
                else nominal / MIN_RATE_DIVISOR
            )
        return low, high

    def at_rate(self, rate: float, seed_offset: int = 0) -> Workload:
        """The workload at another rate (concurrency) with fresh requests for `seed_offset` > 0."""
        arrival = self.workload.arrival
        if isinstance(arrival, Closed):
            arrival = arrival.model_copy(update={"concurrency": max(1, round(rate))})
        else:
            arrival = arrival.model_copy(update={"rate": float(rate)})
        return self.workload.model_copy(
            update={"arrival": arrival, "seed": self.workload.seed + seed_offset}
        )


PRESETS = resources.files("objectives") / "presets"


def preset_names() -> list[str]:
    return userfile.preset_names(PRESETS)


def load_scenario(name_or_path: str) -> Scenario:
    """A preset name (see `autotune scenarios`) or the path of a user's YAML file."""
    return userfile.load_preset_or_file(
        PRESETS, name_or_path, Scenario, "--scenario: unknown scenario"
    )
