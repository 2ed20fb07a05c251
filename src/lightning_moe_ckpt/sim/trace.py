"""Failure traces: wall-clock failure times replayed instead of Poisson draws.

A trace file (``sim.failures.trace``) is either JSON, ``{"failure_times_s": [...]}`` or a
bare list, or plain text with one time in seconds per line (``#`` starts a comment), as
for the 6-hour GCP trace the paper replays in §5.3. Times must be finite and >= 0; they
are sorted on load. The trace's mean MTBF (run length over failure count) plans the
policies whose plan depends on the MTBF, such as Gemini's oracle interval.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lightning_moe_ckpt.errors import ConfigError, require


def _times(values: Any, where: str) -> tuple[float, ...]:
    require(isinstance(values, list), f"{where} must be a list of failure times in seconds")
    times = []
    for index, value in enumerate(values):
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and value >= 0)
        require(ok, f"{where}[{index}]={value!r} must be a finite time >= 0 (seconds)")
        times.append(float(value))
    return tuple(sorted(times))


def load_failure_trace(path: str | Path, key: str = "sim.failures.trace") -> tuple[float, ...]:
    """Failure times in seconds from the start of the run, sorted.

    Args:
        path: A JSON file (``{"failure_times_s": [...]}`` or a bare list) or plain text
            with one time in seconds per line (``#`` starts a comment).
        key: The configuration key the path came from, naming it in errors.

    Returns:
        The failure times, sorted.

    Raises:
        ConfigError: The file is missing or malformed, or a time is not finite and >= 0.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{key}={str(path)!r}: no such failure trace file")
    text = file.read_text()
    where = f"{key}={str(path)!r}"
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{where} is not valid JSON: {error}") from None
        if isinstance(data, dict):
            require("failure_times_s" in data, f"{where} lacks 'failure_times_s'")
            data = data["failure_times_s"]
        return _times(data, where)
    values: list[Any] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            values.append(float(line))
        except ValueError:
            raise ConfigError(f"{where} line {number}: {line!r} is not a number") from None
    return _times(values, where)


def trace_mtbf_s(times: tuple[float, ...], run_s: float) -> float:
    """Mean time between the trace's failures within the run."""
    count = sum(1 for t in times if t < run_s)
    return run_s / count if count else math.inf
