"""Reading a request trace's window (objectives.trace.Trace): the Azure/Splitwise CSV,
Mooncake's JSONL, BurstGPT's CSV, and a service's own CSV or JSONL by named columns.

A trace is read as a stream, a row at a time (gzip too, by its magic bytes), and only the
window's rows are kept: memory grows with the window, never with the file. Every bad row is
refused with its file and line: a timestamp that is not a number or a date, one below the
previous row's, a length that is not a positive whole number.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import os
import zlib
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from objectives.trace import Trace, TraceColumns, TraceWindow, window_span
from objectives.userfile import regular_file

# Each format's columns: arrival, prompt tokens, output tokens, session, blocks.
KNOWN_COLUMNS = {
    "azure": TraceColumns(
        arrival="TIMESTAMP", input_tokens="ContextTokens", output_tokens="GeneratedTokens"
    ),
    "mooncake": TraceColumns(
        arrival="timestamp",
        input_tokens="input_length",
        output_tokens="output_length",
        blocks="hash_ids",
    ),
    "burstgpt": TraceColumns(
        arrival="Timestamp", input_tokens="Request tokens", output_tokens="Response tokens"
    ),
}
# Mooncake's timestamps are milliseconds; Azure's are dates; BurstGPT's seconds.
KNOWN_UNITS = {"mooncake": "ms", "burstgpt": "s", "azure": "s"}
UNIT_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
GZIP_MAGIC = b"\x1f\x8b"


class TraceError(ValueError):
    """A trace that cannot be read as its scenario says (a ValueError: pydantic names the
    field it came from)."""


def open_trace(path: Path) -> io.TextIOBase:
    """The trace as text lines: a regular file (a FIFO would block, a directory is none),
    gunzipped where it is gzip."""
    regular_file(path, "trace file", TraceError)
    try:
        raw = path.open("rb")
    except OSError as error:
        raise TraceError(f"trace {path}: cannot read: {error.strerror}") from None
    zipped = raw.read(2) == GZIP_MAGIC
    raw.seek(0)
    stream = gzip.GzipFile(fileobj=raw) if zipped else raw
    return io.TextIOWrapper(stream, encoding="utf-8", newline="")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_window(trace: Trace) -> TraceWindow:
    """The trace's window, read once per file version (cached on its size and mtime)."""
    path = Path(trace.file)
    try:
        info = os.stat(path)
        version = (info.st_ino, info.st_size, info.st_mtime_ns)
    except OSError:
        version = None  # open_trace says why
    return _read_window(trace, version)


@lru_cache(maxsize=16)
def _read_window(trace: Trace, version: tuple[int, int, int] | None) -> TraceWindow:
    path = Path(trace.file)
    columns = trace.columns or KNOWN_COLUMNS[trace.format]
    unit = UNIT_SECONDS[KNOWN_UNITS.get(trace.format, trace.time_unit)]
    times: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    sessions: list[str] = []
    blocks: list[np.ndarray] = []
    first_s: float | None = None
    previous_s = -np.inf
    end_s = None if trace.duration_s is None else trace.start_s + trace.duration_s
    with open_trace(path) as text:
        rows = _rows(text, path, trace.format, columns)
        reached_end = False
        try:
            for line, row in rows:
                where = f"trace {path}, line {line}"
                at_s = _seconds(row[columns.arrival], where, columns.arrival) * unit
                if at_s < previous_s:
                    raise TraceError(
                        f"{where}: {columns.arrival} goes back in time ({at_s:g} s after "
                        f"{previous_s:g} s): a trace is in arrival order"
                    )
                previous_s = at_s
                if first_s is None:
                    first_s = at_s
                since = at_s - first_s
                if since < trace.start_s:
                    continue
                if end_s is not None and since >= end_s:
                    reached_end = True
                    break
                if trace.requests is not None and len(times) >= trace.requests:
                    reached_end = True
                    break
                prompt = _length(row[columns.input_tokens], where, columns.input_tokens)
                # BurstGPT logs a failed request with no response tokens: left out
                failed_ok = trace.format == "burstgpt"
                answer = _length(
                    row[columns.output_tokens], where, columns.output_tokens, 0 if failed_ok else 1
                )
                if answer == 0:
                    continue
                times.append(at_s)
                inputs.append(prompt)
                outputs.append(answer)
                if columns.session:
                    sessions.append(str(row[columns.session]))
                if columns.blocks:
                    blocks.append(_blocks(row[columns.blocks], where, columns.blocks))
        except (EOFError, zlib.error, gzip.BadGzipFile) as error:
            raise TraceError(f"trace {path}: truncated or corrupt gzip ({error})") from None
        except UnicodeDecodeError as error:
            raise TraceError(f"trace {path}: not UTF-8 text (byte {error.start})") from None
        except OSError as error:
            raise TraceError(f"trace {path}: cannot read: {error.strerror or error}") from None
    if first_s is None:
        raise TraceError(f"trace {path}: no requests in the file")
    if not times:
        raise TraceError(
            f"trace {path}: the window (start_s {trace.start_s:g}) holds no request; the "
            f"trace spans {previous_s - first_s:.6g} s"
        )
    short = trace.requests is not None and len(times) < trace.requests
    if short or (end_s is not None and not reached_end):
        asked = (
            f"start_s {trace.start_s:g} + duration_s {trace.duration_s:g}"
            if trace.duration_s is not None
            else f"{trace.requests} requests from start_s {trace.start_s:g}"
        )
        raise TraceError(
            f"trace {path}: the window ({asked}) runs past the trace's end ({len(times)} "
            f"requests from there, the trace spans {previous_s - first_s:.6g} s)"
        )
    arrival = np.asarray(times, dtype=np.float64) - times[0]
    prompts = np.asarray(inputs, dtype=np.int64)
    answers = np.asarray(outputs, dtype=np.int64)
    if trace.length_scale != 1:
        prompts = np.maximum(1, np.rint(prompts * trace.length_scale)).astype(np.int64)
        answers = np.maximum(1, np.rint(answers * trace.length_scale)).astype(np.int64)
    kept, over = _context_policy(trace, prompts, answers, path)
    session = None
    if columns.session:
        _, session = np.unique(np.asarray(sessions)[kept], return_inverse=True)
    arrival = arrival[kept] - arrival[kept][0]  # the policy never empties the window
    return TraceWindow(
        arrival_s=arrival,
        input_tokens=prompts[kept],
        output_tokens=answers[kept],
        session=session,
        blocks=[blocks[i] for i in np.flatnonzero(kept)] if columns.blocks else None,
        block_tokens=trace.block_size,
        span_s=window_span(arrival, trace.duration_s),
        over_context=over,
        sha256=file_sha256(path),
    )


def _context_policy(
    trace: Trace, prompts: np.ndarray, answers: np.ndarray, path: Path
) -> tuple[np.ndarray, int]:
    """Which requests the window keeps, and how many the policy clipped or dropped; clipped
    prompts are shortened in place."""
    kept = np.ones(prompts.size, dtype=bool)
    limit = trace.context_tokens
    if limit is None:
        return kept, 0
    over = prompts + answers > limit
    count = int(over.sum())
    if not count:
        return kept, 0
    if trace.over_context == "refuse":
        longest = int((prompts + answers).max())
        raise TraceError(
            f"trace {path}: {count} of {prompts.size} requests in the window exceed the "
            f"model's context of {limit} tokens (the longest: {longest}); set "
            "workload.trace.over_context to clip or drop"
        )
    if trace.over_context == "drop":
        kept &= ~over
        if not kept.any():
            raise TraceError(f"trace {path}: every request exceeds the context of {limit} tokens")
        return kept, count
    answers[over] = np.minimum(answers[over], limit - 1)
    prompts[over] = limit - answers[over]
    return kept, count


def _rows(
    text: io.TextIOBase, path: Path, fmt: str, columns: TraceColumns
) -> Iterator[tuple[int, dict]]:
    needed = [
        name
        for name in (
            columns.arrival,
            columns.input_tokens,
            columns.output_tokens,
            columns.session,
            columns.blocks,
        )
        if name
    ]
    if fmt in ("mooncake", "jsonl"):
        for line, raw in enumerate(text, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as error:
                raise TraceError(f"trace {path}, line {line}: not JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"trace {path}, line {line}: not a JSON object")
            missing = [name for name in needed if name not in row]
            if missing:
                raise TraceError(
                    f"trace {path}, line {line}: no {', '.join(missing)} (its keys: "
                    f"{', '.join(sorted(map(str, row))[:8])})"
                )
            yield line, row
        return
    reader = csv.DictReader(text)
    header = reader.fieldnames or []
    missing = [name for name in needed if name not in header]
    if missing:
        raise TraceError(
            f"trace {path}: no column {', '.join(missing)} for format {fmt} (its header: "
            f"{', '.join(header[:8]) or 'none'})"
        )
    for row in reader:
        if None in row.values():
            raise TraceError(f"trace {path}, line {reader.line_num}: fewer fields than the header")
        yield reader.line_num, row


def _seconds(value: object, where: str, name: str) -> float:
    if isinstance(value, bool):
        raise TraceError(f"{where}: {name} {value!r} is not a time")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                seconds = datetime.fromisoformat(text).timestamp()
            except ValueError:
                raise TraceError(
                    f"{where}: {name} {text[:40]!r} is neither a number nor an ISO date"
                ) from None
            return seconds
    if not np.isfinite(seconds) or seconds < 0:
        raise TraceError(f"{where}: {name} {value!r} must be a finite time of 0 or more")
    return seconds


def _length(value: object, where: str, name: str, least: int = 1) -> int:
    try:
        number = float(value) if isinstance(value, int | float | str) else float("nan")
        number = float("nan") if isinstance(value, bool) else number
    except (TypeError, ValueError):
        number = float("nan")
    if not np.isfinite(number) or number != int(number) or number < least:
        raise TraceError(
            f"{where}: {name} {value!r} must be a whole number of tokens, at least {least}"
        )
    return int(number)


def _blocks(value: object, where: str, name: str) -> np.ndarray:
    if not isinstance(value, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in value
    ):
        raise TraceError(f"{where}: {name} must be a list of whole-number block ids")
    return np.asarray(value, dtype=np.int64)


def workload_from_trace(data: dict[str, Any], context: Any) -> dict[str, Any]:
    """A workload block that names a trace, with what the trace sets filled in: its arrival
    (the window's rate times the multiple), num_requests (the window's) and its lengths (as
    read), and the file's sha256 (a recorded one must still match)."""
    try:
        trace = Trace.model_validate(data["trace"], context=context)
    except ValidationError as error:  # said here: the fields it would fill are missing
        first = error.errors()[0]
        where = ".".join(["trace", *map(str, first["loc"])])
        raise ValueError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None
    for field in ("shared_prefix", "sessions", "burst"):
        if data.get(field) is not None:
            raise ValueError(
                f"workload.trace replays the trace's own requests: drop workload.{field}"
            )
    for field, kind in (
        ("arrival", "arrival"),
        ("input_tokens", "length"),
        ("output_tokens", "length"),
    ):
        given = data.get(field)
        if isinstance(given, dict) and given.get("kind") != "trace":
            raise ValueError(f"workload.{field}: the trace sets its {kind}s; drop workload.{field}")
    window = read_window(trace)
    if trace.sha256 is not None and trace.sha256 != window.sha256:
        raise ValueError(
            f"workload.trace: {trace.file} changed since the scenario recorded it "
            f"(sha256 {window.sha256[:12]}, not {trace.sha256[:12]})"
        )
    read = trace.model_copy(update={"sha256": window.sha256})
    if trace.context_tokens is not None:
        read = read.model_copy(update={"over_context_requests": window.over_context})
    lengths = window.lengths()
    filled = {
        "arrival": {"kind": "trace", "rate": trace.rate_multiple * window.rate},
        "num_requests": len(window),
    } | {key: value for key, value in data.items() if key in ("arrival", "num_requests")}
    for field, name in (("input_tokens", "input"), ("output_tokens", "output")):
        low, high, mean = lengths[name]
        filled[field] = {"kind": "trace", "min": low, "max": high, "mean": mean}
    return {**data, **filled, "trace": read.model_dump(exclude_none=True)}
