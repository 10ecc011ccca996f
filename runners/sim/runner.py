"""The `sim` runner: the simulator behind the Runner interface."""

from __future__ import annotations

from typing import Any

from objectives.scenario import SLA, Workload
from runners.measurement import Fault, Measurement
from runners.sim.costs import CostModel
from runners.sim.engine import Scheduler, Simulation
from runners.sim.profiles import load_hardware, load_model
from runners.workload import make_requests
from search_spaces.space import SearchSpace
from tuner.userfile import InputError

SIM_ENGINES = ("mindie", "vllm")  # the schedulers the simulator reproduces
DEFAULTS = {  # MindIE's defaults for knobs a search space leaves out
    "batch_size": 200,
    "select_batch": "prefill-first",
    "max_prefill_tokens": 8192,
    "quantization": "bf16",
    "kv_compression": 1.0,
    "max_prefill_batch_size": 50,
    "prefill_time_ms_per_req": 150,
    "decode_time_ms_per_req": 50,
}


class SimRunner:
    name = "sim"

    def __init__(self, engine: str = "mindie", model: str = "qwen2-7b", hardware: str = "ascend-910b2"):
        if engine not in SIM_ENGINES:
            raise InputError(f"--engine: unknown engine {engine!r}; the simulator knows: {', '.join(SIM_ENGINES)}")
        self.engine = engine
        self.model = load_model(model)
        self.hardware = load_hardware(hardware)

    def identity(self) -> dict[str, str]:
        return {"runner": self.name, "engine": self.engine, "model": self.model.name, "hardware": self.hardware.name}

    def adapt(self, space: SearchSpace) -> SearchSpace:
        return space  # the simulator runs every knob value

    def _cost(self, config: dict[str, Any]) -> CostModel:
        return CostModel(self.model, self.hardware, config["quantization"], float(config["kv_compression"]))

    def _scheduler(self, config: dict[str, Any]) -> Scheduler:
        decode_first = config["select_batch"] == "decode-first"
        if self.engine == "vllm":
            policy = "chunked" if decode_first else "prefill-first"
            prefill_batch = config["batch_size"]
        else:
            policy = "select-batch" if decode_first else "prefill-first"
            prefill_batch = config["max_prefill_batch_size"]
        return Scheduler(
            policy=policy,
            max_batch=config["batch_size"],
            max_prefill_tokens=config["max_prefill_tokens"],
            max_prefill_batch=prefill_batch,
            prefill_ms_per_req=config["prefill_time_ms_per_req"],
            decode_ms_per_req=config["decode_time_ms_per_req"],
        )

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        config = DEFAULTS | config
        cost = self._cost(config)
        capacity = cost.kv_capacity_tokens(config["max_prefill_tokens"])
        if capacity <= 0:
            return [
                f"{config['quantization']} weights ({cost.weight_bytes / 1e9:.1f} GB) and activations for "
                f"{config['max_prefill_tokens']} tokens leave no memory for a KV cache on {self.hardware.name}"
            ]
        block = self.hardware.kv_block_tokens
        blocks = capacity // block
        if blocks * block < workload.longest_request:
            return [f"KV cache holds {blocks * block} tokens; the longest request needs {workload.longest_request}"]
        return []

    def run(self, config: dict[str, Any], workload: Workload, sla: SLA | None = None) -> Measurement:
        config = DEFAULTS | config
        reasons = self.violations(config, workload)
        if reasons:
            return Measurement.failed(Fault("infeasible", "; ".join(reasons)))
        cost = self._cost(config)
        block = self.hardware.kv_block_tokens
        sim = Simulation(cost, self._scheduler(config), make_requests(workload),
                         cost.kv_capacity_tokens(config["max_prefill_tokens"]) // block, block)
        return sim.run()
