"""The simulator passes the runner contract."""

from __future__ import annotations

import pytest

from runners.sim.runner import SimRunner
from tests.runner_contract import RunnerContract


class TestSimMindIE(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def runner(cls):
        return SimRunner(engine="mindie")

    @pytest.fixture(scope="class")
    @classmethod
    def good_config(cls):
        return {
            "batch_size": 16,
            "select_batch": "decode-first",
            "max_prefill_tokens": 4096,
            "quantization": "w8a8",
            "kv_compression": 0.5,
            "max_prefill_batch_size": 8,
        }

    @pytest.fixture(scope="class")
    @classmethod
    def impossible_config(cls):
        # Activations for a million-token prefill step leave no memory for the KV cache.
        return {
            "batch_size": 8,
            "quantization": "bf16",
            "kv_compression": 1.0,
            "max_prefill_tokens": 1 << 20,
        }


class TestSimVLLM(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def runner(cls):
        return SimRunner(engine="vllm", hardware="l40s")

    @pytest.fixture(scope="class")
    @classmethod
    def good_config(cls):
        return {
            "batch_size": 32,
            "select_batch": "decode-first",
            "max_prefill_tokens": 2048,
            "quantization": "bf16",
            "kv_compression": 1.0,
        }

    @pytest.fixture(scope="class")
    @classmethod
    def impossible_config(cls):
        # bf16 weights and activations for 256k tokens overflow an L40S's 48 GB.
        return {
            "batch_size": 8,
            "quantization": "bf16",
            "kv_compression": 1.0,
            "max_prefill_tokens": 1 << 18,
        }
