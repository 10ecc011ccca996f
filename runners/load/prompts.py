"""Prompts of exact token counts, made with the model's own tokenizer.

A prompt is a run of whole-word vocabulary entries (" word"): each is its own pre-token for
GPT-2-style byte-level tokenizers (Qwen2, Llama 3, ...), so n words encode to exactly n tokens.
Every prompt is checked by encoding it again; a tokenizer for which that fails is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from objectives.userfile import InputError
from runners.load.workload import NO_PREFIX, Requests

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_VOCAB_SCAN = 30000  # ids inspected for whole words; plenty for any real vocabulary
_MIN_WORDS = 32


def load_tokenizer(path: Path, source: str):
    from runners.hf import transformers

    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(f"{source}: no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)})")
    try:
        return transformers().AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as error:
        # transformers' reasons span lines: keep them whole, on one
        reason = " ".join(str(error).split())
        raise InputError(f"{source}: cannot load a tokenizer from {path}: {reason}") from None


class PromptMaker:
    def __init__(self, tokenizer, source: str = "tokenizer"):
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids)
        words = []
        for token_id in range(min(len(tokenizer), _VOCAB_SCAN)):
            if token_id in special:
                continue
            text = tokenizer.decode([token_id])
            whole_word = (
                len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
            )
            if whole_word and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                words.append(text)
        if len(words) < _MIN_WORDS:
            raise InputError(
                f"{source}: only {len(words)} whole-word tokens in the vocabulary; "
                f"exact-length prompts need at least {_MIN_WORDS}"
            )
        self.words = np.array(words)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def make(self, lengths: Iterable[int], seed: int) -> list[str]:
        rng = np.random.default_rng(seed)
        prompts = []
        for n in lengths:
            prompts.append(self._exact("".join(rng.choice(self.words, int(n))), int(n)))
        return prompts

    def _exact(self, text: str, n: int) -> str:
        """`text`, checked to encode to its `n` words' `n` tokens."""
        if self.count(text) != n:
            raise InputError(
                f"tokenizer: a {n}-word prompt does not encode to {n} tokens; "
                "this tokenizer's pre-tokenizer merges across words"
            )
        return text

    def for_requests(
        self,
        requests: Requests,
        seed: int,
        prefix_seed: int,
        histories: dict[int, str] | None = None,
    ) -> list[str]:
        """Each request's prompt: its shared prefix's text (the same for every load of the
        workload, so an engine's prefix cache can hit across loads), then text of its own.
        With sessions, a turn's own text only: the load generator puts its session's history
        (earlier prompts and the answers streamed) before it; an in-progress session's first
        turn opens with its `histories` text (session_histories', made here if not given)."""
        if requests.sessions is not None:
            own = self._own_text(requests, requests.sessions.new_tokens, seed, prefix_seed)
            if histories is None:
                histories = self.session_histories(requests, seed)
            for request, history in histories.items():
                own[request] = history + own[request]
            return own
        return self._own_text(requests, requests.input_tokens, seed, prefix_seed)

    def session_histories(self, requests: Requests, seed: int) -> dict[int, str]:
        """The history each in-progress session brings into the test (runners.load.sessions),
        by its first request in the test: text never sent, that warms the engine first."""
        plan = requests.sessions
        if plan is None:
            return {}
        bringing = np.flatnonzero(plan.carried > 0)
        texts = self.make(plan.carried[bringing], seed + 1)
        return dict(zip(bringing.tolist(), texts, strict=True))

    def block_text(self, requests: Requests, prefix_seed: int) -> list[str]:
        """A trace's prompts from their block ids: each block's words the same wherever it
        appears (and in every load of the workload), so prompts that start with the same
        blocks start with the same text; a prompt is its blocks' words, cut to its length
        (the last block of a prompt is partly its own)."""
        assert requests.blocks is not None, "a trace that names prompt blocks"
        size, words = requests.block_tokens, self.words
        texts: dict[int, np.ndarray] = {}
        prompts: list[str] = []
        for ids, length in zip(requests.blocks, requests.input_tokens.tolist(), strict=True):
            parts = []
            for block in ids.tolist():
                if block not in texts:
                    rng = np.random.default_rng([prefix_seed, block])
                    texts[block] = rng.choice(words, size)
                parts.append(texts[block])
            joined = np.concatenate(parts) if parts else words[:0]
            if joined.size < length:  # blocks short of the prompt: the rest its own
                rng = np.random.default_rng([prefix_seed, -1 - len(prompts)])
                joined = np.concatenate([joined, rng.choice(words, length - joined.size)])
            prompts.append(self._exact("".join(joined[:length]), length))
        return prompts

    def _own_text(
        self, requests: Requests, lengths: np.ndarray, seed: int, prefix_seed: int
    ) -> list[str]:
        if requests.blocks is not None:
            return self.block_text(requests, prefix_seed)
        if requests.prefix is None:
            return self.make(lengths, seed)
        sharing = requests.prefix != NO_PREFIX
        own = self.make(lengths - sharing * requests.prefix_tokens, seed)
        prefixes = self.make(
            [requests.prefix_tokens] * (int(requests.prefix.max()) + 1), prefix_seed
        )
        return [
            prefixes[p] + text if p != NO_PREFIX else text
            for p, text in zip(requests.prefix.tolist(), own, strict=True)
        ]
