"""The `openai` runner: any OpenAI-compatible server (SGLang, TGI, ...).

Either `engine_cmd` is an argument-list template started per trial, its `{port}` and `{model}`
and knob placeholders (`{batch_size}`, `{max_prefill_tokens}`, ...) filled in; a knob with no
placeholder is dropped from the search space. Or no command is given and `base_url` names a
server that is already running: its settings cannot change per trial, so every knob is dropped
and each trial measures the server as it is.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field

from objectives.quality import QualityFigure
from objectives.scenario import Workload
from objectives.userfile import InputError
from runners.base import Session
from runners.engines.process import http_ready
from runners.engines.served import Launch, RunnerSettings, ServedRunner
from runners.quality import QualityUnavailable
from search_spaces.space import SearchSpace

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class OpenAISettings(RunnerSettings):
    base_url: str | None = None  # an already-running server (no engine_cmd)
    served_model: str | None = None  # the requests' `model`; default: the first of /v1/models
    ready_path: str = "/v1/models"
    # Per knob, the text each value becomes, e.g.
    # select_batch: {decode-first: --enable-mixed-chunk, prefill-first: ""}
    knob_values: dict[str, dict[str, str]] = Field(default_factory=dict)


class OpenAIRunner(ServedRunner):
    name = "openai"
    # the knob vocabulary and preset ranges; the template decides what reaches the server
    engine = "vllm"
    settings_model = OpenAISettings
    settings: OpenAISettings

    def __init__(self, settings: OpenAISettings, hardware: str | None = None):
        super().__init__(settings, hardware)
        if not settings.engine_cmd and not settings.base_url:
            raise InputError(
                "--runner-config: the openai runner needs `engine_cmd` (an argument-list template) "
                "or `base_url` (a running server)"
            )
        self.placeholders = {
            name for part in settings.engine_cmd or [] for name in _PLACEHOLDER.findall(part)
        }

    def assumptions(self) -> dict[str, Any]:
        """Its settings and, for a server already running, what that server says it is: the
        `owned_by` of its models (vllm, llamacpp, sglang, ...) and the `/version` vLLM and
        SGLang serve. The runner speaks vLLM's knob names (`engine`); this says who answered."""
        server = self._server_report() if self.settings.base_url else {}
        return super().assumptions() | ({"server": server} if server else {})

    def _server_report(self) -> dict[str, str]:
        base_url = (self.settings.base_url or "").rstrip("/")
        report: dict[str, str] = {}
        try:
            models = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]
            owners = sorted({str(model.get("owned_by")) for model in models if "owned_by" in model})
            if owners:
                report["owned_by"] = ", ".join(owners)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            pass  # its first trial says why it does not answer
        try:
            answer = httpx.get(f"{base_url}/version", timeout=10)
            if answer.status_code == 200 and "version" in answer.json():
                report["version"] = str(answer.json()["version"])
        except (httpx.HTTPError, ValueError, TypeError):
            pass
        return report

    def model_name(self) -> str:
        return self.settings.served_model or super().model_name()

    def adapt(self, space: SearchSpace) -> SearchSpace:
        for name in list(space.ranges):
            if name not in self.placeholders:
                why = (
                    "no placeholder for it in engine_cmd"
                    if self.settings.engine_cmd
                    else "the server is already running"
                )
                space = space.drop(name, why)
        return space

    def _fill(self, part: str, values: dict[str, Any]) -> str:
        try:
            return string.Formatter().vformat(part, (), values)
        except (KeyError, IndexError) as error:
            raise InputError(
                f"engine_cmd: unknown placeholder {error} in {part!r}; known: "
                f"{', '.join(sorted(values))}"
            ) from None

    def _can_start_the_reference(self) -> None:
        """Quality needs the bf16 reference: only a command that sets the precision or the KV
        cache per trial can start it."""
        if not self.placeholders & {"quantization", "kv_compression"}:
            how = (
                "engine_cmd has no {quantization} or {kv_compression} placeholder"
                if self.settings.engine_cmd
                else "the server at base_url is already running"
            )
            raise QualityUnavailable(
                f"the openai runner cannot start the reference config (bf16 weights, "
                f"kv_compression 1): {how}"
            )

    def quality_unmeasurable(self) -> str | None:
        try:
            self._can_start_the_reference()
        except QualityUnavailable as error:
            return str(error)
        return None

    def measure_quality(
        self, config: dict[str, Any], session: Session, eval_prompts: list[str]
    ) -> QualityFigure:
        # then prompt_logprobs as vLLM's, when the server returns them
        self._can_start_the_reference()
        return super().measure_quality(config, session, eval_prompts)

    def prepare_quality(self, config: dict[str, Any], eval_prompts: list[str]) -> None:
        self._can_start_the_reference()
        super().prepare_quality(config, eval_prompts)

    def served_model(self, base_url: str) -> str:
        if self.settings.served_model:
            return self.settings.served_model
        try:
            models = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]
            return models[0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return self.model_name()

    def launch(
        self, config: dict[str, Any], port: int, trial_dir: Path, workload: Workload
    ) -> Launch:
        if not self.settings.engine_cmd:
            base_url = self.settings.base_url
            if base_url is None:  # __init__ refuses settings with neither
                raise InputError(
                    "--runner-config: the openai runner needs `engine_cmd` or `base_url`"
                )
            return Launch(argv=[], base_url=base_url.rstrip("/"))
        values: dict[str, Any] = {
            "port": port,
            "model": str(self.settings.model or ""),
            "host": "127.0.0.1",
            "max_model_len": workload.longest_request,
        }
        for name, value in config.items():
            values[name] = self.settings.knob_values.get(name, {}).get(str(value), value)
        argv = [self._fill(part, values) for part in self.settings.engine_cmd]
        argv = [part for part in argv if part != ""] + self.settings.extra_args
        ready = http_ready(f"http://127.0.0.1:{port}{self.settings.ready_path}")
        return Launch(argv=argv, ready=ready, model=self.settings.served_model or "")
