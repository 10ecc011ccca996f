"""The `llamacpp` runner: llama.cpp's `llama-server`, one GGUF per weights precision.

autotune takes a HF model directory and prepares the GGUF variants once (convert_hf_to_gguf.py
to BF16, then llama-quantize), cached by the model's content so every trial reuses them.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import Field, PositiveFloat

from objectives.quality import QualityFigure
from objectives.scenario import Workload
from objectives.userfile import InputError
from runners.base import Session
from runners.engines.process import EngineFailed
from runners.engines.served import (
    SERVED_NAME,
    Launch,
    RunnerSettings,
    ServedRunner,
    special_token_bias,
)
from runners.engines.versions import program_version
from runners.quality import QualityUnavailable, model_key
from runners.quality.llamacpp import PerplexityQuality
from search_spaces.engines import llamacpp_args, violations
from search_spaces.knobs import LLAMACPP_GGUF_TYPES

# Runs convert_hf_to_gguf.py in-process so a tokenizer it does not know by hash can be told
# which pre-tokenizer it follows; arguments come as argv, never pasted into code.
_CONVERT = """
import importlib.util, os, sys
script, pre = sys.argv[1], sys.argv[2]
folder = os.path.dirname(os.path.abspath(script))
sys.path[:0] = [folder, os.path.join(folder, "gguf-py")]
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
convert = importlib.util.module_from_spec(spec)
sys.modules["convert_hf_to_gguf"] = convert
spec.loader.exec_module(convert)
if pre:
    text_model = getattr(convert, "TextModel", None) or __import__(
        "conversion.base", fromlist=["TextModel"]
    ).TextModel
    text_model.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [script, *sys.argv[3:]]
convert.main()
"""


class LlamaCppSettings(RunnerSettings):
    quantize_cmd: Path | None = None  # default: llama-quantize beside llama-server
    convert_script: Path | None = None  # default: convert_hf_to_gguf.py in the folder above bin/
    # a Python with torch, safetensors, numpy; default: autotune's
    convert_python: Path | None = None
    # force convert_hf_to_gguf's pre-tokenizer (a custom tokenizer)
    pre_tokenizer: str | None = None
    gguf_cache: Path = Path.home() / ".cache" / "autotune" / "gguf"
    # -t; 1 makes runs repeat within ~1% on a busy CPU
    threads: int | None = Field(default=None, ge=1)
    # -fa on: quantized V caches need it; kept on so KV type is the only change
    flash_attention: bool = True
    # llama-perplexity (the quality figure); default: beside llama-server
    perplexity_cmd: Path | None = None
    # one llama-perplexity run (a 7B model on a CPU takes minutes)
    quality_timeout_s: PositiveFloat = 1800.0


def _run_step(argv: list[str], what: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise EngineFailed("start", f"{what} failed (exit {done.returncode}): {' | '.join(last)}")


class LlamaCppRunner(ServedRunner):
    name = "llamacpp"
    engine = "llamacpp"
    settings_model = LlamaCppSettings
    settings: LlamaCppSettings

    def __init__(self, settings: LlamaCppSettings, hardware: str | None = None):
        super().__init__(settings, hardware)
        self.require_command_and_model("the path of llama-server")
        server = Path(self.engine_command()[0])
        model = self.model_dir()
        self.quantize_cmd = settings.quantize_cmd or server.with_name("llama-quantize")
        self.convert_script = (
            settings.convert_script or server.parent.parent / "convert_hf_to_gguf.py"
        )
        self.cache = settings.gguf_cache / f"{model.name}-{model_key(model)}"
        self.perplexity_cmd = settings.perplexity_cmd or server.with_name("llama-perplexity")
        if not (self.cache / "BF16.gguf").exists() and not self.convert_script.is_file():
            raise InputError(
                f"convert_script: {self.convert_script} not found; give the path of llama.cpp's "
                "convert_hf_to_gguf.py in --runner-config"
            )

    def assumptions(self) -> dict[str, Any]:
        """Its settings and the engine's own version (`llama-server --version`: a rebuilt
        engine measures otherwise under the same settings)."""
        version = program_version(self.engine_command()[0])
        return super().assumptions() | ({"engine version": version} if version else {})

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        return violations("llamacpp", config, workload)

    def engine_args(self, config: dict[str, Any], workload: Workload) -> list[str]:
        return llamacpp_args(
            config,
            workload,
            self.settings.flash_attention,
            self.settings.threads,
            self.settings.extra_args,
        )

    def measure_quality(
        self, config: dict[str, Any], session: Session, eval_prompts: list[str]
    ) -> QualityFigure:
        """llama-perplexity's KL divergence beside the server (runners/quality/llamacpp.py); the
        session is not used: the tool loads the config's GGUF itself."""
        return self._perplexity().measure(config, eval_prompts)

    def prepare_quality(self, config: dict[str, Any], eval_prompts: list[str]) -> None:
        self._perplexity().reference(eval_prompts)

    def _perplexity(self) -> PerplexityQuality:
        if not self.perplexity_cmd.is_file():
            raise QualityUnavailable(
                f"perplexity_cmd: {self.perplexity_cmd} not found; build llama.cpp's "
                "llama-perplexity (.ci/setup-engines does) or give its path in --runner-config"
            )
        return PerplexityQuality(self, self.perplexity_cmd, self.settings.quality_timeout_s)

    def gguf(self, precision: str) -> Path:
        """The model's GGUF for a precision, made on first use (one process at a time)."""
        kind = LLAMACPP_GGUF_TYPES[precision]
        target = self.cache / f"{kind}.gguf"
        if target.exists():
            return target
        self.cache.mkdir(parents=True, exist_ok=True)
        with open(self.cache / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            base = self.cache / "BF16.gguf"
            if not base.exists():
                self._convert(base)
            if not target.exists():
                partial = target.with_suffix(".partial")
                _run_step(
                    [str(self.quantize_cmd), str(base), str(partial), kind],
                    f"llama-quantize to {kind}",
                )
                os.replace(partial, target)
        return target

    def _convert(self, out: Path) -> None:
        partial = out.with_suffix(".partial")
        python = str(self.settings.convert_python or sys.executable)
        argv = [
            python,
            "-c",
            _CONVERT,
            str(self.convert_script),
            self.settings.pre_tokenizer or "",
            str(self.settings.model),
            "--outfile",
            str(partial),
            "--outtype",
            "bf16",
        ]
        _run_step(argv, f"converting {self.settings.model} to GGUF")
        os.replace(partial, out)

    def launch(
        self, config: dict[str, Any], port: int, trial_dir: Path, workload: Workload
    ) -> Launch:
        gguf = self.gguf(config.get("quantization", "bf16"))
        argv = [
            *self.engine_command(),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--alias",
            SERVED_NAME,
            "--metrics",
            # Quiet under load: warnings and errors only. Verbosity 3 logs ~0.8 kB per request
            # and 4 (the set-up: file type, KV types, batch sizes) ~2.2 kB; a user who wants the
            # set-up in the log adds `-lv 4` to `extra_args`, which come after and win.
            "-lv",
            "2",
            # No RAM prompt cache: every load sends fresh text, so it never hits, yet each request
            # added its prompt and, at -lv 4, a log line per cached prompt: one batch-1 trial's
            # TTFT p50 rose from 5.7 to 42 ms as it went and its log reached 3 GB (issue 30).
            "--cache-ram",
            "0",
            *self.engine_args(config, workload),
        ]
        return Launch(
            argv=argv,
            model=SERVED_NAME,
            extra_body={"logit_bias": special_token_bias(self.model_dir())},
        )
