"""What the simulated engine's scheduler is set to, and what one of its steps did."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

Policy = Literal["prefill-first", "select-batch", "chunked", "whole-prefill"]


@dataclass(frozen=True)
class Scheduler:
    policy: Policy
    max_batch: int
    max_prefill_tokens: int
    max_prefill_batch: int
    prefill_ms_per_req: float = 150.0
    decode_ms_per_req: float = 50.0


class TraceStep(NamedTuple):
    """One engine step, as Simulation.trace records it."""

    kind: str  # "prefill" or "decode"
    prefill_seqs: int
    prefill_tokens: int
    decoding_seqs: int  # requests decoding when the step ran
    waiting: int  # requests waiting for a prefill
