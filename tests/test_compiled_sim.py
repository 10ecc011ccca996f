"""The simulator's compiled core (setup.py, runners/sim/compiled.py): the same source compiled
and interpreted gives the same result to the bit; a build of other source is not run;
and CI (AUTOTUNE_REQUIRE_COMPILED=1) runs the compiled one, so a build that silently fell back
to plain Python fails there instead of only running slower."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runners.sim import compiled

ROOT = Path(__file__).resolve().parent.parent
BASE = {"max_prefill_tokens": 8192, "quantization": "w8a8", "kv_compression": 1.0}
# Each step policy, the prefix cache, sessions with swap preemption, early rejection.
LOADS = [
    ("customer-service", "mindie", {"batch_size": 300, "select_batch": "decode-first"}, 3.0),
    ("customer-service", "mindie", {"batch_size": 64, "select_batch": "prefill-first"}, 1.0),
    ("code-completion", "vllm", {"batch_size": 256, "select_batch": "decode-first"}, 2.0),
    ("document-summary", "llamacpp", {"batch_size": 8}, 1.0),
    (
        "multi-turn-chat",
        "mindie",
        {"batch_size": 96, "select_batch": "decode-first", "swap_preemptions": 4},
        1.0,
    ),
]


def digests() -> list[str]:
    """Every load's send, first-token and finish times and counters, hashed."""
    from objectives.scenario import load_scenario
    from runners.sim.runner import SimRunner

    out = []
    for name, engine, knobs, multiple in LOADS:
        scenario = load_scenario(name)
        workload = scenario.at_rate(scenario.nominal_rate * multiple)
        workload = workload.model_copy(update={"num_requests": 600})
        measurement = SimRunner(engine=engine).run(BASE | knobs, workload)
        digest = hashlib.sha256()
        for times in (measurement.send_s, measurement.first_token_s, measurement.finish_s):
            digest.update(times.tobytes())
        digest.update(json.dumps(measurement.extra, sort_keys=True, default=str).encode())
        out.append(digest.hexdigest())
    return out


def _in_subprocess(env: dict[str, str], code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=os.environ | env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip().splitlines()[-1]


def test_the_interpreted_source_gives_what_this_process_gives_to_the_bit():
    here = digests()
    code = "import sys; sys.path.insert(0, 'tests'); import test_compiled_sim as t, json; "
    code += "import runners.sim; print(json.dumps([runners.sim.CORE, t.digests()]))"
    core, source = json.loads(_in_subprocess({"AUTOTUNE_PURE_PYTHON": "1"}, code))
    assert core.startswith("source")
    assert source == here


def test_pure_python_imports_every_compiled_module_from_its_source():
    code = "import json, runners.sim.engine as e, runners.sim.disaggregated as d; "
    code += "print(json.dumps([e.__file__, d.__file__]))"
    files = json.loads(_in_subprocess({"AUTOTUNE_PURE_PYTHON": "1"}, code))
    assert [Path(f).name for f in files] == ["engine.py", "disaggregated.py"]


@pytest.mark.skipif(
    not os.environ.get("AUTOTUNE_REQUIRE_COMPILED"), reason="CI sets AUTOTUNE_REQUIRE_COMPILED"
)
def test_ci_runs_the_compiled_simulator():
    import runners.sim.engine

    assert runners.sim.CORE == "compiled"
    assert not runners.sim.engine.__file__.endswith(".py")


def _tree(folder: Path, built: list[str], edited_after: list[str], recorded: bool = True) -> None:
    """Sources of every compiled module, a build of those in `built` (with the record of the
    sources it was built from, unless not `recorded`), and the sources in `edited_after` changed
    since."""
    for name in compiled.COMPILED:
        (folder / f"{name}.py").write_text(f"# {name}\n")
    for name in built:
        (folder / f"{name}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    if built and recorded:
        (folder / compiled.SOURCES).write_text(json.dumps(compiled.source_hashes(folder)))
    for name in edited_after:
        (folder / f"{name}.py").write_text(f"# {name}, edited\n")


@pytest.mark.skipif(
    ".cpython-311-x86_64-linux-gnu.so" not in compiled.importlib.machinery.EXTENSION_SUFFIXES,
    reason="the fake builds are named for CPython 3.11 on x86-64 Linux",
)
@pytest.mark.parametrize(
    "built, edited_after, recorded, expected",
    [
        ([], [], True, []),  # never compiled: the source runs, nothing is stale
        (list(compiled.COMPILED), [], True, []),  # a whole build of this source runs
        (list(compiled.COMPILED), ["engine"], True, ["engine"]),  # engine.py edited since
        (list(compiled.COMPILED)[:-1], [], True, [compiled.COMPILED[-1]]),  # one not built
        (list(compiled.COMPILED), [], False, list(compiled.COMPILED)),  # built from what?
    ],
)
def test_a_build_of_other_source_or_an_incomplete_one_is_stale(
    tmp_path, built, edited_after, recorded, expected
):
    _tree(tmp_path, built, edited_after, recorded)
    assert compiled.stale(compiled.builds(tmp_path), tmp_path) == expected
