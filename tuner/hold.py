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
One rate on its draws, and the record of its worst: tuner.hold_rate.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import is_feasible
from runners.base import Runner
from runners.load.bracket import step_down
from tuner.answer import worst_capacity
from tuner.hold_rate import Draws, HoldPlan, hold_rate
from tuner.parallel import sim_pool
from tuner.study import best_trial, keep_hold, trial_knobs

MAX_STEPS_DOWN = 4
MAX_RIVALS = 3  # configs held after a lowered pick, the best claims first


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
REAL_HOLD = HoldPlan(factor=4, draws=1, extension_cap=1)  # a real engine: minutes, once per run


def sim_hold(scenario: Scenario) -> HoldPlan:
    """The simulator's hold for this scenario's workload."""
    return SIM_TRACE_HOLD if scenario.workload.trace is not None else SIM_HOLD


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
        draws = Draws(session, runner, config, pool)
        for _ in range(MAX_STEPS_DOWN + 1 if scenario.load.mode == "capacity" else 1):
            assert rate is not None
            loads.append(hold_rate(draws, scenario, rate, plan))
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
