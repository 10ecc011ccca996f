"""A scenario: the traffic to serve, the SLA to meet and the rule that picks the best config."""

from __future__ import annotations

from importlib import resources
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from tuner import userfile


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


PRESETS = resources.files("objectives") / "presets"


def preset_names() -> list[str]:
    return userfile.preset_names(PRESETS)


def load_scenario(name_or_path: str) -> Scenario:
    """A preset name (see `autotune scenarios`) or the path of a user's YAML file."""
    return userfile.load_preset_or_file(PRESETS, name_or_path, Scenario, "--scenario: unknown scenario")
