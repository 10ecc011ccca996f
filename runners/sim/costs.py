"""Roofline time of one engine step, and the memory left for the KV cache.

A step's matmuls are compute-bound when many tokens share them (prefill) and memory-bound when
few do (decode, which re-reads every weight and the whole KV cache of the batch). Its time is
the larger of the two bounds plus fixed overheads. All constants come from the hardware profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runners.sim.profiles import HardwareProfile, ModelProfile

WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "w8a8": 1.0, "w8a16": 1.0, "w4a16": 0.5}
EMBEDDING_BYTES = 2.0  # embeddings and the LM head stay in 16-bit under every scheme here
GB = 1e9


@dataclass(frozen=True)
class CostModel:
    model: ModelProfile
    hardware: HardwareProfile
    quantization: str
    kv_ratio: float
    # Figures derived from the above in __post_init__:
    # every weight held in memory, and those a decode step reads (not the input embedding)
    weight_bytes: float = field(init=False, repr=False, compare=False)
    weight_read_bytes: float = field(init=False, repr=False, compare=False)
    kv_bytes_per_token: float = field(init=False, repr=False, compare=False)
    # sustained matmul throughput under the scheme, and memory bandwidth
    flops_per_s: float = field(init=False, repr=False, compare=False)
    bytes_per_s: float = field(init=False, repr=False, compare=False)
    # attention FLOPs per query-key pair, all layers
    attn_flops_per_pair: float = field(init=False, repr=False, compare=False)
    # What step_seconds reads on every step (5.5 M times in a default study), read once: the
    # parameters its matmuls touch and the profile's overheads (ms), as plain numbers.
    params_body: int = field(init=False, repr=False, compare=False)
    params_lm_head: int = field(init=False, repr=False, compare=False)
    gemm_half_tokens: float = field(init=False, repr=False, compare=False)
    step_overhead_ms: float = field(init=False, repr=False, compare=False)
    prefill_overhead_ms: float = field(init=False, repr=False, compare=False)
    sequence_overhead_ms: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        hardware, model = self.hardware, self.model
        embeddings = model.params_lm_head * (1 if model.tied_embeddings else 2)
        body_bytes = model.params_body * WEIGHT_BYTES[self.quantization]
        object.__setattr__(self, "weight_bytes", body_bytes + embeddings * EMBEDDING_BYTES)
        # Decode reads the body and the LM head, not the input embedding (a gather).
        object.__setattr__(
            self, "weight_read_bytes", body_bytes + model.params_lm_head * EMBEDDING_BYTES
        )
        object.__setattr__(
            self, "kv_bytes_per_token", model.kv_bytes_per_token_bf16 * self.kv_ratio
        )
        peak = (
            (hardware.int8_tops if self.quantization == "w8a8" else hardware.bf16_tflops).value
            * 1e12
            * hardware.mfu.value
        )
        slowdown = (
            1 + hardware.dequant_overhead.value if self.quantization in ("w8a16", "w4a16") else 1.0
        )
        object.__setattr__(self, "flops_per_s", peak / slowdown)
        object.__setattr__(
            self, "bytes_per_s", hardware.bandwidth_tbs.value * 1e12 * hardware.mbu.value
        )
        object.__setattr__(
            self, "attn_flops_per_pair", 4 * model.layers * model.heads * model.head_dim
        )
        object.__setattr__(self, "params_body", model.params_body)
        object.__setattr__(self, "params_lm_head", model.params_lm_head)
        object.__setattr__(self, "gemm_half_tokens", hardware.gemm_half_tokens.value)
        object.__setattr__(self, "step_overhead_ms", hardware.decode_step_overhead_ms.value)
        object.__setattr__(self, "prefill_overhead_ms", hardware.prefill_step_overhead_ms.value)
        object.__setattr__(self, "sequence_overhead_ms", hardware.per_sequence_overhead_ms.value)

    def activation_bytes(self, step_tokens: int) -> float:
        """Peak activations of the largest step (reserved before the KV cache is sized)."""
        model = self.model
        return step_tokens * (4 * model.hidden + 2 * model.intermediate) * 2.0

    def kv_capacity_tokens(self, step_tokens: int) -> int:
        """Tokens of KV cache that fit beside weights and activations; negative when those don't."""
        hardware = self.hardware
        usable = (
            hardware.memory_gb.value * GB * hardware.memory_fraction.value
            - hardware.runtime_reserve_gb.value * GB
        )
        return int(
            (usable - self.weight_bytes - self.activation_bytes(step_tokens))
            // self.kv_bytes_per_token
        )

    def step_seconds(
        self,
        prefill_tokens: int,
        prefill_pairs: float,
        prefill_prefix: int,
        prefill_seqs: int,
        decode_seqs: int,
        decode_context: int,
    ) -> float:
        """One step: prefill chunks (new tokens, attention query-key pairs, KV tokens already
        cached before the chunks, sequences) plus one token for each decoding sequence."""
        rows = prefill_tokens + decode_seqs
        gemm_flops = 2 * self.params_body * rows + 2 * self.params_lm_head * (
            prefill_seqs + decode_seqs
        )
        # Matmul efficiency grows with the tokens of a prefill; pure decode steps stream the weights
        # and are bandwidth-bound, which the memory bound below already says.
        efficiency = rows / (rows + self.gemm_half_tokens) if prefill_tokens else 1.0
        compute = gemm_flops / (self.flops_per_s * efficiency)
        compute += self.attn_flops_per_pair * (prefill_pairs + decode_context) / self.flops_per_s
        kv_bytes = self.kv_bytes_per_token * (decode_context + prefill_prefix + prefill_tokens)
        memory = (self.weight_read_bytes + kv_bytes) / self.bytes_per_s
        overhead = self.step_overhead_ms + self.sequence_overhead_ms * (prefill_seqs + decode_seqs)
        if prefill_tokens:
            overhead += self.prefill_overhead_ms
        return max(compute, memory) + overhead / 1000

    def decode_terms(self, decode_seqs: int) -> tuple[float, float]:
        """A decode step's seconds that depend on its batch alone: the matmuls', and the fixed
        overheads'."""
        gemm_flops = 2 * self.params_body * decode_seqs + 2 * self.params_lm_head * decode_seqs
        overhead = self.step_overhead_ms + self.sequence_overhead_ms * decode_seqs
        return gemm_flops / self.flops_per_s, overhead / 1000

    def decode_seconds(self, decode_seqs: int, decode_context: int) -> float:
        """step_seconds(0, 0, 0, 0, decode_seqs, decode_context), the same operations in the
        same order (so the same float), without a prefill's terms: the simulator's most
        frequent step. runners.sim.decode_run inlines it, with decode_terms kept per batch."""
        gemm_s, overhead_s = self.decode_terms(decode_seqs)
        compute = gemm_s + self.attn_flops_per_pair * decode_context / self.flops_per_s
        kv_bytes = self.kv_bytes_per_token * decode_context
        memory = (self.weight_read_bytes + kv_bytes) / self.bytes_per_s
        return max(compute, memory) + overhead_s
