"""The engine-native forms of a deployment on a chip budget (`autotune --chips N`; see
search_spaces.deployment): one engine instance per chip, a router in front.

- co-located: each engine's single-instance form (tuner.export) stays as it is, with
  `replicas: N` and the router that sends requests to the replicas in turn;
- disaggregated: each engine that can run it gets the deployment form *in place of* the
  single-instance form: a prefill and a decode instance group, each with the settings its
  servers run with (`role_config`), its instance count and its memory share, and the router.
  The single-instance form is left out on purpose: no server of the deployment runs the whole
  config (prefill servers run their own batch size and never decode; decode servers run no
  prefill), so an operator who deployed it would get a co-located server that was never
  measured. An engine with no prefill/decode disaggregation says so in `not_expressible`.

The simulator routes round-robin on both roles (runners/sim/router.py), as vLLM's toy proxy
does; MindIE's coordinator balances by load instead (said in its form).
"""

from __future__ import annotations

import json
from typing import Any

from objectives.scenario import Workload
from search_spaces.deployment import memory_share, role_config, roles
from search_spaces.engines import mindie_model_deploy, violations, vllm_args
from search_spaces.knobs import ENGINES, KNOBS, render

ROLES = ("prefill", "decode")
ROUTER_POLICY = "round-robin"

# vLLM: the connector for GPU-to-GPU KV transfers (NIXL). With NixlConnector, kv_role is a
# placeholder: the proxy decides which instance prefills (docs/features/nixl_connector_usage.md).
GPU_KV_CONNECTOR = "NixlConnector"
KV_TRANSFER_CONFIG = {"kv_connector": GPU_KV_CONNECTOR, "kv_role": "kv_both"}
# vLLM's proxy for NixlConnector (round-robin on both roles, itertools.cycle; it hands the
# prefill's kv_transfer_params to the decode request). The example
# examples/online_serving/disaggregated_serving/disagg_proxy_demo.py is not it: it balances by
# load unless --roundrobin, and does not pass kv_transfer_params.
VLLM_PROXY = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"


def replicated(form: dict[str, Any], chips: int) -> dict[str, Any]:
    """A co-located config on `chips` chips: the single-instance form, once per chip."""
    if "not_expressible" in form:
        return form
    return form | {
        "replicas": chips,
        "router": {
            "policy": ROUTER_POLICY,
            "note": (
                f"any HTTP load balancer sending requests to the {chips} replicas in turn "
                "(e.g. an nginx upstream, round-robin by default): the simulator measured "
                "that policy"
            ),
        },
    }


def _share(config: dict[str, Any], role: str) -> float:
    return round(memory_share(config, role), 4)


def _mindie(config: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """MindIE's PD separation as its Kubernetes deploy scripts take it (MindIE-Motor / MindIE-MS,
    examples/kubernetes_deploy_scripts/conf): user_config.json (instance counts, the controller
    in pd_separate mode, each role's config.json) and mindie_env.json (each role's environment,
    NPU_MEMORY_FRACTION its memory share); then the same deployment in the compute_units form.
    Names checked against MindIE's documentation and deploy scripts: deploy_config's
    p_instances_num, d_instances_num, single_p_instance_pod_num, single_d_instance_pod_num,
    p_pod_npu_num, d_pod_npu_num; deploy_mode "pd_separate", default_p_rate, default_d_rate
    (ms_controller.json; 0 would let MindIE pick its own ratio, so the tuned counts are set);
    mindie_server_prefill_config / mindie_server_decode_config; ServerConfig inferMode "dmi"
    (the PD-separated mode); mindie_server_prefill_env / mindie_server_decode_env;
    NPU_MEMORY_FRACTION. Not checked: that the controller settings are read from
    user_config.json's mindie_ms_controller_config on every MindIE version (older ones read
    ms_controller.json directly: set the same fields there), and that one NPU per pod
    (p_pod_npu_num 1) is accepted by every version's scripts."""
    counts = roles(config)
    user_config: dict[str, Any] = {
        "deploy_config": {
            "p_instances_num": counts.prefill,
            "d_instances_num": counts.decode,
            "single_p_instance_pod_num": 1,
            "single_d_instance_pod_num": 1,
            "p_pod_npu_num": 1,  # one chip per instance
            "d_pod_npu_num": 1,
        },
        "mindie_ms_controller_config": {
            "deploy_mode": "pd_separate",
            "default_p_rate": counts.prefill,
            "default_d_rate": counts.decode,
        },
    }
    env_json: dict[str, Any] = {}
    precision = "bf16"
    for role in ROLES:
        native = render("mindie", role_config(config, role))
        precision = native.get("weights", precision)
        user_config[f"mindie_server_{role}_config"] = {
            "ServerConfig": {"inferMode": "dmi"},
            "BackendConfig": {
                "ModelDeployConfig": mindie_model_deploy(
                    workload.longest_prompt, workload.longest_request
                ),
                "ScheduleConfig": native.get("config", {}).get("ScheduleConfig", {}),
            },
        }
        env_json[f"mindie_server_{role}_env"] = native.get("env", {}) | {
            "NPU_MEMORY_FRACTION": _share(config, role)
        }
    return {
        "user_config_json": user_config,
        "mindie_env_json": env_json,
        "weights_precision": precision,
        "compute_units": {
            role: {
                "npu_count": getattr(counts, role),
                "memory_allocation": f"{_share(config, role) * 100:g}%",
            }
            for role in ROLES
        },
        "router": {
            "component": "MindIE-MS Coordinator",
            "policy": "MindIE balances by load; the simulator measured round-robin",
        },
    }


def _vllm(
    config: dict[str, Any], workload: Workload, ran: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """Each role's `vllm serve` arguments (its knobs, its memory share, the GPU KV connector),
    the instance counts, and vLLM's proxy in front of them with its arguments; for a trial that
    ran on vLLM, each role's arguments as it ran them (its connector and extra arguments)."""
    counts = roles(config)
    transfer = json.dumps(KV_TRANSFER_CONFIG, separators=(",", ":"))
    form: dict[str, Any] = {}
    for role in ROLES:
        form[role] = {
            "instances": getattr(counts, role),
            "serve_args": vllm_args(
                role_config(config, role),
                workload,
                extra=[
                    "--gpu-memory-utilization",
                    f"{_share(config, role):g}",
                    "--kv-transfer-config",
                    transfer,
                ],
            ),
        }
        if ran is not None and ran.get(role):
            form[role]["trial_serve_args"] = ran[role]

    def where(role: str, kind: str) -> list[str]:
        # Placeholders a shell expands: host and port are the deployer's (as in `serve_args`).
        return [f"${{{role.upper()}_{kind}_{i}}}" for i in range(1, getattr(counts, role) + 1)]

    form["weights_precision"] = config.get("quantization", "bf16")
    form["env"] = {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "one per instance, distinct among those on one host "
        "(default 5600)",
    }
    form["router"] = {
        "script": f"{VLLM_PROXY} (vLLM's repository)",
        "policy": ROUTER_POLICY,
        "args": [
            "--prefiller-hosts",
            *where("prefill", "HOST"),
            "--prefiller-ports",
            *where("prefill", "PORT"),
            "--decoder-hosts",
            *where("decode", "HOST"),
            "--decoder-ports",
            *where("decode", "PORT"),
        ],
    }
    return form


_PD_FORMS = {"mindie": _mindie, "vllm": _vllm}


def pd_forms(
    config: dict[str, Any], workload: Workload, ran: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """The deployment form of a disaggregated config per engine, or why an engine cannot run it:
    no disaggregation at all, or a role's servers it would refuse to start. `ran`: each role's
    arguments as a real vLLM trial ran them (kept beside the deployment's own)."""
    forms: dict[str, Any] = {}
    for engine in ENGINES:
        form = _PD_FORMS.get(engine)
        if form is None or engine not in KNOBS["deployment"].render:
            forms[engine] = {
                "not_expressible": f"{engine} has no prefill/decode disaggregation "
                "(no KV-cache transfer between servers)"
            }
            continue
        refused = [
            f"{role} instances: {reason}"
            for role in ROLES
            for reason in violations(engine, role_config(config, role), workload)
        ]
        try:
            forms[engine] = (
                {"not_expressible": "; ".join(refused)}
                if refused
                else _vllm(config, workload, ran)
                if engine == "vllm"
                else form(config, workload)
            )
        except ValueError as error:  # a knob value the engine has no setting for
            forms[engine] = {"not_expressible": str(error)}
    return forms
