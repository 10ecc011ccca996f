"""How a real engine measures a config's quality: its next-token distributions on a fixed
evaluation set, teacher-forced (the same tokens fed to both), against the reference config of
the same model and engine (bf16 weights, KV-cache compression off).

This module holds what every engine shares: the evaluation set (shipped, or a user's
`--quality-prompts` file), where reference measurements are kept, and the pair a config is
measured for. How an engine measures lives beside it: `runners/quality/logprob.py` (servers
that return prompt logprobs: vLLM, MindIE, OpenAI-compatible) and `runners/quality/llamacpp.py`
(llama.cpp's `llama-perplexity --kl-divergence`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from objectives.quality import REFERENCE
from objectives.userfile import load_yaml

DEFAULT_PROMPTS = resources.files("runners.quality") / "eval" / "quality-prompts.yaml"


class QualityUnavailable(Exception):
    """The runner cannot measure this config's quality; `reason` says why, in one line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class EvalPrompts(BaseModel):
    """A `--quality-prompts` file: text in the user's domain, fed to every config unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


def load_eval_prompts(path: Path | None) -> list[str]:
    """The evaluation set: the shipped one (None), or a user's YAML file (`prompts:` a list of
    texts), read through the one path every user file takes (UTF-8, size limit, one-line errors)."""
    if path is None:
        with resources.as_file(DEFAULT_PROMPTS) as shipped:
            return list(load_yaml(shipped, EvalPrompts).prompts)
    return list(load_yaml(path, EvalPrompts).prompts)


def eval_set_hash(prompts: list[str]) -> str:
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def model_key(model: Path) -> str:
    """A model folder's content key (file names, sizes, modification times): caches derived from
    the weights (GGUF files, reference distributions) are redone when the weights change."""
    digest = hashlib.sha256()
    for path in sorted(model.iterdir()):
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def quality_pair(config: dict[str, Any]) -> tuple[str, float]:
    """What quality depends on: (quantization, kv_compression); knobs left out are the
    reference's."""
    return str(config.get("quantization", REFERENCE[0])), float(
        config.get("kv_compression", REFERENCE[1])
    )


def is_reference(config: dict[str, Any]) -> bool:
    return quality_pair(config) == REFERENCE


def reference_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with the reference's precision and KV setting; its other knobs kept, so the
    reference session starts wherever the config itself could."""
    return {**config, "quantization": REFERENCE[0], "kv_compression": REFERENCE[1]}


def describe_pair(config: dict[str, Any]) -> str:
    quantization, kv = quality_pair(config)
    return f"{quantization} weights, kv_compression {kv:g}"


def reference_path(cache: Path, model: Path, engine: str, prompts: list[str], suffix: str) -> Path:
    """Where an engine keeps the reference's measurement of a model on an evaluation set."""
    return cache / f"{model.name}-{model_key(model)}" / f"{engine}-{eval_set_hash(prompts)}{suffix}"


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """One process at a time measures a reference; the others wait, then find it on disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
