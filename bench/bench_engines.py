"""A short real study on a tiny random Qwen2 with llama.cpp's llama-server (one thread):
per trial, engine start-to-ready, load, stop and the overhead's share of the trial; then the
same configs under an SLA most of them break, with and without early rejection.

    python bench/bench_engines.py [--engines DIR] [--requests N]

DIR holds what .ci/setup-engines installs (default $AUTOTUNE_ENGINES, else
~/.cache/autotune-engines).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from objectives.scenario import Scenario, load_scenario
from runners.engines.llamacpp import LlamaCppRunner, LlamaCppSettings
from runners.load.measurement import summarize
from testing.engines import ENGINES_DIR, engine_executable
from testing.tiny_model import build_tiny_qwen2

CONFIGS = [
    {"batch_size": b, "max_prefill_tokens": 512, "quantization": q, "kv_compression": kv}
    for b in (1, 8)
    for q, kv in (("bf16", 1.0), ("w8a8", 0.5), ("w4a16", 1.0))
]


def scenario(
    requests: int, ttft_ms: float, rate: float = 8.0, prompt: tuple[int, int] = (64, 192)
) -> Scenario:
    data = load_scenario("customer-service").model_dump(mode="json")
    data["workload"] |= {
        "num_requests": requests,
        "arrival": {"kind": "poisson", "rate": rate},
        "input_tokens": {"kind": "uniform", "low": prompt[0], "high": prompt[1]},
        "output_tokens": {"kind": "uniform", "low": 16, "high": 48},
        "shared_prefix": None,  # the preset's 256-token system prompt outgrows these prompts
    }
    data["sla"] = {"ttft_p99_ms": ttft_ms}
    return Scenario.model_validate(data)


def run_all(
    runner: LlamaCppRunner, chosen: Scenario, stop_early: bool = False
) -> list[tuple[dict, object, float]]:
    rows = []
    for config in CONFIGS:
        started = time.perf_counter()
        m = runner.run(config, chosen.workload, chosen.sla, stop_early)
        rows.append((config, m, time.perf_counter() - started))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=Path, default=ENGINES_DIR)
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        model = build_tiny_qwen2(work / "tiny")
        settings = LlamaCppSettings(
            engine_cmd=[str(engine_executable("llamacpp", args.engines))],
            model=model,
            threads=1,
            log_dir=work / "logs",
            gguf_cache=work / "gguf",
            pre_tokenizer="qwen2",
            warmup_requests=1,
        )
        runner = LlamaCppRunner(settings, hardware="cpu")
        started = time.perf_counter()
        for precision in ("bf16", "w8a8", "w4a16"):
            runner.gguf(precision)
        prepared_s = time.perf_counter() - started
        print(f"GGUF preparation (convert + 2 quantizations, once per model): {prepared_s:.1f} s\n")

        print(
            f"{'config':44} {'ready s':>8} {'load s':>8} {'stop s':>8} {'trial s':>8} "
            f"{'overhead':>9} {'tok/s':>7}"
        )
        for config, m, wall in run_all(runner, scenario(args.requests, 60_000)):
            e = m.extra
            overhead = wall - e.get("load_s", 0.0)
            label = (
                f"np {config['batch_size']} {config['quantization']} kv {config['kv_compression']}"
            )
            tok_s = m.output_tokens[m.ok].sum() / e["load_s"] if m.fault is None else float("nan")
            nan = float("nan")
            print(
                f"{label:44} {e.get('start_s', nan):8.2f} {e.get('load_s', nan):8.2f} "
                f"{e.get('stop_s', nan):8.2f} {wall:8.2f} {overhead / wall:9.1%} {tok_s:7.0f}"
            )

        # Long prompts at a high rate: one slot falls behind and its queue grows without bound.
        tight = scenario(2 * args.requests, 150, rate=30.0, prompt=(400, 800))
        timings = {}
        for early in (True, False):
            rows = run_all(runner, tight, stop_early=early)
            timings[early] = sum(wall for _, _, wall in rows)
            rejected = sum(
                1 for _, m, _ in rows if m.fault is not None and m.fault.kind == "sla-violated"
            )
            sent = sum(m.sent for _, m, _ in rows)
            broken = sum(
                1
                for _, m, _ in rows
                if m.fault is None
                and summarize(m, tight.sla)["ttft_p99_ms"] > tight.sla.ttft_p99_ms
            )
            print(
                f"\n{tight.workload.num_requests} requests at 30/s, TTFT p99 <= 150 ms, "
                f"early rejection {'on ' if early else 'off'}: {timings[early]:6.1f} s for "
                f"{len(rows)} trials, {rejected} stopped early, "
                f"{broken} ran to the end and broke the SLA, {sent} requests sent"
            )
        saved = timings[False] - timings[True]
        print(
            f"early rejection saved {saved:.1f} s ({saved / timings[False]:.0%} of the study time)"
        )


if __name__ == "__main__":
    main()
