"""The `mindie` runner: MindIE-Service's `mindieservice_daemon` with a config.json per trial.

The trial's config.json starts from the installation's own `<install>/conf/config.json`; the
knobs' ScheduleConfig fields, the weights directory of the precision and this trial's ports
are written into a copy in the trial's folder, which the daemon reads through the environment
variable named by `config_env` (MIES_CONFIG_JSON_PATH; unverified against every MindIE
release). The installed file is only read, never written.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from objectives.scenario import Workload
from objectives.userfile import InputError
from runners.engines.process import choose_port, http_ready, log_line_ready
from runners.engines.served import SERVED_NAME, Launch, RunnerSettings, ServedRunner
from runners.engines.versions import version_file
from search_spaces.engines import mindie_model_deploy, violations
from search_spaces.knobs import render
from search_spaces.space import SearchSpace

READY_LINE = "Daemon start success!"
DEFAULT_INSTALL = Path(
    os.environ.get("MIES_INSTALL_PATH", "/usr/local/Ascend/mindie/latest/mindie-service")
)
# Documented ranges of the ScheduleConfig fields autotune writes (reference/engines.md).
FIELD_RANGES = {
    "maxBatchSize": (1, 5000),
    "maxPrefillBatchSize": (1, 5000),
    "maxPrefillTokens": (1, 1 << 20),
    "prefillTimeMsPerReq": (0, 1000),
    "decodeTimeMsPerReq": (0, 1000),
}


class MindIESettings(RunnerSettings):
    install_dir: Path = DEFAULT_INSTALL
    config_env: str = "MIES_CONFIG_JSON_PATH"


def _merge(into: dict[str, Any], piece: dict[str, Any]) -> None:
    for key, value in piece.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


class MindIERunner(ServedRunner):
    name = "mindie"
    engine = "mindie"
    settings_model = MindIESettings
    settings: MindIESettings

    def quality_unmeasurable(self) -> str | None:
        # The figure is read from prompt_logprobs, a vLLM extension of the OpenAI API that
        # MindIE's OpenAI-compatible API does not document (unverified on a real MindIE).
        return (
            "the mindie runner measures no quality (its OpenAI-compatible API returns no "
            "prompt_logprobs, the vLLM extension the figure is read from)"
        )

    def __init__(self, settings: MindIESettings, hardware: str | None = None):
        super().__init__(settings, hardware)
        self.installed_config = settings.install_dir / "conf" / "config.json"
        try:
            self.base = json.loads(self.installed_config.read_text(encoding="utf-8"))
        except OSError as error:
            raise InputError(
                f"install_dir (default $MIES_INSTALL_PATH): cannot read {self.installed_config}: "
                f"{error.strerror}; set install_dir in --runner-config or MIES_INSTALL_PATH"
            ) from None
        except ValueError as error:
            raise InputError(f"{self.installed_config}: not valid JSON: {error}") from None
        defaults: dict[str, Any] = {}
        if not settings.engine_cmd:
            defaults["engine_cmd"] = [str(settings.install_dir / "bin" / "mindieservice_daemon")]
        # The installation's own model serves bf16 and lends its tokenizer.
        if settings.model is None:
            installed = self._deploy(self.base).get("ModelConfig", [{}])[0].get("modelWeightPath")
            defaults["model"] = Path(installed) if installed else None
        self.settings = settings.model_copy(update=defaults)

    def assumptions(self) -> dict[str, Any]:
        """Its settings, the installation's version file (MindIE Service's `version`, or
        `version.info` as MindIE LLM names it) and a hash of the installed config.json's
        content, whose fields beside the knobs reach every trial's copy."""
        version = version_file(self.settings.install_dir, ("version", "version.info"))
        canonical = json.dumps(self.base, sort_keys=True).encode()
        digest = hashlib.sha256(canonical).hexdigest()[:16]
        return super().assumptions() | {
            **({"engine version": version} if version else {}),
            "installed config.json sha256": digest,
        }

    @staticmethod
    def _deploy(config: dict) -> dict:
        return config.get("BackendConfig", config).get("ModelDeployConfig", {})

    def adapt(self, space: SearchSpace) -> SearchSpace:
        return self.limit_to_weights(
            space, "MindIE loads quantized weights made offline: give them under `weights:`"
        )

    def render_config(
        self, native: dict[str, Any], ports: tuple[int, int, int], workload_max: tuple[int, int]
    ) -> dict:
        """The trial's config.json: the installed one with the knobs' native form
        (`render("mindie", ...)`) and this trial's ports and sizes written in."""
        rendered = copy.deepcopy(self.base)
        # MindIE >= 1.0 nests ScheduleConfig and ModelDeployConfig under BackendConfig; older
        # ones do not.
        nested = "BackendConfig" in rendered or "ScheduleConfig" not in rendered
        backend = rendered.setdefault("BackendConfig", {}) if nested else rendered
        schedule = native.get("config", {}).get("ScheduleConfig", {})
        for name, value in schedule.items():
            low, high = FIELD_RANGES.get(name, (None, None))
            if low is not None and not low <= value <= high:
                raise InputError(
                    f"ScheduleConfig.{name}: {value} is outside MindIE's range {low}..{high}"
                )
        _merge(backend.setdefault("ScheduleConfig", {}), schedule)
        deploy = backend.setdefault("ModelDeployConfig", {})
        deploy.update(mindie_model_deploy(*workload_max))
        models = deploy.setdefault("ModelConfig", [{}])
        models[0]["modelName"] = SERVED_NAME
        models[0]["modelWeightPath"] = str(self.weights_for(native.get("weights", "bf16")))
        models[0].update(native.get("model_config", {}))
        server = rendered.setdefault("ServerConfig", {})
        server.update(
            {
                "ipAddress": "127.0.0.1",
                "port": ports[0],
                "managementPort": ports[1],
                "metricsPort": ports[2],
                "httpsEnabled": False,
            }
        )
        return rendered

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        return violations("mindie", config, workload)

    def launch(
        self, config: dict[str, Any], port: int, trial_dir: Path, workload: Workload
    ) -> Launch:
        ports = (port, choose_port(None), choose_port(None))
        native = render("mindie", config)
        rendered = self.render_config(
            native, ports, (workload.longest_prompt, workload.longest_request)
        )
        path = trial_dir / "config.json"
        path.write_text(json.dumps(rendered, indent=2), encoding="utf-8")
        env = dict(native.get("env", {}))
        env[self.settings.config_env] = str(path)
        log = trial_dir / "engine.log"
        ready = log_line_ready(log, READY_LINE, http_ready(f"http://127.0.0.1:{port}/health"))
        return Launch(
            argv=[*self.engine_command(), *self.settings.extra_args],
            env=env,
            ready=ready,
            model=SERVED_NAME,
        )
