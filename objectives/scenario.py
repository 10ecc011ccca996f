"""A scenario: the traffic to serve, the SLA to meet and the rule that picks the best config."""

from __future__ import annotations

from importlib import resources
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from objectives import userfile


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Fixed(_Strict):
    kind: Literal["fixed"]
    value: PositiveInt

    @property
    def bounds(self) -> tuple[int, int]:
        return self.value, self.value


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


class LogNormal(_Bounded):
    """Parametrised by its median and the sigma of the underlying normal."""

    kind: Literal["lognormal"]
    median: PositiveFloat
    sigma: Annotated[float, Field(ge=0)]


LengthDistribution = Annotated[
    Union[Fixed, Uniform, Normal, LogNormal], Field(discriminator="kind")
]


class Poisson(_Strict):
    kind: Literal["poisson"]
    rate: PositiveFloat  # requests per second


class Gamma(_Strict):
    """Gamma inter-arrival times; burstiness 1 is Poisson, below 1 is burstier (as vLLM's bench)."""

    kind: Literal["gamma"]
    rate: PositiveFloat
    burstiness: PositiveFloat


class Closed(_Strict):
    """A fixed number of requests in flight: a new one is sent as soon as one completes."""

    kind: Literal["closed"]
    concurrency: PositiveInt


Arrival = Annotated[Union[Poisson, Gamma, Closed], Field(discriminator="kind")]


class Workload(_Strict):
    arrival: Arrival
    num_requests: Annotated[int, Field(ge=1, le=1_000_000)]
    input_tokens: LengthDistribution
    output_tokens: LengthDistribution
    seed: int = 0

    @property
    def longest_prompt(self) -> int:
        return self.input_tokens.bounds[1]

    @property
    def longest_request(self) -> int:
        return self.input_tokens.bounds[1] + self.output_tokens.bounds[1]


class SLA(_Strict):
    ttft_p99_ms: PositiveFloat
    tpot_p99_ms: PositiveFloat | None = None
    min_success_rate: Annotated[float, Field(gt=0, le=1)] | None = None


class Load(_Strict):
    """How a trial loads the engine.

    capacity: search the highest arrival rate (closed loop: concurrency) at which every SLO
    holds, from the scenario's nominal rate (its `rate` or `concurrency`, the traffic of a
    normal day) up to `max_rate`, bisecting to `precision`; below the nominal rate only down
    to `min_rate`. fixed: the nominal rate only; throughput is then what that rate delivers.
    """

    mode: Literal["capacity", "fixed"] = "capacity"
    precision: Annotated[float, Field(gt=0, le=0.5)] = 0.05  # relative width of the final bracket
    min_rate: PositiveFloat | None = None  # default: the nominal rate
    max_rate: PositiveFloat | None = None  # default: 64 x the nominal rate
    max_trial_s: PositiveFloat | None = None  # stop a trial's search after this long (real engines)
    peak_rate: PositiveFloat | None = None  # req/s at peak: the front and export size the fleet


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

    @model_validator(mode="after")
    def _rate_bounds_bracket(self):
        nominal = self.nominal_rate
        low, high = self.rate_bounds
        if low > nominal:
            raise ValueError(f"load.min_rate ({low:g}) is above the nominal rate ({nominal:g}); it must not exceed it")
        if high < nominal:
            raise ValueError(f"load.max_rate ({high:g}) is below the nominal rate ({nominal:g}); it must be at least that")
        if self.load.mode == "capacity" and high <= low:
            raise ValueError(f"load.max_rate ({high:g}) must be above load.min_rate ({low:g}) for a capacity search")
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
        if high is None:  # a closed loop cannot have more in flight than it has requests
            high = max(nominal, min(nominal * 64, self.workload.num_requests)) if self.closed_loop else nominal * 64
        return self.load.min_rate or nominal, high

    def at_rate(self, rate: float, seed_offset: int = 0) -> Workload:
        """The workload at another rate (concurrency) with fresh requests for `seed_offset` > 0."""
        arrival = self.workload.arrival
        if isinstance(arrival, Closed):
            arrival = arrival.model_copy(update={"concurrency": max(1, round(rate))})
        else:
            arrival = arrival.model_copy(update={"rate": float(rate)})
        return self.workload.model_copy(update={"arrival": arrival, "seed": self.workload.seed + seed_offset})


PRESETS = resources.files("objectives") / "presets"


def preset_names() -> list[str]:
    return userfile.preset_names(PRESETS)


def load_scenario(name_or_path: str) -> Scenario:
    """A preset name (see `autotune scenarios`) or the path of a user's YAML file."""
    return userfile.load_preset_or_file(PRESETS, name_or_path, Scenario, "--scenario: unknown scenario")
