"""The HTML report, opened in a real headless Chromium, and a study read by the real
optuna-dashboard 0.21 (its SLA feasibility included)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import optuna
import pytest

from objectives.scoring import is_feasible
from tests.conftest import run_autotune

STUDY = "small-cs.sim.mindie.qwen2-7b.ascend-910b2"
# Chromium's own background traffic off; every name resolves nowhere, so nothing could leave anyway.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--enable-logging=stderr",
    "--v=0",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-default-apps",
    "--disable-extensions",
    "--virtual-time-budget=10000",
]


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory, request) -> Path:
    import yaml

    from tests.conftest import small_scenario

    work = tmp_path_factory.mktemp("report")
    data = small_scenario(requests=200).model_dump(mode="json")
    data["name"] = "small-cs"
    (work / "small.yaml").write_text(yaml.safe_dump(data))
    result = run_autotune("--scenario", "small.yaml", "--trials", "10", cwd=work)
    assert result.returncode == 0, result.stderr
    assert "report: best-config.report.html" in result.stdout
    return work


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("AUTOTUNE_REQUIRE_ENGINES"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium is not installed")
    return found


def test_report_renders_in_headless_chromium_offline(study_dir: Path, tmp_path: Path):
    page = study_dir / "best-config.report.html"
    text = page.read_text()
    assert "http://" not in text.split("<script>")[0] and "<script src=" not in text
    netlog = tmp_path / "net.json"
    shown = subprocess.run(
        [_chromium(), *CHROMIUM_FLAGS, f"--log-net-log={netlog}", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    dom = shown.stdout
    # plotly drew every figure: the Pareto plot, the curves, progress, importance, parallel
    # coordinates
    assert dom.count('class="main-svg"') >= 5 * 2, dom[:500]
    assert "TTFT p99 against throughput" in dom and "Latency against throughput" in dom
    assert "Exported config: trial" in dom
    # The answer leads (the recommended config, its quality, the ladder, the Pareto plot); the raw
    # YAML comes last.
    assert (
        dom.index("recommended")
        < dom.index("Quality ladder")
        < dom.index("TTFT p99 against throughput")
        < dom.index("Exported config: trial")
    )
    console = [line for line in shown.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console  # no error, no warning, nothing logged by the page
    events = json.loads(netlog.read_text())["events"]
    page_requests = {
        e["params"]["url"]
        for e in events
        if str(e.get("params", {}).get("network_isolation_key", "")).startswith("file://")
        and not e["params"].get("url", "file:").startswith("file:")
    }
    assert page_requests == set()
    png = study_dir / "best-config.report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_command_and_its_bad_input(study_dir: Path, tmp_path: Path):
    db = f"sqlite:///{study_dir / 'studies.db'}"
    made = run_autotune("report", "--storage", db, "-o", str(tmp_path / "r.html"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "r.html").stat().st_size > 100_000 and (tmp_path / "r.png").exists()

    def refused(*args: str, expected: str) -> None:
        result = run_autotune("report", *args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, (
            result.stderr
        )

    refused(
        "--storage",
        db,
        "--study",
        "nope",
        "-o",
        str(tmp_path / "x.html"),
        expected="no study 'nope'",
    )
    refused(
        "--storage",
        f"sqlite:///{tmp_path / 'none.db'}",
        "-o",
        str(tmp_path / "x.html"),
        expected="no database at",
    )
    assert not (tmp_path / "none.db").exists()
    refused("--storage", db, "-o", str(tmp_path / "missing" / "x.html"), expected="-o: directory")
    refused("--storage", db, "-o", "/proc/x.html", expected="-o: cannot write in /proc")
    refused("--storage", db, "-o", str(study_dir / "studies.db"), expected="is the --storage file")
    assert not (tmp_path / "x.html").exists()

    # A study whose every trial failed has nothing to report.
    (tmp_path / "huge.yaml").write_text("knobs:\n  max_prefill_tokens: {value: 1000000}\n")
    none = run_autotune(
        "--scenario",
        str(study_dir / "small.yaml"),
        "--trials",
        "2",
        "--space",
        "huge.yaml",
        "--storage",
        "sqlite:///f.db",
        "--study",
        "f",
        cwd=tmp_path,
    )
    assert none.returncode == 3, none.stderr
    assert not (tmp_path / "best-config.report.html").exists()
    refused("--storage", "sqlite:///f.db", "-o", "f.html", expected="no completed trial")
    assert not (tmp_path / "f.html").exists()


def _tick_values(dom: str, title: str, axis: str) -> list[float]:
    """The decades a log axis of the plot titled `title` shows, read from the rendered page (its
    minor ticks, labelled 2 and 5 within a decade, left out)."""
    import math
    import re

    plot = next(part for part in dom.split('class="plot"') if title in part)
    labels = re.findall(rf'class="{axis}tick"><text[^>]*data-unformatted="([^"]*)"', plot)
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    values = []
    for label in labels:
        number = re.fullmatch(r"([0-9.]+)([kMGT]?)", label.replace("\u2212", "-"))
        assert number, f"{title}: {axis} axis tick {label!r}"  # e.g. 10<sup>198</sup>
        value = float(number[1]) * scale[number[2]]
        if value > 0 and math.log10(value).is_integer():
            values.append(value)
    assert values, f"{title}: no {axis} axis ticks"
    return values


def test_log_axes_span_the_measured_values(tmp_path: Path):
    """A real study under a 200 ms SLA (what stretched a real llama-server study's log axes to
    1e198: the SLA line's label), plus a trial whose TTFT p99 is infinite and front steps at
    zero and infinite TTFT, as an engine that served nothing reports them: the TTFT axes of the
    Pareto and latency-curve plots, read from the page Chromium rendered, stay within the
    measured values."""
    import math

    import yaml

    from tests.conftest import small_scenario

    data = small_scenario(requests=100).model_dump(mode="json") | {"name": "strict"}
    data["sla"]["ttft_p99_ms"] = 200
    (tmp_path / "strict.yaml").write_text(yaml.safe_dump(data))
    assert (
        run_autotune(
            "--scenario", "strict.yaml", "--trials", "6", "--no-html", cwd=tmp_path
        ).returncode
        == 0
    )
    study = optuna.load_study(
        study_name="strict.sim.mindie.qwen2-7b.ascend-910b2",
        storage=f"sqlite:///{tmp_path / 'studies.db'}",
    )
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    best = max((t for t in done if is_feasible(t.constraints)), key=lambda t: t.values[1])
    steps = best.user_attrs["capacity_steps"] + [
        {"rate": 1000.0, "ttft_p99_ms": math.inf, "output_tokens_per_s": 10.0, "meets_sla": False},
        {"rate": 0.01, "ttft_p99_ms": 0.0, "output_tokens_per_s": 1.0, "meets_sla": True},
    ]
    for values, attrs, constraints in (
        (
            [best.values[0], best.values[1] * 2],
            {"capacity_steps": steps},
            list(best.constraints.values()),
        ),
        ([math.inf, 0.0], {}, [1.0] * len(best.constraints)),
    ):
        study.add_trial(
            optuna.trial.create_trial(
                values=values,
                params=best.params,
                distributions=best.distributions,
                user_attrs=best.user_attrs | attrs,
                system_attrs={"constraints": constraints},
            )
        )
    assert run_autotune("report", "-o", "r.html", cwd=tmp_path).returncode == 0
    shown = subprocess.run(
        [_chromium(), *CHROMIUM_FLAGS, "--dump-dom", (tmp_path / "r.html").as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    finite = (
        [t.values[0] for t in done]
        + [200]
        + [
            s["ttft_p99_ms"]
            for s in best.user_attrs["capacity_steps"]
            if s.get("ttft_p99_ms") is not None
        ]
    )
    for title, axis in (("TTFT p99 against throughput", "x"), ("Latency against throughput", "y")):
        ticks = _tick_values(shown.stdout, title, axis)
        assert min(finite) / 10 <= min(ticks) and max(ticks) <= max(finite) * 10, (title, ticks)
    assert "1 not drawn: TTFT p99 infinite or zero" in shown.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_optuna_dashboard_shows_sla_feasibility(study_dir: Path):
    """The real optuna-dashboard 0.21 reading the real studies.db: each trial's constraints are
    there, and feasible exactly when the trial met the SLA."""
    dashboard = Path(sys.executable).with_name("optuna-dashboard")
    port = _free_port()
    server = subprocess.Popen(
        [
            str(dashboard),
            f"sqlite:///{study_dir / 'studies.db'}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                studies = httpx.get(f"{base}/api/studies", timeout=2).json()["study_summaries"]
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("optuna-dashboard did not answer")
        study_id = next(s["study_id"] for s in studies if s["study_name"] == STUDY)
        shown = httpx.get(f"{base}/api/studies/{study_id}", timeout=10).json()
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=10)
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{study_dir / 'studies.db'}")
    expected = {t.number: t for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))}
    trials = {t["number"]: t for t in shown["trials"] if t["state"] == "Complete"}
    assert trials.keys() == expected.keys() and trials
    for number, trial in trials.items():
        assert trial["constraints"] == list(expected[number].constraints.values())
        met = expected[number].user_attrs["status"] == "feasible"
        assert (
            all(c <= 0 for c in trial["constraints"])
            == met
            == is_feasible(expected[number].constraints)
        )
    assert any(all(c <= 0 for c in t["constraints"]) for t in trials.values())
    assert any(any(c > 0 for c in t["constraints"]) for t in trials.values())
    assert shown.get("objective_names") == [
        "ttft_p99_ms",
        "capacity_output_tokens_per_s",
    ]  # set_metric_names


def _screened_trial(
    values: tuple[float, float] | None,
    constraints: list[float] | None,
    predicted: float,
    fault: str | None = None,
) -> optuna.trial.FrozenTrial:
    attrs = {
        "screen": {"round": 1, "predicted_ttft_p99_ms": 50.0, "predicted_throughput": predicted}
    }
    if fault is not None:
        return optuna.trial.create_trial(
            state=optuna.trial.TrialState.FAIL, user_attrs=attrs | {"fault": fault}
        )
    named = dict(zip(("ttft_p99", "success_rate"), constraints, strict=True))
    return optuna.trial.create_trial(
        values=list(values),
        user_attrs=attrs | {"sla_constraints": named},
        system_attrs={"constraints": constraints},
    )


def test_screen_chart_shows_every_pick_with_misses_and_failures_marked():
    """A --screen study's real trials: one met the SLA, one missed it, one failed to serve, and
    one was not screened. The chart holds the three picks, each in its own marked group, the
    failed one drawn at zero measured throughput with its cause."""
    from objectives.scenario import load_scenario
    from tuner.report_plots import screen_figure

    study = optuna.create_study(directions=["minimize", "maximize"])
    study.add_trial(_screened_trial((80.0, 900.0), [-0.2, 0.0], predicted=1000.0))
    study.add_trial(_screened_trial((450.0, 300.0), [1.25, 0.0], predicted=2000.0))
    study.add_trial(
        _screened_trial(None, None, predicted=3000.0, fault="engine exited during the load")
    )
    study.add_trial(
        optuna.trial.create_trial(values=[70.0, 950.0], system_attrs={"constraints": [-0.1, 0.0]})
    )
    fig = screen_figure(study, load_scenario("customer-service"))
    groups = {trace.name: trace for trace in fig.data if trace.mode == "markers"}
    meets = next(t for name, t in groups.items() if name.startswith("meets"))
    misses = next(t for name, t in groups.items() if name.startswith("misses"))
    failed = next(t for name, t in groups.items() if name.startswith("failed"))
    assert (list(meets.x), list(meets.y)) == ([1000.0], [900.0])
    assert (list(misses.x), list(misses.y)) == ([2000.0], [300.0])
    assert (list(failed.x), list(failed.y)) == ([3000.0], [0.0])
    assert "ttft_p99 +125%" in misses.text[0]
    assert "engine exited during the load" in failed.text[0]
    assert len({meets.marker.symbol, misses.marker.symbol, failed.marker.symbol}) == 3
    assert "3 picks, 1 met the SLA, 1 missed it, 1 failed" in fig.layout.title.text


def test_report_compares_colocated_and_disaggregated_on_a_chip_budget(
    study_dir: Path, tmp_path: Path
):
    """A 4-chip study that measured one config both ways (the grid over `deployment`, every
    other knob fixed): the report's comparison section holds each deployment's best (its only
    trial) and the line saying which wins per chip; the console prints that line; the front
    says each row's deployment and that its throughputs are per chip."""
    (tmp_path / "small.yaml").write_text((study_dir / "small.yaml").read_text())
    fixed = dict(prefill_instances=2, decode_instances=2, prefill_memory_share=0.6,
                 decode_memory_share=0.8, prefill_batch_size=16, batch_size=48,
                 select_batch="prefill-first", max_prefill_tokens=4096, max_prefill_batch_size=8,
                 quantization="bf16", kv_compression=1.0, prefix_caching=False)  # fmt: skip
    knobs = {k: {"value": v} for k, v in fixed.items()}
    knobs["deployment"] = {"choices": ["co-located", "disaggregated"]}
    (tmp_path / "both.yaml").write_text(json.dumps({"knobs": knobs}))  # JSON is YAML
    result = run_autotune(
        "--scenario", "small.yaml", "--chips", "4", "--trials", "2", "--sampler", "grid",
        "--space", "both.yaml", "--study", "both", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    study = optuna.load_study(study_name="both", storage=f"sqlite:///{tmp_path / 'studies.db'}")
    number = {t.user_attrs["knobs"]["deployment"]: t.number for t in study.trials}
    assert set(number) == {"co-located", "disaggregated"}
    assert all(is_feasible(t.constraints) for t in study.trials)

    page = (tmp_path / "best-config.report.html").read_text()
    start = page.index("<h2>Co-located vs disaggregated on 4 chips</h2>")
    section = page[start : page.index("</section>", start)]
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", section)]
    rows = {row[0]: row for row in cells if row}
    assert rows["co-located"][1:3] == [str(number["co-located"]), "4 replicas"]
    assert rows["disaggregated"][1:3] == [str(number["disaggregated"]), "2P2D"]
    assert "capacity tok/s per chip" in section and "TPOT p99 ms" in section
    line = next(line for line in result.stdout.splitlines() if line.startswith("On 4 chips, "))
    assert "beats" in line and "co-located (trial" in line and "disaggregated 2P2D (trial" in line
    assert "per chip" in line
    assert line in html.unescape(section)
    # The front: a deploy column, and throughput headers per chip. Here both sustain the same
    # rate per chip (8.13 req/s), so the same throughput (the rate times the mean output): the
    # one with the higher TTFT is dominated and off the front.
    head = result.stdout[: result.stdout.index("2 trials this run")]
    assert "deploy" in head and "per chip" in head
    faster, slower = sorted(study.trials, key=lambda t: t.values[0])
    assert faster.user_attrs["capacity_rate"] == slower.user_attrs["capacity_rate"]
    assert faster.values[1] == slower.values[1] and faster.values[0] < slower.values[0]
    shown = faster.user_attrs["knobs"]["deployment"]
    assert shown in head and ("2P2D" in head) == (shown == "disaggregated")
    # A one-chip study's report has no such section.
    one_chip = (study_dir / "best-config.report.html").read_text()
    assert "Co-located vs disaggregated" not in one_chip
