"""What the simulator simulates: a model's shape and an accelerator's figures."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, field_validator

from objectives.userfile import InputError, first_line, load_preset_or_file, preset_names


@dataclass(frozen=True)
class ModelProfile:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = True
    max_context: int | None = None  # max_position_embeddings: the longest request it can serve

    @property
    def params_per_layer(self) -> int:
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return q_and_o + k_and_v + bias + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params_body(self) -> int:
        """Parameters without the embedding matrices: what every token's matmuls touch."""
        return self.layers * self.params_per_layer + self.hidden

    @property
    def params_lm_head(self) -> int:
        return self.vocab * self.hidden

    @property
    def kv_bytes_per_token_bf16(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


QWEN2_7B = ModelProfile(
    name="qwen2-7b",
    layers=28,
    hidden=3584,
    heads=28,
    kv_heads=4,
    head_dim=128,
    intermediate=18944,
    vocab=152064,
    max_context=32768,  # Qwen2-7B-Instruct's config.json
)
BUILTIN_MODELS = {QWEN2_7B.name: QWEN2_7B}


def load_model(name_or_dir: str) -> ModelProfile:
    """A built-in model name, or a local Hugging Face model directory holding config.json."""
    if name_or_dir.lower() in BUILTIN_MODELS:
        return BUILTIN_MODELS[name_or_dir.lower()]
    path = Path(name_or_dir)
    if not (path / "config.json").is_file():
        raise InputError(
            f"--model: {name_or_dir!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
            "nor a directory with a config.json"
        )
    from runners.hf import transformers  # heavy import: only when a model dir is given

    try:
        cfg = transformers().AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise InputError(
            f"{path / 'config.json'}: not a model config transformers can read: {first_line(error)}"
        ) from None
    heads = cfg.num_attention_heads
    return ModelProfile(
        name=path.name.lower(),
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        intermediate=cfg.intermediate_size,
        vocab=cfg.vocab_size,
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(cfg, "attention_bias", cfg.model_type == "qwen2")),
        max_context=getattr(cfg, "max_position_embeddings", None),
    )


# calibrated: fitted to real trials (`autotune calibrate`)
Source = Literal["measured", "assumed", "calibrated"]


class Figure(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    value: PositiveFloat
    source: Source
    note: str = ""


class LinkFigures(BaseModel):
    """The path one request's KV cache takes from a prefill chip to a decode chip."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str  # e.g. "HCCS", "RoCE", "NVLink 4", "InfiniBand NDR"
    bandwidth_gbs: Figure  # per direction, one prefill chip to one decode chip, GB/s
    latency_ms: Figure  # per transfer: handshake and first byte, before the bytes stream


class KVLink(BaseModel):
    """Links for prefill/decode disaggregation: within a node, and between nodes for a
    deployment larger than one node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chips_per_node: int = Field(8, ge=1)
    intra_node: LinkFigures
    inter_node: LinkFigures


class HostTier(BaseModel):
    """Host memory a chip's KV cache may move blocks to, and the link it moves them over."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_gb: Figure  # host DRAM one chip's engine may fill with KV blocks
    link: LinkFigures  # device <-> host, per direction


class HardwareProfile(BaseModel):
    """One accelerator. Every figure says whether it was measured, assumed or calibrated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    bf16_tflops: Figure
    int8_tops: Figure
    memory_gb: Figure
    bandwidth_tbs: Figure
    memory_fraction: Figure  # share of device memory the engine may use (weights + KV + work)
    runtime_reserve_gb: Figure  # runtime, graphs and workspace outside the KV cache
    mfu: Figure  # achieved share of peak compute on large matmuls
    mbu: Figure  # achieved share of peak bandwidth when streaming weights and KV
    gemm_half_tokens: Figure  # tokens in one step at which matmul efficiency reaches half of mfu
    dequant_overhead: Figure  # extra matmul time of weight-only quantization (w8a16, w4a16)
    decode_step_overhead_ms: Figure  # fixed cost of a step: scheduling, launches, sampling
    prefill_step_overhead_ms: Figure  # extra fixed cost of a step that runs prefill
    per_sequence_overhead_ms: Figure  # per sequence in a step: metadata, sampling, detokenising
    # What a client waits beside the engine's steps (HTTP, tokenising, the API server's queue):
    # added to every request's first token and end, never occupying the engine.
    request_latency_ms: Figure | None = None
    kv_block_tokens: int = Field(128, ge=1)

    @property
    def request_latency_s(self) -> float:
        """request_latency_ms in seconds; 0 when the profile states none."""
        latency = self.request_latency_ms
        return latency.value / 1000 if latency is not None else 0.0

    # What KV transfers between chips go over; None: no disaggregated deployment on it.
    kv_link: KVLink | None = None
    # Where evicted KV blocks can wait in host memory; None: no host tier on it.
    host: HostTier | None = None

    @field_validator("mfu", "mbu")
    @classmethod
    def _a_share(cls, figure: Figure) -> Figure:
        if figure.value > 1:  # achieved over peak: above 1 the peak itself is wrong
            raise ValueError(f"{figure.value:g} is a share of the peak: at most 1.0")
        return figure


HARDWARE = resources.files("runners.sim") / "hardware"


def hardware_names() -> list[str]:
    return preset_names(HARDWARE)


def load_hardware(name_or_path: str, flag: str = "--hardware") -> HardwareProfile:
    """A built-in profile name, or the path of a user's (e.g. measured) profile; `flag` is the
    option that named it, for the error."""
    return load_preset_or_file(HARDWARE, name_or_path, HardwareProfile, f"{flag}: unknown profile")
