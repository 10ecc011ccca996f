"""What a study's figures stand on beyond its identity's names: the simulator's hardware and
model profiles (their figures, not their names: an edited copy of ascend-910b2 keeps the
name), a real runner's settings that change what it measures, and the quality figures of the
pairs the space searches. A study records them when it starts; a run whose figures stand on
other ones is refused, naming what changed (tuner.study_guards)."""

from __future__ import annotations

from typing import Any

# Text beside a figure, not the figure: an edited note or a re-dated description measures the
# same.
NOT_FIGURES = frozenset({"note", "source", "description", "name"})
ATTR = "assumptions"  # the study attribute
SHOWN = 3  # changed figures named in the refusal


def leaves(value: Any, path: str = "") -> dict[str, Any]:
    """Every figure of a nested record by its dotted path, text beside figures left out."""
    if isinstance(value, dict):
        found: dict[str, Any] = {}
        for key, item in value.items():
            if key not in NOT_FIGURES:
                found |= leaves(item, f"{path}.{key}" if path else str(key))
        return found
    return {path: value}


def changed(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The figures that differ, as "what old -> new". Only what both sides record is
    compared: a part or a figure only one has (a study recorded before it was, a run that
    searches fewer quality pairs) says nothing against the other."""
    lines = []
    for part in sorted(recorded.keys() & current.keys()):
        old, new = leaves(recorded[part]), leaves(current[part])
        for path in sorted(old.keys() & new.keys()):
            if old[path] != new[path]:
                what = f"{part} {path}" if path else part  # a part that is one figure
                lines.append(f"{what} {old[path]} -> {new[path]}")
    return lines


def describe_changes(lines: list[str]) -> str:
    more = f" and {len(lines) - SHOWN} more" if len(lines) > SHOWN else ""
    return "; ".join(lines[:SHOWN]) + more
