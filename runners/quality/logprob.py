"""Quality through a server's completions API: `prompt_logprobs` (vLLM's field; MindIE and other
OpenAI-compatible servers are tried with it too) gives the k most likely tokens of every prompt
position. Prompts go as token ids, so the reference and the config see the very same tokens.

Both sides are the engine's raw logprobs (vLLM's default `logprobs_mode: raw_logprobs`, before
any logit processor) and no request carries a logit_bias: the random-weight test model's
special-token bias, which the load generator sends, stays out of both distributions.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from objectives.quality import QualityFigure
from objectives.scenario import Closed, Fixed, Workload
from runners.base import FailedSession
from runners.quality import (
    QualityUnavailable,
    describe_pair,
    eval_set_hash,
    is_reference,
    locked,
    reference_config,
    reference_path,
)

# logprobs per position: vLLM's default --max-logprobs (its cap), which the runner passes explicitly
TOP_K = 20
# tokens per evaluated sequence: short enough for any trial's max-model-len, long prompts are cut
WINDOW = 64
# a bucket the candidate gives no mass: a huge but finite divergence, not an infinity
_FLOOR = 1e-12
FORMAT = 1  # of the reference file; a change of format or method is a new file

# token id -> logprob: the k most likely tokens and the prompt's own
Distribution = dict[int, float]


def token_windows(tokenizer, prompts: list[str], window: int = WINDOW) -> list[list[int]]:
    """Each prompt's tokens (with the special tokens the tokenizer adds, e.g. a BOS), cut into
    consecutive windows of at most `window` tokens; a window of one token has nothing to score."""
    windows = []
    for text in prompts:
        ids = list(tokenizer(text)["input_ids"])
        windows += [ids[start : start + window] for start in range(0, len(ids), window)]
    return [piece for piece in windows if len(piece) >= 2]


def bucket_kl(reference: Distribution, candidate: Distribution) -> float:
    """KL(reference || candidate) of one position, from the two top-k lists: every token both
    list is its own bucket and all other tokens share one bucket, whose mass each side knows
    (one minus what it listed there). That is the exact KL of a coarser view of the vocabulary,
    so never above the full KL: a lower bound that misses only what hides in the tails."""
    shared = reference.keys() & candidate.keys()
    p = {token: math.exp(reference[token]) for token in shared}
    q = {token: math.exp(candidate[token]) for token in shared}
    kl = sum(p[t] * (reference[t] - candidate[t]) for t in shared if p[t] > 0)
    p_rest, q_rest = max(0.0, 1.0 - sum(p.values())), max(0.0, 1.0 - sum(q.values()))
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, _FLOOR)))
    return max(kl, 0.0)  # a KL is never negative; rounding of the logprobs can leave -1e-9


def top_tokens(distribution: Distribution) -> set[int]:
    """The most likely tokens: more than one where logits tie, which bf16 logits often do."""
    best = max(distribution.values())
    return {token for token, logprob in distribution.items() if logprob == best}


def compare(
    reference: list[list[Distribution]], candidate: list[list[Distribution]]
) -> tuple[float, float, int]:
    """Mean KL, top-1 agreement and the number of positions, over every scored position. A
    position agrees when a most likely token of one side is a most likely token of the other
    (a tie broken one way in one list and the other way in the other is no disagreement)."""
    pairs = [
        (r, c)
        for ref_seq, cand_seq in zip(reference, candidate, strict=True)
        for r, c in zip(ref_seq, cand_seq, strict=True)
    ]
    if not pairs:
        raise QualityUnavailable(
            "the evaluation set has no position to score (every prompt is one token)"
        )
    kl = sum(bucket_kl(r, c) for r, c in pairs) / len(pairs)
    agree = sum(bool(top_tokens(r) & top_tokens(c)) for r, c in pairs) / len(pairs)
    return kl, agree, len(pairs)


def _parse_position(entry: Any, token: int, where: str) -> Distribution:
    if not isinstance(entry, dict) or not entry:
        raise QualityUnavailable(
            f"{where}: prompt_logprobs has no distribution for a prompt position"
        )
    try:
        distribution = {int(key): float(value["logprob"]) for key, value in entry.items()}
    except (ValueError, TypeError, KeyError):
        raise QualityUnavailable(
            f"{where}: prompt_logprobs entries are not token id -> {{logprob}}"
        ) from None
    if token not in distribution:  # the server scored other tokens than the ones sent
        raise QualityUnavailable(f"{where}: prompt_logprobs does not carry the prompt's own tokens")
    return distribution


def fetch_prompt_logprobs(
    base_url: str, model: str, windows: list[list[int]], timeout_s: float, top_k: int = TOP_K
) -> list[list[Distribution]]:
    """The server's top-k distributions at positions 1.. of every window (position 0 has no
    context)."""
    sequences = []
    with httpx.Client(timeout=timeout_s) as client:
        for window in windows:
            body = {
                "model": model,
                "prompt": window,
                "max_tokens": 1,
                "temperature": 0,
                "prompt_logprobs": top_k,
            }
            try:
                response = client.post(f"{base_url}/v1/completions", json=body)
            except httpx.HTTPError as error:
                raise QualityUnavailable(
                    f"{base_url}: prompt_logprobs request failed: {error}"
                ) from None
            if response.status_code != 200:
                text = " ".join(response.text.split())[:300]
                raise QualityUnavailable(
                    f"{base_url}: prompt_logprobs refused (HTTP {response.status_code}): {text}"
                )
            try:
                entries = response.json()["choices"][0].get("prompt_logprobs")
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                raise QualityUnavailable(
                    f"{base_url}: the completions answer is not OpenAI-shaped"
                ) from None
            if not isinstance(entries, list):
                raise QualityUnavailable(
                    f"{base_url}: the server returns no prompt_logprobs (it does not "
                    "offer per-position logprobs of the prompt), so quality is not measured"
                )
            if len(entries) != len(window):
                raise QualityUnavailable(
                    f"{base_url}: prompt_logprobs covers {len(entries)} positions of a "
                    f"{len(window)}-token prompt"
                )
            sequences.append(
                [_parse_position(entries[j], window[j], base_url) for j in range(1, len(window))]
            )
    return sequences


@dataclass
class Reference:
    windows: list[list[int]]
    distributions: list[list[Distribution]]
    measured_at: str

    def save(self, path: Path) -> None:
        data = {
            "format": FORMAT,
            "top_k": TOP_K,
            "window": WINDOW,
            "measured_at": self.measured_at,
            "windows": self.windows,
            "distributions": [[sorted(d.items()) for d in seq] for seq in self.distributions],
        }
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(data), encoding="utf-8")
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path) -> Reference | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # not measured yet (or a broken file): measure it again
        if (
            data.get("format") != FORMAT
            or data.get("top_k") != TOP_K
            or data.get("window") != WINDOW
        ):
            return None
        distributions = [
            [{int(t): lp for t, lp in d} for d in seq] for seq in data["distributions"]
        ]
        return cls(data["windows"], distributions, data["measured_at"])


def _endpoint(session) -> tuple[str, str]:
    if isinstance(session, FailedSession):
        raise QualityUnavailable(
            f"the engine is not serving ({session.fault.kind}: {session.fault.message})"
        )
    try:
        return session.endpoint()
    except httpx.HTTPError as error:
        raise QualityUnavailable(f"cannot ask the server for its model: {error}") from None


def _reference_workload(windows: list[list[int]]) -> Workload:
    """Sizes the reference session to the evaluation windows (max-model-len: a window and one
    token)."""
    return Workload(
        arrival=Closed(kind="closed", concurrency=1),
        num_requests=1,
        input_tokens=Fixed(kind="fixed", value=max(len(w) for w in windows)),
        output_tokens=Fixed(kind="fixed", value=1),
    )


def _measure_reference(
    runner, config: dict[str, Any], session, windows: list[list[int]]
) -> list[list[Distribution]]:
    timeout = runner.settings.request_timeout_s
    if session is not None and is_reference(config):  # this session serves the reference itself
        return fetch_prompt_logprobs(*_endpoint(session), windows, timeout)
    # An engine of its own (beside the trial's, if one runs), once per model, engine and
    # evaluation set.
    with runner.session(reference_config(config), _reference_workload(windows)) as reference:
        if isinstance(reference, FailedSession):
            raise QualityUnavailable(
                f"the reference config (bf16 weights, kv_compression 1) did not start: "
                f"{reference.fault.kind}: {reference.fault.message}"
            )
        return fetch_prompt_logprobs(*_endpoint(reference), windows, timeout)


def ensure_reference(
    runner, config: dict[str, Any], prompts: list[str], session=None
) -> tuple[Reference, bool]:
    """The reference's distributions: from disk, else measured now and kept, in `session` when it
    serves the reference config, else in a reference engine of its own. True: measured in
    `session`."""
    path = reference_path(
        runner.settings.quality_cache, runner.settings.model, runner.name, prompts, ".json"
    )
    reference = Reference.load(path)
    if reference is not None:
        return reference, False
    with locked(path):
        reference = Reference.load(path)
        if reference is not None:  # another process measured it while this one waited
            return reference, False
        windows = token_windows(runner.tokenizer(), prompts)
        if not windows:
            raise QualityUnavailable("the evaluation set has no prompt of two tokens or more")
        distributions = _measure_reference(runner, config, session, windows)
        reference = Reference(windows, distributions, time.strftime("%Y-%m-%d %H:%M:%S"))
        reference.save(path)
    return reference, session is not None and is_reference(config)


def measure_by_prompt_logprobs(
    runner, config: dict[str, Any], session, prompts: list[str]
) -> QualityFigure:
    """The config's quality in this session against the reference's distributions (see
    ensure_reference)."""
    reference, measured_here = ensure_reference(runner, config, prompts, session)
    how = (
        f"{runner.name} prompt_logprobs (top {TOP_K}), teacher-forced on "
        f"{len(reference.windows)} sequences of at most {WINDOW} tokens of evaluation set "
        f"{eval_set_hash(prompts)}"
    )
    if measured_here:  # this very measurement is the reference: nothing to differ from
        positions = sum(len(seq) for seq in reference.distributions)
        return QualityFigure(
            kl=0.0,
            top1_agreement=1.0,
            source="measured",
            samples=positions,
            note=f"the reference config itself ({describe_pair(config)}), measured now: {how}",
        )
    candidate = fetch_prompt_logprobs(
        *_endpoint(session), reference.windows, runner.settings.request_timeout_s
    )
    kl, agreement, positions = compare(reference.distributions, candidate)
    return QualityFigure(
        kl=kl,
        top1_agreement=agreement,
        source="measured",
        samples=positions,
        note=(
            f"{describe_pair(config)} against the reference (bf16 weights, kv_compression 1, "
            f"measured {reference.measured_at}): {how}; KL over the tokens both top-{TOP_K} lists "
            "share plus one bucket for the rest of the mass (a lower bound of the full KL); "
            "raw logprobs, no logit_bias"
        ),
    )
