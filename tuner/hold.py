"""Before the export: the pick certified at the rate it claims, on loads far longer than the
search's and on fresh arrival draws, judged by the search's own steady-state rule.

A capacity search judges each rate on a window of the scenario's size, extended while it has
not settled; a rate a hair above what the engine sustains can pass it, and near saturation a
longer run's p99 wanders past the bound (code-generation's export held 16x its requests and
read a TTFT p99 of 3,094 ms against 1,500 at 32x). So the pick is held at `factor` times the
scenario's requests (the simulator: 64x) on each of `draws` arrival draws (the simulator: 6,
the search's own and five fresh), each window extended while unsettled up to `extension_cap`
times that, and a window unsettled at the cap is a miss, as in the search (runners.load
.steady_state); the first half of a window that meets has to meet as well (two successive
horizons agree). A claim that misses is lowered one step of the search's grid at a time (at most
MAX_STEPS_DOWN). Lowering it may leave it below configs it was tied with: those whose claimed
capacity lies above the lowered rate (at most MAX_RIVALS, best claim first, under a
max-throughput pick) are held too, each down to no lower than the best held so far, and the
config that holds the highest rate is the one exported. best_trial follows that choice while
the study has no newer trial, so the front, the report and the export name the same config.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import constraint_values, is_feasible
from runners.base import Runner, Session
from runners.load.bracket import step_down
from runners.load.capacity import step_at
from runners.load.measurement import first_part, summarize
from runners.load.steady_state import percentiles_met
from tuner.answer import worst_capacity
from tuner.parallel import sim_pool
from tuner.study import best_trial, keep_hold, trial_knobs

MAX_STEPS_DOWN = 4
MAX_RIVALS = 3  # configs held after a lowered pick, the best claims first


@dataclass(frozen=True)
class HoldPlan:
    factor: int  # each window's requests, in the scenario's num_requests
    draws: int  # arrival draws, each of which the rate has to meet
    extension_cap: int = 2  # an unsettled window doubles up to this many times its start


# The simulator: seconds a rate, its draws spread over the cores. Three draws let a config at
# its knee through: code-generation's export held 10.37 req/s on draws 0-2 (TTFT p99 957-1,050
# ms against 1,500), and 4 of 12 draws miss there (up to 2,175 ms); one grid step below, all
# 12 read 531-682 ms.
# Six draws let one through too: code-generation's export (b723, 10.37 req/s, seed 0) met on
# draws 0-5 (TTFT p99 826-1,211 ms), and 5 of draws 6-17 miss there (a queue excursion past
# the bound). Twelve, in rounds of six: a rate that misses in the first round costs six.
SIM_HOLD = HoldPlan(factor=64, draws=12)
# A trace's draw starts its window at another request (runners.load.trace_replay): over 64
# replays of the window, any two draws send the same traffic but for where they start, so two
# (the trace as written and one more) are all that differ.
SIM_TRACE_HOLD = HoldPlan(factor=64, draws=2)
SIM_ROUND = 6
REAL_HOLD = HoldPlan(factor=4, draws=1, extension_cap=1)  # a real engine: minutes, once per run
# A rate every draw met still misses when the draws' spread puts a fresh draw's p99 past the
# bound: their log-mean plus this many log standard deviations, about one fresh draw in 40
# beyond it if the p99 spreads log-normally over draws. At its knee a config's p99 spreads
# wide (code-generation at 10.37 req/s: 839-2,175 ms over 12 draws), one grid step below it
# narrow (531-682).
PREDICTION_SIGMAS = 2.0
# The figures a hold keeps of each rate it tried: the worst over its draws.
WORST_HIGH = ("ttft_p99_ms", "tpot_p99_ms")
WORST_LOW = ("delivered_share", "served_rps", "output_tokens_per_s")


def sim_hold(scenario: Scenario) -> HoldPlan:
    """The simulator's hold for this scenario's workload."""
    return SIM_TRACE_HOLD if scenario.workload.trace is not None else SIM_HOLD


def _drawn(scenario: Scenario, draw: int) -> Scenario:
    """The scenario with its `draw`-th arrival draw (0: the search's own requests)."""
    if draw == 0:
        return scenario
    return scenario.model_copy(update={"workload": scenario.at_rate(scenario.nominal_rate, draw)})


def _draw(session: Session, scenario: Scenario, rate: float, plan: HoldPlan, draw: int) -> dict:
    """One rate on one arrival draw: the record of its judged window."""
    step = step_at(
        session,
        _drawn(scenario, draw),
        rate,
        scenario.load.early_rejection,
        factor=plan.factor,
        extension_cap=plan.extension_cap,
    )
    row = {key: step.metrics.get(key) for key in WORST_HIGH + WORST_LOW}
    row |= {"draw": draw, "requests": step.measurement.sent, "meets": step.meets_sla}
    row |= {"windows": step.windows, "settled": step.unsettled is None}
    fault = step.measurement.fault
    if not step.meets_sla:
        stopped = None if fault is None else f"{fault.kind}: {fault.message}"[:200]
        if fault is not None and fault.kind == "sla-violated":  # the load generator's rejection
            stopped = "TTFT p99 certainly past the bound, stopped early"
        row["missed"] = step.unsettled or stopped or _violated(step.metrics, scenario)
    if step.meets_sla and scenario.workload.burst is None:
        # The horizon half as long has to agree: near saturation one queue excursion can be
        # 1% of a window but not of one twice as long. Judged on its percentiles: the
        # delivered share of a part is not the load's.
        half = first_part(step.measurement, step.measurement.sent // 2)
        metrics = summarize(half, scenario.sla)
        row["half_ttft_p99_ms"] = metrics.get("ttft_p99_ms")
        row["meets"] = percentiles_met(metrics, scenario.sla)
        if not row["meets"]:
            row["missed"] = f"its first half: {_violated(metrics, scenario)}"
    if fault is not None:
        row["fault"] = f"{fault.kind}: {fault.message}"[:300]
    return row


def _violated(metrics: dict[str, Any], scenario: Scenario) -> str:
    """The SLOs a window's figures break, as figures (the draws' lines on the console)."""
    if metrics.get("ttft_p99_ms") is None:
        return "no first token measured"
    shown = {
        "ttft_p99": f"TTFT p99 {metrics['ttft_p99_ms']:.0f} ms",
        "tpot_p99": f"TPOT p99 {metrics.get('tpot_p99_ms') or 0:.0f} ms",
        "success_rate": f"{metrics.get('success_rate', 0):.1%} succeeded",
        "sustained": f"{metrics.get('delivered_share') or 0:.1%} of the rate delivered",
    }
    broken = [
        shown.get(name, name)
        for name, value in constraint_values(metrics, scenario.sla).items()
        if value > 0
    ]
    return ", ".join(broken) or "stopped early"


def _simulated_draw(
    runner: Runner, config: dict, scenario: Scenario, rate: float, plan: HoldPlan, draw: int
) -> dict:
    """_draw in a worker process, on an engine of its own (a simulated one costs nothing to
    start)."""
    with runner.session(config, scenario.workload) as session:
        return _draw(session, scenario, rate, plan, draw)


class _Draws:
    """A rate's draws for one config: in this process on its one session, one after another
    until one misses (a real engine); or, on the simulator, in rounds of SIM_ROUND spread over
    worker processes, every draw of a round run and no round after one with a miss. Each
    draw's requests are fixed by its seed, so which worker ran it changes nothing, and one
    process runs the same rounds."""

    def __init__(self, session: Session, runner: Runner, config: dict, pool: Executor | None):
        self.session, self.runner, self.config, self.pool = session, runner, config, pool

    def run(self, scenario: Scenario, rate: float, plan: HoldPlan) -> list[dict]:
        if self.runner.name != "sim":
            rows: list[dict[str, Any]] = []
            for draw in range(plan.draws):
                rows.append(_draw(self.session, scenario, rate, plan, draw))
                if not rows[-1]["meets"]:  # minutes a draw: no more once one misses
                    break
            return rows
        rows = []
        for start in range(0, plan.draws, SIM_ROUND):
            draws = range(start, min(start + SIM_ROUND, plan.draws))
            if self.pool is not None:
                work = partial(_simulated_draw, self.runner, self.config, scenario, rate, plan)
                rows += self.pool.map(work, draws)
            else:
                rows += [_draw(self.session, scenario, rate, plan, draw) for draw in draws]
            if not all(row["meets"] for row in rows):
                break
        return rows


def fresh_draw_p99(samples: list[float]) -> float | None:
    """The p99 a fresh arrival draw may read, from the draws' own: their log-mean plus
    PREDICTION_SIGMAS of their log spread (None: fewer than three)."""
    logs = np.log([value for value in samples if value is not None and value > 0])
    if logs.size < 3:
        return None
    return float(np.exp(logs.mean() + PREDICTION_SIGMAS * logs.std(ddof=1)))


def _predicted_miss(draws: list[dict], scenario: Scenario) -> str | None:
    """Why a fresh draw would likely miss a percentile bound the draws all met (None: it
    would not, or too few draws to say). The TTFT samples are every window and its first
    half (the 32x horizon of a 64x hold)."""
    sla = scenario.sla
    ttft = [row["ttft_p99_ms"] for row in draws] + [row.get("half_ttft_p99_ms") for row in draws]
    bounds = [
        ("TTFT", ttft, sla.ttft_p99_ms),
        ("TPOT", [r["tpot_p99_ms"] for r in draws], sla.tpot_p99_ms),
    ]
    for name, samples, bound in bounds:
        predicted = fresh_draw_p99(samples)
        if bound is not None and predicted is not None and predicted > bound:
            return (
                f"{name} p99 on a fresh draw predicted {predicted:.0f} ms (the draws' "
                f"{min(s for s in samples if s):.0f}-{max(s for s in samples if s):.0f} ms) "
                f"against {bound:g}"
            )
    return None


def _hold_rate(draws_of: _Draws, scenario: Scenario, rate: float, plan: HoldPlan) -> dict:
    """One rate on each draw: its record, the worst draw's figures. Meeting it on every draw
    is not enough where their spread says a fresh one would miss (a rate at the knee)."""
    draws = draws_of.run(scenario, rate, plan)
    load: dict[str, Any] = {"rate": rate, "meets": all(row["meets"] for row in draws)}
    if load["meets"]:
        why = _predicted_miss(draws, scenario)
        if why is not None:
            load |= {"meets": False, "predicted_miss": why}
    load["requests"] = min(row["requests"] for row in draws)
    for key in WORST_HIGH:
        values = [row[key] for row in draws if row[key] is not None]
        load[key] = max(values) if values else None
    for key in WORST_LOW:
        values = [row[key] for row in draws if row[key] is not None]
        load[key] = min(values) if values else None
    failed = next((row["fault"] for row in draws if "fault" in row), None)
    if failed is not None and not failed.startswith("sla-violated"):
        load["fault"] = failed
    return load | {"draws": draws}


def _hold_config(
    runner: Runner,
    study: optuna.Study,
    scenario: Scenario,
    trial: FrozenTrial,
    plan: HoldPlan,
    pool: Executor | None,
    repeats: dict[str, Any] | None,
    above: float | None = None,
) -> dict[str, Any]:
    """Hold `trial` from its claim (the worst of its `repeats`, where they searched a lower
    capacity) down, one grid step at a time, to no rate at or below `above` (a rival has to
    beat what held already)."""
    config = trial_knobs(study, trial)
    claimed = trial.user_attrs.get("capacity_rate") or scenario.nominal_rate
    worst = worst_capacity(repeats, trial.number)
    if worst is not None and worst["capacity_rate"] is not None:
        claimed = min(claimed, worst["capacity_rate"])
    rate: float | None = claimed
    loads: list[dict[str, Any]] = []
    held = None
    start = scenario.model_copy(update={"workload": scenario.at_rate(claimed)})
    with runner.session(config, start.workload) as session:  # one engine for every rate tried
        draws = _Draws(session, runner, config, pool)
        for _ in range(MAX_STEPS_DOWN + 1 if scenario.load.mode == "capacity" else 1):
            assert rate is not None
            loads.append(_hold_rate(draws, scenario, rate, plan))
            if loads[-1]["meets"]:
                held = rate
                break
            if "fault" in loads[-1]:
                break  # the engine failed: no lower rate would say more about the config
            rate = step_down(scenario, rate)
            if rate is None or (above is not None and rate <= above):
                break
    return {"trial": trial.number, "claimed_rate": claimed, "held_rate": held, "loads": loads}


def _rivals(
    study: optuna.Study,
    pick: FrozenTrial,
    below: float | None,
    repeated: dict[str, Any] | None = None,
) -> list[FrozenTrial]:
    """Feasible configs other than the pick whose claims lie above what the pick held, ranked
    as the pick rule ranks them (the claim, then throughput, then TTFT). A config alike to one
    already chosen (the same claim, nominal TTFT and measured capacity throughput, to the
    float: knobs this workload never reaches, such as a prefill budget no step fills) is left
    out: its loads are that one's loads. Where tuner.repeats made the pick, only the configs
    it measured again (`repeated`, this run's): one draw of an unrepeated config's hold is no
    evidence against the worst of repeats (and the export states the repeats of the config it
    names)."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if repeated is not None and repeated["complete_trials"] == len(done):
        done = [t for t in done if str(t.number) in repeated["trials"]]

    def figures(trial: FrozenTrial) -> tuple[float, float, float, float]:
        attrs = trial.user_attrs
        measured = attrs.get("capacity_measured_output_tokens_per_s", trial.values[1])
        return (attrs.get("capacity_rate") or 0.0, trial.values[1], trial.values[0], measured)

    seen = [figures(pick)]
    rivals = []
    for trial in sorted(done, key=lambda t: (-figures(t)[0], -figures(t)[1], figures(t)[2])):
        claim = figures(trial)[0]
        if not claim or (below is not None and claim <= below):
            break
        if not is_feasible(trial.constraints) or figures(trial) in seen:
            continue
        seen.append(figures(trial))
        rivals.append(trial)
        if len(rivals) == MAX_RIVALS:
            break
    return rivals


def hold_pick(
    runner: Runner,
    study: optuna.Study,
    scenario: Scenario,
    trial: FrozenTrial,
    plan: HoldPlan,
    repeats: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Hold `trial` (the pick) at its claimed capacity (a fixed-load study: its nominal rate;
    where this run's `repeats` measured it, their worst draw's); lower a claim that misses,
    then hold the configs it passed over; the config that held the highest rate is the hold's
    `trial`. Kept by the study (tuner.study.keep_hold)."""
    # Counted first: a trial another worker finishes meanwhile was no candidate, and makes
    # the choice stale (as tuner.repeats counts).
    complete = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    pool = sim_pool(runner, plan.draws)
    pick = _hold_config(runner, study, scenario, trial, plan, pool, repeats)
    held = [pick]
    # Rivals only where a higher rate is a higher throughput: an open loop's (a closed
    # loop's rate is requests in flight), under a max-throughput pick.
    searched = (
        scenario.load.mode == "capacity"
        and scenario.pick == "max-throughput"
        and not scenario.closed_loop
    )
    lowered = searched and pick["held_rate"] != pick["claimed_rate"]
    for rival in _rivals(study, trial, pick["held_rate"], repeats) if lowered else []:
        best = max((h["held_rate"] for h in held if h["held_rate"] is not None), default=None)
        if best is not None and rival.user_attrs["capacity_rate"] <= best:
            break
        held.append(_hold_config(runner, study, scenario, rival, plan, pool, repeats, best))
    # The highest rate held; at the same rate, the one held first (the better claim).
    chosen = max(held, key=lambda h: -1.0 if h["held_rate"] is None else h["held_rate"])
    result = chosen | {
        "picked": trial.number,
        "factor": plan.factor,
        "draws": plan.draws,
        "extension_cap": plan.extension_cap,
        "complete_trials": complete,
        "held": [{k: h[k] for k in ("trial", "claimed_rate", "held_rate")} for h in held],
    }
    keep_hold(study, result)
    return result


def pick_to_hold(
    study: optuna.Study, scenario: Scenario, repeats: dict[str, Any] | None = None
) -> FrozenTrial | None:
    """The pick rule's choice before any hold moved it (the hold starts from it): where this
    run's `repeats` made the pick, theirs."""
    if repeats is not None:
        return study.get_trials(deepcopy=False)[repeats["pick"]]
    return best_trial(study, scenario, held=False)


def _tried(load: dict[str, Any]) -> str:
    figures = f" (TTFT p99 {load['ttft_p99_ms']:.0f} ms)" if load.get("ttft_p99_ms") else ""
    missed = next((row for row in load.get("draws", []) if not row["meets"]), None)
    if missed is not None and "missed" in missed:
        figures = f" (draw {missed['draw']}: {missed['missed']})"
    if load.get("predicted_miss"):
        figures = f" ({load['predicted_miss']})"
    return f"{load['rate']:.4g} {'holds' if load['meets'] else 'misses'}{figures}"


def describe_hold(result: dict[str, Any], scenario: Scenario) -> str:
    """The console's line on a hold."""
    unit = "in flight" if scenario.closed_loop else "req/s"
    draws = result.get("draws", 1)
    horizon = (
        f"for {result['factor']}x the scenario's requests"
        f"{f' on each of {draws} arrival draws' if draws > 1 else ''}"
    )
    picked = result.get("picked", result["trial"])
    pick = next((h for h in result.get("held", []) if h["trial"] == picked), None)
    line = f"hold: trial {picked} at {(pick or result)['claimed_rate']:.4g} {unit} {horizon}: "
    if result["trial"] != picked and pick is not None:
        lowered = f"held {pick['held_rate']:.4g}" if pick["held_rate"] is not None else "missed"
        line += f"{lowered}; trial {result['trial']}, which it passed over, "
        if result["held_rate"] == result["claimed_rate"]:
            line += f"at {result['claimed_rate']:.4g} "
    first = result["loads"][0]
    if result["held_rate"] == result["claimed_rate"]:
        return line + f"holds (TTFT p99 {first['ttft_p99_ms']:.0f} ms on the worst draw)"
    tried = ", ".join(_tried(load) for load in result["loads"])
    if result["held_rate"] is None:
        return line + f"misses at every rate tried ({tried}); the export marks its capacity unheld"
    below = (
        f"; below the scenario's nominal {scenario.nominal_rate:g} {unit}: the config does not "
        "sustain a normal day's load"
        if result["held_rate"] < scenario.nominal_rate
        else ""
    )
    return line + f"{tried}: the export's capacity is {result['held_rate']:.4g} {unit}{below}"
