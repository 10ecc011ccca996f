"""Quality on llama.cpp: `llama-perplexity`, beside (not through) the server, on the GGUF files
the llamacpp runner prepares.

Once per model and evaluation set, the reference (the BF16 GGUF with an f16 KV cache) writes
its next-token log-probabilities with `--kl-divergence-base FILE`; each (precision, KV) pair
then runs `--kl-divergence` against that file, which holds the tokens too, so both sides see
the same token sequence. llama-perplexity joins the evaluation text into one stream and cuts
it into chunks of `-c` tokens; each chunk's first half is context and every later position but
the last is scored (perplexity.cpp: `first = n_ctx/2`, `n_ctx - 1 - first` positions), and the
reference pass needs at least 2 x `-c` tokens of text.

It scores raw logits over the whole vocabulary, with no logit_bias on either side (the test
model's special-token bias is a request field of the server, which this does not use).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from objectives.quality import REFERENCE, QualityFigure
from runners.quality import (
    QualityUnavailable,
    describe_pair,
    eval_set_hash,
    locked,
    quality_pair,
    reference_path,
)
from search_spaces.engines import llamacpp_flash, llamacpp_repack
from search_spaces.knobs import LLAMACPP_KV_TYPES

MAX_CONTEXT = (
    128  # -c: chunks of 128 tokens score 63 positions each; the shipped set holds many chunks
)
MIN_CONTEXT = 16  # below this a chunk's context says little about the text
_ATTEMPTS = 5  # runs of one KL measurement: 3 once all lost their summary (a busy machine)
# printf's numbers, its nan and inf among them (a model whose logits overflowed)
_NUMBER = r"(-?(?:[\d.]+(?:[eE][-+]?\d+)?|nan|inf))"
SUMMARY = "KL divergence statistics"


@dataclass(frozen=True)
class KLDivergence:
    """What `llama-perplexity --kl-divergence` printed."""

    mean_kld: float
    same_top: float  # share of positions (0..1) where both sides' most likely token is the same
    positions: int


def parse_kl_output(text: str) -> KLDivergence:
    """The figures of llama-perplexity's KL run: its summary ("Mean    KLD", "Same top p"), or
    where its log lost the summary's lines at exit, its last chunk's row (each row holds the
    running figures over every chunk so far, so the last one's are the summary's, printed to
    one digit less); QualityUnavailable with the tool's last words when neither is there."""
    chunks = re.search(r"computing over (\d+) chunks, n_ctx=(\d+)", text)
    if chunks is None:
        raise QualityUnavailable(f"llama-perplexity printed no KL divergence: {last_words(text)}")
    n_chunk, n_ctx = int(chunks.group(1)), int(chunks.group(2))
    positions = n_chunk * (n_ctx - 1 - n_ctx // 2)
    mean = re.search(rf"^Mean\s+KLD:\s+{_NUMBER}", text, re.MULTILINE)
    same = re.search(rf"^Same top p:\s+{_NUMBER}\s*±\s*{_NUMBER}\s*%", text, re.MULTILINE)
    if mean and same:
        return _figures(float(mean.group(1)), float(same.group(1)) / 100, positions)
    pair = rf"{_NUMBER}\s*±\s*{_NUMBER}"
    # chunk, PPL, ln(PPL(Q)/PPL(base)), KL divergence, Δp RMS %, same top p %
    row = rf"^\s*{n_chunk}\s+{pair}\s+{pair}\s+{pair}\s+{pair}\s*%\s+{pair}\s*%"
    last = re.search(row, text, re.MULTILINE)
    if last is None:
        raise QualityUnavailable(f"llama-perplexity printed no KL divergence: {last_words(text)}")
    return _figures(float(last.group(5)), float(last.group(9)) / 100, positions)


class NotFinite(QualityUnavailable):
    """Figures a run printed whole, nan or inf among them: running it again prints them again."""


def _figures(mean_kld: float, same_top: float, positions: int) -> KLDivergence:
    if not (math.isfinite(mean_kld) and math.isfinite(same_top)):
        raise NotFinite(
            f"llama-perplexity's figures are not finite (mean KLD {mean_kld:g}, same top token "
            f"{same_top * 100:g}%): the quantized model's logits overflowed"
        )
    return KLDivergence(mean_kld, same_top, positions)


def last_words(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [
        line
        for line in lines
        if "error" in line.lower() or "failed" in line.lower() or "need" in line
    ]
    return " | ".join((errors or lines)[-3:])[:500] or "(no output)"


def context_for(tokens: int) -> int:
    """-c for an evaluation text of `tokens` tokens: the reference pass needs 2 x -c (a few
    tokens kept spare for the BOS and tokenizer differences); at most MAX_CONTEXT."""
    context = min(MAX_CONTEXT, (tokens - 4) // 2)
    if context < MIN_CONTEXT:
        raise QualityUnavailable(
            f"the evaluation set is {tokens} tokens; llama-perplexity needs at least "
            f"{2 * MIN_CONTEXT + 4} (two chunks of {MIN_CONTEXT}): give more text"
        )
    return context


def cache_type(kv_compression: float) -> str:
    """The KV-cache type llama-server gets for a kv_compression (its `-ctk`)."""
    return LLAMACPP_KV_TYPES[float(kv_compression)]


def _run(argv: list[str], timeout_s: float) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, start_new_session=True
        )
    except subprocess.TimeoutExpired:
        raise QualityUnavailable(f"llama-perplexity did not finish in {timeout_s:g} s") from None
    except OSError as error:
        raise QualityUnavailable(f"cannot run {argv[0]}: {error.strerror}") from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise QualityUnavailable(
            f"llama-perplexity failed (exit {done.returncode}): {last_words(output)}"
        )
    return output


class PerplexityQuality:
    """The llamacpp runner's quality measurement (see the module's docstring)."""

    def __init__(self, runner, command: Path, timeout_s: float):
        self.runner, self.command, self.timeout_s = runner, command, timeout_s

    def _args(self, context: int, precision: str, kv_type: str) -> list[str]:
        """The model and cache as the server has them (search_spaces.engines' rules)."""
        threads = self.runner.settings.threads
        return [
            "-m",
            str(self.runner.gguf(precision)),
            "-c",
            str(context),
            "-ctk",
            kv_type,
            "-ctv",
            kv_type,
            *llamacpp_flash(kv_type, self.runner.settings.flash_attention),
            *(["-t", str(threads)] if threads else []),
            *llamacpp_repack(precision),
        ]

    def reference(self, prompts: list[str]) -> tuple[Path, int]:
        """The reference's log-probabilities file (measured once, then kept) and its -c."""
        settings = self.runner.settings
        text = "\n\n".join(prompts)
        context = context_for(len(self.runner.tokenizer()(text)["input_ids"]))
        base = reference_path(
            settings.quality_cache, settings.model, "llamacpp", prompts, f"-c{context}.kld"
        )
        if base.exists():
            return base, context
        with locked(base):
            if base.exists():
                return base, context
            text_file = base.with_name(base.name + ".txt")
            text_file.write_text(text, encoding="utf-8")
            partial = base.with_name(base.name + ".partial")
            argv = [
                str(self.command),
                "-f",
                str(text_file),
                "--kl-divergence-base",
                str(partial),
                *self._args(context, REFERENCE[0], cache_type(REFERENCE[1])),
            ]
            output = _run(argv, self.timeout_s)
            # It exits 0 even when the text is too short: the file tells.
            if not partial.exists() or partial.stat().st_size <= 8:
                raise QualityUnavailable(
                    f"llama-perplexity wrote no reference log-probabilities: {last_words(output)}"
                )
            os.replace(partial, base)
        return base, context

    def kl(self, precision: str, kv_type: str, prompts: list[str]) -> tuple[KLDivergence, int]:
        """The KL run of a precision's GGUF with a KV-cache type, against the reference; and its
        -c."""
        base, context = self.reference(prompts)
        argv = [
            str(self.command),
            "--kl-divergence-base",
            str(base),
            "--kl-divergence",
            *self._args(context, precision, kv_type),
        ]
        for attempt in range(_ATTEMPTS):
            output = _run(argv, self.timeout_s)
            # Its log thread can lose lines at exit (exit status 0): the summary's (about 1 run
            # in 20 here; the last chunk's row then stands for it), or every line (on a busy
            # machine): a run with neither is run again. One that said why it could not run,
            # or that reached its summary (its figures stand, nan or not), is not.
            try:
                return parse_kl_output(output), context
            except NotFinite:
                raise
            except QualityUnavailable:
                lost = not output.strip() or "computing over" in output
                if attempt == _ATTEMPTS - 1 or not lost or SUMMARY in output:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def measure(self, config: dict[str, Any], prompts: list[str]) -> QualityFigure:
        started = time.monotonic()
        precision, kv = quality_pair(config)
        result, context = self.kl(precision, cache_type(kv), prompts)
        return QualityFigure(
            # the base file's 16-bit log-probs can leave -1e-6 for identical runs
            kl=max(result.mean_kld, 0.0),
            top1_agreement=result.same_top,
            source="measured",
            samples=result.positions,
            note=(
                f"{describe_pair(config)} against the reference (BF16 GGUF, f16 KV cache): "
                f"llama-perplexity --kl-divergence over the full vocabulary, -c {context} "
                f"(the last {context - 1 - context // 2} positions of each chunk scored), "
                f"evaluation set {eval_set_hash(prompts)}; "
                f"{time.monotonic() - started:.1f} s"
            ),
        )
