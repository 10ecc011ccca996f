"""What every real-engine runner shares: its settings file, and one trial's life
(render -> start -> ready -> load -> stop -> Measurement). Adapters only say how to launch.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat

from objectives.quality import QUANTIZATIONS, Quantization
from objectives.scenario import SLA, Workload
from objectives.userfile import InputError, load_yaml, read_text
from runners.base import FailedSession, Session, run_once
from runners.engines.process import EngineFailed, EngineProcess, choose_port, http_ready, tail
from runners.load.loadgen import RejectionRule, Target, drive
from runners.load.measurement import Fault, Measurement
from runners.load.prompts import PromptMaker, load_tokenizer
from runners.load.workload import Requests
from runners.sim.router import replica_requests
from search_spaces.space import SearchSpace

_trial_seq = itertools.count()
SERVED_NAME = "autotune-model"  # the model name engines started by autotune serve under


def special_token_bias(model_dir: Path) -> dict[str, int]:
    """logit_bias pushing special tokens away: a random-weight model would otherwise emit them
    as empty text; with it every output token is visible text. Harmless on a trained model."""
    try:
        data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {
        str(token["id"]): -100 for token in data.get("added_tokens", []) if token.get("special")
    }


class RunnerSettings(BaseModel):
    """The `--runner-config` file. Flags (--engine-cmd, --model, --hardware) override it."""

    model_config = ConfigDict(extra="forbid")

    engine_cmd: list[str] | None = None  # the engine's argv prefix; flags and the model follow
    model: Path | None = None  # HF model directory (weights, config, tokenizer)
    weights: dict[Quantization, Path] = Field(default_factory=dict)  # precision -> weights dir
    tokenizer: Path | None = None  # default: the model directory
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    port: int | None = Field(default=None, ge=1, le=65535)  # preferred; a taken one is replaced
    hardware: str | None = None  # a label naming the machine in study names
    ready_timeout_s: PositiveFloat = 600.0
    request_timeout_s: PositiveFloat = 120.0
    stop_grace_s: PositiveFloat = 10.0
    warmup_requests: int = Field(default=2, ge=0)
    log_dir: Path = Path("autotune-logs")
    # The reference config's measured distributions (the quality figure's baseline), per model
    # and engine.
    quality_cache: Path = Path.home() / ".cache" / "autotune" / "quality"


# RunnerSettings fields that change nothing a trial measures (a study's workers on several
# hosts may differ in them).
NOT_MEASURING = (
    "port", "hardware", "ready_timeout_s", "request_timeout_s", "stop_grace_s", "log_dir",
    "quality_cache",
)  # fmt: skip


def load_settings(
    settings_cls: type[RunnerSettings], path: Path | None, **flags: Any
) -> RunnerSettings:
    settings = settings_cls() if path is None else load_yaml(path, settings_cls)
    given = {key: value for key, value in flags.items() if value is not None}
    return settings.model_copy(update=given)


@dataclass
class Launch:
    """How to start the engine for one config."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready: Callable[[], bool] | None = None  # default: GET /health answers 200
    model: str = ""  # the `model` field requests carry; empty: ask the server once it is ready
    base_url: str | None = None  # a server already running: nothing to start
    extra_body: dict[str, Any] = field(default_factory=dict)


class ServedRunner:
    """Base of the real-engine runners: subclasses set name/engine and implement `launch`."""

    name = "served"
    engine = "vllm"
    settings_model: type[RunnerSettings] = RunnerSettings

    def __init__(self, settings: RunnerSettings, hardware: str | None = None):
        self.settings = settings
        self.hardware = settings.hardware or hardware or socket.gethostname()
        self._prompts: dict[tuple[str, int, int], tuple[list[str], list[str]]] = {}
        self._prompt_maker: PromptMaker | None = None
        self._warmup: list[str] = []

    # -- what adapters provide ------------------------------------------------------------
    def launch(
        self, config: dict[str, Any], port: int, trial_dir: Path, workload: Workload
    ) -> Launch:
        raise NotImplementedError

    def model_name(self) -> str:
        return self.settings.model.name if self.settings.model else "served"

    def tokenizer_dir(self) -> Path:
        path = self.settings.tokenizer or self.settings.model
        if path is None:
            raise InputError(
                f"--model: the {self.name} runner needs a HF model directory "
                "(or `tokenizer:` in --runner-config)"
            )
        return path

    def served_model(self, base_url: str) -> str:
        return self.model_name()

    def engine_command(self) -> list[str]:
        """The engine's argv prefix: runners that start an engine made sure of it when made."""
        if not self.settings.engine_cmd:
            raise InputError(
                f"--engine-cmd: the {self.name} runner needs an engine command "
                "(or `engine_cmd:` in --runner-config)"
            )
        return self.settings.engine_cmd

    def model_dir(self) -> Path:
        """The HF model directory: runners that need one made sure of it when made."""
        if self.settings.model is None:
            raise InputError(f"--model: the {self.name} runner needs a HF model directory")
        return self.settings.model

    def require_command_and_model(self, command: str) -> None:
        if not self.settings.engine_cmd:
            raise InputError(
                f"--engine-cmd: the {self.name} runner needs {command} "
                "(or `engine_cmd:` in --runner-config)"
            )
        program = self.settings.engine_cmd[0]
        if shutil.which(program) is None:
            raise InputError(
                f"--engine-cmd: {program} is neither an executable file nor a command on PATH"
            )
        model = self.settings.model
        if model is None or not model.is_dir():
            raise InputError(
                f"--model: {model} is not a directory; "
                f"the {self.name} runner needs a HF model directory"
            )
        if not (model / "config.json").is_file():
            raise InputError(
                f"--model: {model} has no config.json; "
                f"the {self.name} runner needs a HF model directory"
            )

    def _loaded_prompt_maker(self) -> PromptMaker:
        """What makes every load's prompts, with the model's tokenizer: loaded (and checked)
        on first use."""
        if self._prompt_maker is None:
            source = "tokenizer" if self.settings.tokenizer else "--model"
            self._prompt_maker = PromptMaker(load_tokenizer(self.tokenizer_dir(), source), source)
            self._warmup = self._prompt_maker.make([16] * self.settings.warmup_requests, 1_000_003)
        return self._prompt_maker

    def check_inputs(self) -> None:
        """The tokenizer every load needs: loaded (and checked) once, before any study is
        written."""
        self._loaded_prompt_maker()

    def tokenizer(self) -> Any:
        """The model's tokenizer (the one every load's prompts are made with)."""
        return self._loaded_prompt_maker().tokenizer

    def quality_unmeasurable(self) -> str | None:
        """Why this runner cannot measure quality in any trial, known before a study (None: it
        can try; a pair it then fails to measure falls back to the quality table)."""
        return None

    def measure_quality(self, config: dict[str, Any], session: Session, eval_prompts: list[str]):
        """The config's QualityFigure, measured in its running session against the reference
        config (bf16 weights, KV 1.0); raises runners.quality.QualityUnavailable with the reason."""
        from runners.quality.logprob import measure_by_prompt_logprobs

        return measure_by_prompt_logprobs(self, config, session, eval_prompts)

    def prepare_quality(self, config: dict[str, Any], eval_prompts: list[str]) -> None:
        """Measure and keep the reference now, while no trial's engine runs (measure_quality
        otherwise starts it beside the trial's: two engines on one accelerator may not fit)."""
        from runners.quality.logprob import ensure_reference

        ensure_reference(self, config, eval_prompts)

    def max_context(self) -> tuple[int | None, str]:
        """The model's context (max_position_embeddings of its config.json), when it says."""
        model = self.settings.model
        if model is None or not (model / "config.json").is_file():
            return None, self.model_name()
        try:
            config = json.loads(read_text(model / "config.json", "model config"))
        except ValueError as error:
            raise InputError(f"--model: {model / 'config.json'}: not valid JSON: {error}") from None
        limit = config.get("max_position_embeddings") if isinstance(config, dict) else None
        context = int(limit) if isinstance(limit, (int, float)) and limit > 0 else None
        return context, self.model_name()

    native_precisions: tuple[str, ...] = ("bf16",)  # served straight from the model directory

    def weights_for(self, precision: str) -> Path | None:
        if precision in self.settings.weights:
            return self.settings.weights[precision]
        return self.settings.model if precision in self.native_precisions else None

    def limit_to_weights(self, space: SearchSpace, why: str) -> SearchSpace:
        have = [precision for precision in QUANTIZATIONS if self.weights_for(precision) is not None]
        return space.restrict("quantization", have, why)

    def adapt(self, space: SearchSpace) -> SearchSpace:
        """Narrow the space to what this installation can run (e.g. precisions with weights)."""
        return space

    def batch_ceiling(self, space: SearchSpace, workload: Workload) -> tuple[int, str] | None:
        # The engine sizes its KV cache when it starts; before that the preset's range stands.
        return None

    # -- the Runner interface -------------------------------------------------------------
    def assumptions(self) -> dict[str, Any]:
        """The settings that change what a trial measures (the engine, its arguments and
        environment, threads): not where it listens, logs or waits, nor where files lie
        (workers on several hosts share a study, each with its own paths)."""
        settings = self.settings
        dumped = settings.model_dump(mode="json")
        kept = {
            name: dumped[name]
            for name, field in type(settings).model_fields.items()
            if name not in NOT_MEASURING and "Path" not in str(field.annotation)
        }
        if kept.get("engine_cmd"):  # the program, wherever it is installed
            kept["engine_cmd"] = [Path(kept["engine_cmd"][0]).name, *kept["engine_cmd"][1:]]
        return {"runner settings": kept}

    def identity(self) -> dict[str, str]:
        identity = {
            "runner": self.name,
            "engine": self.engine,
            "model": self.model_name(),
            "hardware": self.hardware,
        }
        if self.settings.model is not None:  # where `autotune calibrate` finds the model's shapes
            identity["model_path"] = str(self.settings.model.resolve())
        return identity

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        return []

    def engine_args(self, config: dict[str, Any], workload: Workload) -> list[str] | None:
        # None: an engine not started from an argument list (MindIE's config.json, a template)
        return None

    def _target(self, launch: Launch, base_url: str) -> Target:
        model = launch.model or self.served_model(base_url)
        return Target(base_url, model, launch.extra_body, self.settings.request_timeout_s)

    def load_for(
        self, workload: Workload, variant: int = 0, replicas: int = 1
    ) -> tuple[Requests, list[str], list[str]]:
        """The workload's requests, their prompts and the warm-up prompts. Prompts depend on the
        request lengths and the variant, not the rate: each step of a search sends other text of
        the same lengths, so no engine serves a step from its prefix cache (but for the
        workload's shared prefixes, the same text in every step). `replicas`: one
        replica's share of that many (runners.sim.router.replica_requests). With sessions,
        the histories that sessions in progress bring warm the engine after the warm-up
        prompts, the next needed last (the most recently used of an LRU cache)."""
        prompt_maker = self._loaded_prompt_maker()
        requests = replica_requests(workload, replicas)
        # A plan of sessions depends on the rate (runners.load.sessions): its prompts too.
        rate_free = {"arrival"} if workload.sessions is None else set()
        key = (workload.model_dump_json(exclude=rate_free), variant, replicas)
        if key not in self._prompts:
            seed = workload.seed + 7919 * variant
            histories = prompt_maker.session_histories(requests, seed)
            prompts = prompt_maker.for_requests(
                requests, seed, prefix_seed=workload.seed + 104729, histories=histories
            )
            warm = [histories[request] for request in sorted(histories, reverse=True)]
            self._prompts[key] = (prompts, warm)
        prompts, warm = self._prompts[key]
        return requests, prompts, self._warmup + warm

    def replicas_for(self, config: dict[str, Any]) -> int:
        return 1  # how many co-located replicas (a chip budget's) the config's engine is one of

    def new_trial_dir(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        trial_dir = self.settings.log_dir / f"{stamp}-{os.getpid()}-{next(_trial_seq)}-{self.name}"
        trial_dir.mkdir(parents=True, exist_ok=True)
        return trial_dir

    @contextmanager
    def session(self, config: dict[str, Any], workload: Workload) -> Iterator[Session]:
        """Start the engine once for the config; it never outlives this block."""
        reasons = self.violations(config, workload)
        if reasons:  # the engine would refuse it: no need to start one to learn that
            yield FailedSession(Fault("infeasible", "; ".join(reasons)))
            return
        trial_dir = self.new_trial_dir()
        replicas = self.replicas_for(config)
        extra: dict[str, Any] = {"engine_log": str(trial_dir / "engine.log")}
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = extra["port"] = choose_port(self.settings.port)
            try:
                # May prepare weights (e.g. a GGUF).
                launch = self.launch(config, port, trial_dir, workload)
            except EngineFailed as failure:
                yield FailedSession(Fault(failure.kind, failure.message, failure.log_tail), extra)
                return
            if launch.base_url is not None:
                yield EngineSession(self, launch, launch.base_url, None, trial_dir, extra, replicas)
                return
            engine = EngineProcess(
                launch.argv,
                os.environ | self.settings.env | launch.env,
                trial_dir / "engine.log",
                self.settings.stop_grace_s,
            )
            with engine:
                extra["engine_pid"] = engine.pid
                try:
                    ready = launch.ready or http_ready(f"http://127.0.0.1:{port}/health")
                    extra["start_s"] = engine.wait_ready(ready, self.settings.ready_timeout_s)
                except EngineFailed as failure:
                    if attempt < PORT_ATTEMPTS and _port_taken(failure.log_tail):
                        extra["port_retries"] = attempt
                        continue  # the with block stops this engine first
                    yield FailedSession(
                        Fault(failure.kind, failure.message, failure.log_tail), extra
                    )
                    return
                url = f"http://127.0.0.1:{port}"
                yield EngineSession(self, launch, url, engine, trial_dir, extra, replicas)
                extra["stop_s"] = engine.stop()
                return

    def run(
        self,
        config: dict[str, Any],
        workload: Workload,
        sla: SLA | None = None,
        stop_early: bool = False,
    ) -> Measurement:
        return run_once(self, config, workload, sla, stop_early)


# A free port can be taken between choosing it and the engine binding it (another engine
# starting beside this one): the start is retried on another port, this many times in all.
PORT_ATTEMPTS = 3
_PORT_TAKEN = ("Address already in use", "couldn't bind HTTP server socket")


def _port_taken(log_tail: str | None) -> bool:
    return any(marker in (log_tail or "") for marker in _PORT_TAKEN)


class Served(Protocol):
    """What a session watches: one engine (EngineProcess), or a deployment's processes."""

    def exited(self) -> int | None: ...
    def crashed(self, what: str) -> EngineFailed: ...
    def tail(self, lines: int = 30) -> str: ...


class EngineSession:
    """Loads against one started engine (or a server already running); each with fresh requests.
    `replicas`: the engine is one of that many co-located replicas (each load is per chip)."""

    def __init__(
        self,
        runner: ServedRunner,
        launch: Launch,
        base_url: str,
        engine: Served | None,
        trial_dir: Path,
        extra: dict[str, Any],
        replicas: int = 1,
    ):
        self.runner, self.launch, self.base_url, self.engine = runner, launch, base_url, engine
        self.trial_dir, self.extra = trial_dir, extra
        self.replicas = replicas
        self.target: Target | None = None
        self.loads = 0

    def endpoint(self) -> tuple[str, str]:
        """The server's base URL and the model name its requests carry."""
        if self.target is None:
            self.target = self.runner._target(self.launch, self.base_url)
        return self.base_url, self.target.model

    def _answers(self) -> bool:
        """Any HTTP answer within 2 s: a hung engine gives none (its readiness probe may be a
        log line that stays true, and an OpenAI-compatible server need not have /health)."""
        try:
            httpx.get(f"{self.base_url}/v1/models", timeout=2.0)
        except httpx.HTTPError:
            return False
        return True

    def measure(
        self, workload: Workload, sla: SLA | None = None, stop_early: bool = False
    ) -> Measurement:
        rejection = RejectionRule.of(sla) if stop_early and sla is not None else None
        requests, prompts, warmup = self.runner.load_for(workload, self.loads, self.replicas)
        self.loads += 1
        engine = self.engine
        try:
            if engine is not None and engine.exited() is not None:
                raise engine.crashed("before the load")
            if self.target is None:
                self.target = self.runner._target(self.launch, self.base_url)
            started = time.monotonic()
            try:
                measurement, rejected = drive(self.target, prompts, requests, warmup, rejection)
            except httpx.HTTPError as error:  # the warm-up failed: no request could be served
                if engine is not None and engine.exited() is not None:
                    raise engine.crashed("during warm-up") from None
                raise EngineFailed("error", str(error), engine.tail() if engine else "") from None
            self.extra["load_s"] = self.extra.get("load_s", 0.0) + time.monotonic() - started
            if engine is not None and engine.exited() is not None:
                raise engine.crashed("during the load")
        except EngineFailed as failure:
            return Measurement.failed(Fault(failure.kind, failure.message, failure.log_tail))
        except httpx.HTTPError as error:  # a running server could not be asked for its model
            return Measurement.failed(Fault("error", str(error)))
        if measurement.extra.get("stalled") and not self._answers():
            # Requests stalled and the engine no longer answers its health check: it hangs, and
            # every further load would wait out its timeouts too.
            measurement.fault = Fault(
                "error",
                f"the engine stopped answering: {measurement.extra['first_stall']}",
                engine.tail() if engine is not None else tail(self.trial_dir / "engine.log"),
            )
        elif rejected:
            measurement.fault = Fault("sla-violated", rejected)
        # Failed requests of a live engine (even all of them, refused under overload) are a miss of
        # the success rate, which the capacity search bisects on; the trial says why at the
        # nominal rate.
        return measurement
