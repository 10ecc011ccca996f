"""A workload replayed from a request trace: which file, in which format, which window of it,
at what multiple of its rate, and what to do with requests longer than the model's context.

The trace's own rows are read by objectives.trace_formats; this module states what a scenario
may say about them (`workload.trace`) and what the window holds once read (TraceWindow).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    ValidationInfo,
    field_validator,
    model_validator,
)

# The formats whose columns are known: the Azure/Splitwise CSV, Mooncake's JSONL (prompt
# blocks as hash_ids), BurstGPT's CSV; `csv` and `jsonl` name their columns (`columns`).
FORMATS = ("azure", "mooncake", "burstgpt", "csv", "jsonl")
# Mooncake's hash_ids each stand for 512 prompt tokens (its FAST'25 traces).
MOONCAKE_BLOCK_TOKENS = 512


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class TraceColumns(_Strict):
    """Where a service's own log keeps each field: a CSV header's name or a JSONL key."""

    arrival: str  # seconds (time_unit), or an ISO 8601 date and time
    input_tokens: str
    output_tokens: str
    session: str | None = None  # requests of one conversation, in order
    blocks: str | None = None  # JSONL: a list of prompt block ids (Mooncake's hash_ids)


class Trace(_Strict):
    """A trace's window, replayed: its requests' arrival times (scaled by `rate_multiple`: 2
    sends them twice as fast), their prompt and output lengths, and where the trace names
    prompt blocks, prompts that share blocks share that text. The window starts `start_s`
    seconds after the trace's first request and lasts `duration_s`, or `requests` requests
    (neither: to the trace's end).

    A request whose prompt and output exceed the model's context is refused (`over_context:
    refuse`, with the count and the longest); `clip` shortens its prompt to fit, `drop` leaves
    it out; the count is stated (`over_context_requests`) where the tuner applied the policy.
    """

    file: str
    format: Literal["azure", "mooncake", "burstgpt", "csv", "jsonl"]
    columns: TraceColumns | None = None
    time_unit: Literal["s", "ms", "us"] = "s"  # csv / jsonl: numeric arrival times
    block_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None  # default below
    start_s: Annotated[float, Field(ge=0)] = 0.0
    duration_s: PositiveFloat | None = None
    requests: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    rate_multiple: Annotated[float, Field(gt=0, le=1_000_000)] = 1.0
    # Every length (prompts, answers, blocks) times this: a trace's traffic shrunk to fit a
    # small model (prompt blocks must stay whole tokens: block tokens times it an integer).
    length_scale: Annotated[float, Field(gt=0, le=1)] = 1.0
    over_context: Literal["refuse", "clip", "drop"] = "refuse"
    # Set by the tuner from the model (never by hand): the context the policy applied to, and
    # how many of the window's requests it clipped or dropped.
    context_tokens: Annotated[int, Field(ge=2)] | None = None
    over_context_requests: Annotated[int, Field(ge=0)] | None = None
    # The file's content (sha256): a study's figures stand on this very trace.
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @field_validator("file")
    @classmethod
    def _from_the_scenario(cls, file: str, info: ValidationInfo) -> str:
        # relative to the scenario file that names it (a preset's: the package's traces)
        base = (info.context or {}).get("base_dir")
        if not file.strip():
            raise ValueError("names no file")
        path = Path(file).expanduser()
        return str(path if path.is_absolute() or base is None else Path(base) / path)

    @model_validator(mode="after")
    def _consistent(self):
        generic = self.format in ("csv", "jsonl")
        if generic and self.columns is None:
            raise ValueError(
                f"format {self.format} needs columns: arrival, input_tokens, output_tokens "
                "(and optionally session, blocks), the names your log uses"
            )
        if not generic and self.columns is not None:
            raise ValueError(f"format {self.format} has known columns: drop columns")
        if self.columns is not None and self.columns.blocks and self.format == "csv":
            raise ValueError("columns.blocks needs format jsonl (a list per request)")
        if self.duration_s is not None and self.requests is not None:
            raise ValueError("give the window as duration_s or as requests, not both")
        scaled = self.length_scale * (self.block_tokens or MOONCAKE_BLOCK_TOKENS)
        if self.length_scale != 1 and (scaled != round(scaled) or scaled < 1):
            raise ValueError(
                f"length_scale {self.length_scale:g} makes a prompt block {scaled:g} tokens; "
                "choose one that keeps it a whole number of tokens"
            )
        return self

    @property
    def block_size(self) -> int:
        """Prompt tokens each block id stands for (scaled)."""
        return round((self.block_tokens or MOONCAKE_BLOCK_TOKENS) * self.length_scale)


@dataclass(frozen=True)
class TraceWindow:
    """A window's requests in arrival order, as read (before the rate multiple)."""

    arrival_s: np.ndarray  # from the window's first request, seconds
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    # per request, its conversation (None: the trace names none)
    session: np.ndarray | None
    # per request, its prompt's block ids (None: the trace names none); block_tokens each
    blocks: list[np.ndarray] | None
    block_tokens: int
    span_s: float  # the window's length: its last arrival (or duration_s, if longer)
    over_context: int  # requests the context policy clipped or dropped
    sha256: str

    def __len__(self) -> int:
        return int(self.input_tokens.size)

    @property
    def rate(self) -> float:
        """Requests per second the window offers as written."""
        return len(self) / self.span_s

    @property
    def shares_prompts(self) -> bool:
        """Whether its prompts can share text: it names prompt blocks or conversations."""
        return self.blocks is not None or self.session is not None

    def lengths(self) -> dict[str, tuple[int, int, float]]:
        """Each length's min, max and mean (the scenario's input_tokens / output_tokens)."""
        return {
            name: (int(values.min()), int(values.max()), float(values.mean()))
            for name, values in (("input", self.input_tokens), ("output", self.output_tokens))
        }


def window_span(arrival_s: np.ndarray, duration_s: float | None) -> float:
    """A window's length in seconds: to its last arrival plus one mean gap (the gap after it
    belongs to the window as every other does), or its stated duration where given."""
    n = arrival_s.size
    last = float(arrival_s[-1]) if n else 0.0
    gap = last / (n - 1) if n > 1 and last > 0 else 1.0
    span = last + gap
    return span if duration_s is None else max(span, duration_s)
