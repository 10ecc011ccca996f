"""Roofline time of one engine step, and the memory left for the KV cache.

A step's matmuls are compute-bound when many tokens share them (prefill) and memory-bound when
few do (decode, which re-reads every weight and the whole KV cache of the batch). Its time is
the larger of the two bounds plus fixed overheads. All constants come from the hardware profile.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def __post_init__(self):
        hw, m = self.hardware, self.model
        embeddings = m.params_lm_head * (1 if m.tied_embeddings else 2)
        object.__setattr__(
            self,
            "weight_bytes",
            m.params_body * WEIGHT_BYTES[self.quantization] + embeddings * EMBEDDING_BYTES,
        )
        # Decode reads the body and the LM head, not the input embedding (a gather).
        object.__setattr__(
            self,
            "weight_read_bytes",
            m.params_body * WEIGHT_BYTES[self.quantization] + m.params_lm_head * EMBEDDING_BYTES,
        )
        object.__setattr__(self, "kv_bytes_per_token", m.kv_bytes_per_token_bf16 * self.kv_ratio)
        peak = (
            (hw.int8_tops if self.quantization == "w8a8" else hw.bf16_tflops).value
            * 1e12
            * hw.mfu.value
        )
        slowdown = 1 + hw.dequant_overhead.value if self.quantization in ("w8a16", "w4a16") else 1.0
        object.__setattr__(self, "flops_per_s", peak / slowdown)
        object.__setattr__(self, "bytes_per_s", hw.bandwidth_tbs.value * 1e12 * hw.mbu.value)
        object.__setattr__(self, "attn_flops_per_pair", 4 * m.layers * m.heads * m.head_dim)

    def activation_bytes(self, step_tokens: int) -> float:
        """Peak activations of the largest step (engines reserve them before sizing the KV cache)."""
        m = self.model
        return step_tokens * (4 * m.hidden + 2 * m.intermediate) * 2.0

    def kv_capacity_tokens(self, step_tokens: int) -> int:
        """Tokens of KV cache that fit beside weights and activations; negative when those don't."""
        hw = self.hardware
        usable = (
            hw.memory_gb.value * GB * hw.memory_fraction.value - hw.runtime_reserve_gb.value * GB
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
        m, hw = self.model, self.hardware
        rows = prefill_tokens + decode_seqs
        gemm_flops = 2 * m.params_body * rows + 2 * m.params_lm_head * (prefill_seqs + decode_seqs)
        # Matmul efficiency grows with the tokens of a prefill; pure decode steps stream the weights
        # and are bandwidth-bound, which the memory bound below already says.
        efficiency = rows / (rows + hw.gemm_half_tokens.value) if prefill_tokens else 1.0
        compute = gemm_flops / (self.flops_per_s * efficiency)
        compute += self.attn_flops_per_pair * (prefill_pairs + decode_context) / self.flops_per_s
        kv_bytes = self.kv_bytes_per_token * (decode_context + prefill_prefix + prefill_tokens)
        memory = (self.weight_read_bytes + kv_bytes) / self.bytes_per_s
        overhead = hw.decode_step_overhead_ms.value + hw.per_sequence_overhead_ms.value * (
            prefill_seqs + decode_seqs
        )
        if prefill_tokens:
            overhead += hw.prefill_step_overhead_ms.value
        return max(compute, memory) + overhead / 1000
