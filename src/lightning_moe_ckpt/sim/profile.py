"""Measured timings that replace the hardware preset's estimates (simulator calibration).

``recipes/bench.py`` profiles a real run and writes a JSON file; passing it as
``sim.profile=<path>`` makes the simulator use the measured per-stage compute instead of
FLOPs / (peak x MFU), and measured bandwidths instead of the preset's. The schema
(version 1; times in seconds per micro-batch on one GPU of the stage, rates in Gbit/s as
in ``conf/hardware``)::

    {
      "schema": "lightning-moe-ckpt/sim-profile",
      "version": 1,
      "source": "recipes/bench.py",          # optional, informational
      "hardware": "cpu",                     # optional, informational
      "model": "tiny",                       # optional; must match the simulated model
      "pp": 2,                               # optional; must match the plan's pp
      "microbatches": 4,                     # optional; must match the plan's
      "stages": [                            # required, one entry per pipeline stage
        {"forward_s": 0.011, "backward_s": 0.023},
        {"forward_s": 0.012, "backward_s": 0.025}
      ],
      "grad_sync_s": 0.004,                  # optional: gradient all-reduce per iteration
      "optimizer_s": 0.006,                  # optional: optimizer step per iteration
      "iteration_s": 0.31,                   # optional: measured fault-free iteration
      "bandwidth_gbps": {                    # optional, each key optional
        "device_to_host": 80, "intra_node": 80, "inter_node": 10, "remote_storage": 2
      }
    }

Stage times include the expert all-to-all (the profiler measures the stage as it runs).
The split of a stage's backward into input- and weight-gradient work (which sets the
frozen-operator replay cost) keeps the model's FLOP ratio: a measured stage scales the
modelled one by ``(forward_s + backward_s) / modelled time``. :func:`profile_document`
and :func:`write_profile` produce such a file (validated by the same parser that reads it).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_moe_ckpt.errors import ConfigError, require
from lightning_moe_ckpt.sim.inputs import ClusterSpec

PROFILE_SCHEMA = "lightning-moe-ckpt/sim-profile"
PROFILE_VERSION = 1
_BANDWIDTH_KEYS = {"device_to_host": "device_to_host_gbps", "intra_node": "intra_node_gbps",
                   "inter_node": "inter_node_gbps", "remote_storage": "remote_storage_gbps"}
_TOP_KEYS = {"schema", "version", "model", "pp", "microbatches", "stages", "grad_sync_s",
             "optimizer_s", "iteration_s", "bandwidth_gbps", "source", "hardware"}


@dataclass(frozen=True)
class StageProfile:
    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class MeasuredProfile:
    """A parsed profile file (see the module docstring for the schema).

    Attributes:
        path: The file it was read from.
        stages: Per pipeline stage, the measured forward and backward seconds per
            micro-batch on one GPU.
        model: The model it was measured on; ``None``: not given.
        pp: Pipeline stages of the measured run; ``None``: not given.
        microbatches: Micro-batches of the measured run; ``None``: not given.
        grad_sync_s: Gradient all-reduce per iteration, seconds; ``None``: modelled.
        optimizer_s: Optimizer step per iteration, seconds; ``None``: modelled.
        iteration_s: The measured fault-free iteration, seconds; ``None``: not given.
        bandwidth_gbps: Measured rates in Gbit/s (``device_to_host``, ``intra_node``,
            ``inter_node``, ``remote_storage``; each optional), replacing the preset's.
    """

    path: str
    stages: tuple[StageProfile, ...]
    model: str | None = None
    pp: int | None = None
    microbatches: int | None = None
    grad_sync_s: float | None = None
    optimizer_s: float | None = None
    iteration_s: float | None = None
    bandwidth_gbps: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def apply_bandwidths(self, cluster: ClusterSpec) -> ClusterSpec:
        """The cluster with measured bandwidths in place of the preset's."""
        rates = {field: float(getattr(cluster, field)) for field in _BANDWIDTH_KEYS.values()}
        rates.update({_BANDWIDTH_KEYS[name]: gbps for name, gbps in self.bandwidth_gbps.items()})
        return dataclasses.replace(
            cluster, device_to_host_gbps=rates["device_to_host_gbps"],
            intra_node_gbps=rates["intra_node_gbps"], inter_node_gbps=rates["inter_node_gbps"],
            remote_storage_gbps=rates["remote_storage_gbps"])

    def check_plan(self, model: str, pp: int, microbatches: int, key: str) -> None:
        """The profile must describe the simulated job's model and pipeline."""
        require(self.model is None or self.model == model,
                f"{key}={self.path!r} was measured on model {self.model!r}, "
                f"not the simulated {model!r}")
        require(len(self.stages) == pp and (self.pp is None or self.pp == pp),
                f"{key}={self.path!r} has {len(self.stages)} stage(s) but the plan has pp={pp}")
        require(self.microbatches is None or self.microbatches == microbatches,
                f"{key}={self.path!r} was measured with {self.microbatches} micro-batches, "
                f"the plan has {microbatches}")


def _seconds(values: Mapping[str, Any], name: str, where: str, required: bool) -> float | None:
    if name not in values:
        if required:
            raise ConfigError(f"{where} lacks {name!r}")
        return None
    value = values[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    require(ok and value >= 0, f"{where}.{name}={value!r} must be a finite number >= 0")
    return float(value)


def parse_profile(data: Any, path: str = "<profile>", key: str = "sim.profile") -> MeasuredProfile:
    """Validate a decoded profile document."""
    where = f"{key}={path!r}"
    require(isinstance(data, dict), f"{where} must hold a JSON object")
    require(data.get("schema") == PROFILE_SCHEMA,
            f"{where} has schema {data.get('schema')!r}, expected {PROFILE_SCHEMA!r}")
    require(data.get("version") == PROFILE_VERSION,
            f"{where} has version {data.get('version')!r}; this simulator reads version "
            f"{PROFILE_VERSION}")
    unknown = sorted(set(data) - _TOP_KEYS)
    require(not unknown, f"{where} has unknown key(s) {unknown}")
    stages = data.get("stages")
    require(isinstance(stages, list) and len(stages) > 0,
            f"{where} needs a non-empty 'stages' list")
    parsed = []
    for index, stage in enumerate(stages):
        at = f"{where}.stages[{index}]"
        require(isinstance(stage, dict), f"{at} must be an object")
        forward = _seconds(stage, "forward_s", at, required=True)
        backward = _seconds(stage, "backward_s", at, required=True)
        assert forward is not None and backward is not None
        require(forward + backward > 0, f"{at} has zero compute time")
        parsed.append(StageProfile(forward, backward))
    bandwidths = data.get("bandwidth_gbps", {})
    require(isinstance(bandwidths, dict), f"{where}.bandwidth_gbps must be an object")
    for name, value in bandwidths.items():
        require(name in _BANDWIDTH_KEYS,
                f"{where}.bandwidth_gbps.{name} is unknown; known: {sorted(_BANDWIDTH_KEYS)}")
        require(isinstance(value, (int, float)) and value > 0,
                f"{where}.bandwidth_gbps.{name}={value!r} must be > 0")
    for name in ("pp", "microbatches"):
        value = data.get(name)
        require(value is None or (isinstance(value, int) and value > 0),
                f"{where}.{name}={value!r} must be a positive integer")
    model = data.get("model")
    require(model is None or isinstance(model, str), f"{where}.model must be a string")
    iteration = _seconds(data, "iteration_s", where, required=False)
    require(iteration is None or iteration > 0, f"{where}.iteration_s must be > 0")
    return MeasuredProfile(
        path=path, stages=tuple(parsed), model=model, pp=data.get("pp"),
        microbatches=data.get("microbatches"),
        grad_sync_s=_seconds(data, "grad_sync_s", where, required=False),
        optimizer_s=_seconds(data, "optimizer_s", where, required=False),
        iteration_s=iteration,
        bandwidth_gbps={k: float(v) for k, v in bandwidths.items()})


def load_profile(path: str | Path, key: str = "sim.profile") -> MeasuredProfile:
    """Read and validate a profile file written by ``recipes/bench.py``.

    Args:
        path: The JSON file.
        key: The configuration key the path came from, naming it in errors.

    Returns:
        The parsed profile.

    Raises:
        ConfigError: The file is missing, not valid JSON or not a valid profile.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{key}={str(path)!r}: no such profile file")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{key}={str(path)!r} is not valid JSON: {error}") from None
    return parse_profile(data, str(path), key)


def profile_document(stages: Sequence[tuple[float, float]], *, model: str | None = None,
                     pp: int | None = None, microbatches: int | None = None,
                     iteration_s: float | None = None, optimizer_s: float | None = None,
                     grad_sync_s: float | None = None,
                     bandwidth_gbps: Mapping[str, float] | None = None,
                     hardware: str | None = None,
                     source: str = "recipes/bench.py") -> dict[str, Any]:
    """A version-1 profile document from measured ``(forward_s, backward_s)`` per stage;
    optional figures left ``None`` are omitted. Raises :class:`ConfigError` for anything the
    parser would reject."""
    document: dict[str, Any] = {
        "schema": PROFILE_SCHEMA, "version": PROFILE_VERSION, "source": source,
        "stages": [{"forward_s": float(f), "backward_s": float(b)} for f, b in stages]}
    optional = {"hardware": hardware, "model": model, "pp": pp, "microbatches": microbatches,
                "iteration_s": iteration_s, "optimizer_s": optimizer_s,
                "grad_sync_s": grad_sync_s}
    document.update({key: value for key, value in optional.items() if value is not None})
    if bandwidth_gbps:
        document["bandwidth_gbps"] = {k: float(v) for k, v in bandwidth_gbps.items()}
    parse_profile(document, "<new profile>", "profile")
    return document


def write_profile(path: str | Path, document: Mapping[str, Any]) -> MeasuredProfile:
    """Validate ``document`` and write it as JSON to ``path``; returns it parsed."""
    parsed = parse_profile(dict(document), str(path), "profile")
    Path(path).write_text(json.dumps(document, indent=2) + "\n")
    return parsed
