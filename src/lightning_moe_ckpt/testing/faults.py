"""Failure injection: when and where ranks fail, and what a failed rank loses.

A :class:`FailureEvent` kills one rank at one optimizer step (0-based) in one phase of it
(forward, backward, optimizer: the iteration is aborted and redone; during the snapshot
copy or the replication of the previous step's snapshot: that snapshot never completes;
recovery: the rank fails while the recovery from the step's other failures is under way,
a cascading failure). Schedules
answer :meth:`events_at` for the step about to run: :class:`AtSchedule` lists events
(``faults=at``), :class:`MtbfSchedule` draws a seeded Poisson process with mean
``faults.mtbf_steps`` steps between failures on uniformly random ranks, and
:class:`TraceSchedule` replays a JSON or CSV file of ``{step | time_s, rank[, phase]}``
rows, wall-clock times converted with the iteration time. :func:`destroy_rank_state` does
to a live process what the failure of its GPU worker would: parameters become garbage,
master weights and optimizer state are gone and its host snapshots and logs dropped, so a
recovery can only succeed from what its peers hold. Bad configuration raises
:class:`~lightning_moe_ckpt.errors.ConfigError` naming the key and value, before training.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import torch
from torch import nn

from lightning_moe_ckpt.core.nodes import launcher_node_size
from lightning_moe_ckpt.core.operators import persistent_buffers
from lightning_moe_ckpt.core.optimizer_state import OptimizerStateAccess
from lightning_moe_ckpt.errors import ConfigError, fmt, require

Phase = Literal["forward", "backward", "optimizer", "snapshot_copy", "replication",
                "recovery", "durable_write"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "optimizer", "snapshot_copy",
                             "replication", "recovery", "durable_write")
SCHEDULES = ("none", "at", "mtbf", "trace")
# simulated: every rank knows the schedule and recovers together, the failed rank's state
# is destroyed in place (the simulator-calibrated benchmark); the others are real: the
# failing rank does it to itself and nobody else reads the schedule. disk_full: from its
# step on, every file the rank writes fails with ENOSPC (the process lives on).
FaultKind = Literal["simulated", "kill", "exit", "exception", "hang", "disk_full",
                    "sigterm"]
KINDS: tuple[FaultKind, ...] = ("simulated", "kill", "exit", "exception", "hang",
                                "disk_full", "sigterm")


@dataclass(frozen=True, order=True)
class FailureEvent:
    """Rank ``rank`` fails during ``phase`` of optimizer step ``step``.

    Args:
        step: The optimizer step (0-based) the failure strikes.
        rank: The rank that fails.
        phase: The phase of the step it fails in (one of :data:`PHASES`); default
            ``"optimizer"``. ``"durable_write"`` (with ``kind="kill"``): in the middle of
            writing the rank's file of the first durable checkpoint taken from that step
            on.
        kind: How it fails: ``"simulated"`` (default; its state is destroyed in place and
            every rank recovers together) or a real failure the rank does to itself:
            ``"kill"`` (SIGKILL), ``"exit"`` (``os._exit(1)``), ``"exception"`` (an
            exception in the training step), ``"hang"`` (no progress), ``"sigterm"`` (a
            SIGTERM to this process alone, as an OOM killer or a node agent sends it:
            its failure, not the job's preemption) or ``"disk_full"``
            (from that step on every file it writes into its checkpoint directories fails
            with ENOSPC, the writes taken before having ended; it trains on).
    """

    step: int
    rank: int
    phase: Phase = "optimizer"
    kind: FaultKind = "simulated"

    @property
    def real(self) -> bool:
        """Whether the process itself fails (killed, exits, raises or hangs)."""
        return self.kind != "simulated"


class FaultSchedule(Protocol):
    """Anything that says which failures fire at a step (and lists them all)."""

    events: tuple[FailureEvent, ...]

    def events_at(self, step: int) -> list[FailureEvent]:
        """Failures of ``step``, in (rank, phase) order."""
        ...


class _ListedSchedule:
    """A schedule given by its full list of events."""

    def __init__(self, events: Iterable[FailureEvent]) -> None:
        self.events: tuple[FailureEvent, ...] = tuple(sorted(set(events)))
        self._by_step: dict[int, list[FailureEvent]] = {}
        for event in self.events:
            self._by_step.setdefault(event.step, []).append(event)

    def events_at(self, step: int) -> list[FailureEvent]:
        """Failures of ``step``, in (rank, phase) order."""
        return list(self._by_step.get(step, ()))


class NoFaults(_ListedSchedule):
    """``faults=none``: nothing ever fails."""

    def __init__(self) -> None:
        super().__init__(())


def parse_kind(value: object, key: str) -> FaultKind:
    """Validate a fault kind (``faults.kind`` or an event's ``kind``)."""
    require(value in KINDS, f"{fmt(key, value)} is unknown; choose one of {', '.join(KINDS)}")
    return cast(FaultKind, value)


def parse_event(row: Mapping[str, Any], where: str, world_size: int | None = None,
                default_phase: Phase = "optimizer",
                default_kind: FaultKind = "simulated") -> FailureEvent:
    """One ``{step, rank[, phase, kind]}`` row, validated.

    Args:
        row: The row: ``step`` and ``rank`` (integers >= 0), optionally ``phase`` and
            ``kind``.
        where: Names the row in errors (e.g. ``faults.events[0]``).
        world_size: Ranks in the job; a rank outside it is refused. ``None``: not checked.
        default_phase: The phase of a row that gives none.
        default_kind: The kind of a row that gives none.

    Returns:
        The failure event.

    Raises:
        ConfigError: The row has unknown keys, lacks ``step`` or ``rank``, or has a bad
            value; the message names it by ``where``.
    """
    require(isinstance(row, Mapping), f"{where}={row!r} must be a mapping {{step, rank}}")
    unknown = sorted(set(row) - {"step", "rank", "phase", "kind"})
    require(not unknown,
            f"{where} has unknown keys {unknown}; expected step, rank, phase, kind")
    for key in ("step", "rank"):
        require(key in row, f"{where} lacks {key!r}")
        value = row[key]
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                f"{fmt(f'{where}.{key}', value)} must be an integer >= 0")
    rank = int(row["rank"])
    if world_size is not None:
        require(rank < world_size, f"{where}.rank={rank} is outside world size {world_size}")
    phase = row.get("phase", default_phase)
    require(phase in PHASES,
            f"{fmt(f'{where}.phase', phase)} is unknown; choose one of {', '.join(PHASES)}")
    kind = parse_kind(row.get("kind", default_kind), f"{where}.kind")
    # The replication thread can only take the process down with it; an exception or a
    # hang there would leave the training thread running as if nothing happened.
    require(phase != "replication" or kind in ("simulated", "kill", "exit"),
            f"{fmt(f'{where}.kind', kind)} cannot strike in phase replication; use kill "
            "or exit there")
    require(phase != "durable_write" or kind == "kill",
            f"{fmt(f'{where}.kind', kind)} cannot strike in phase durable_write; use kill "
            "there (a process killed in the middle of a write)")
    require(kind != "disk_full" or phase == "optimizer",
            f"{fmt(f'{where}.phase', phase)} means nothing for kind disk_full (the disk "
            "stays full from the step on); leave the phase out")
    return FailureEvent(int(row["step"]), rank, cast(Phase, phase), kind)


class AtSchedule(_ListedSchedule):
    """``faults=at``: the listed ``{step, rank[, phase]}`` failures.

    A row may name a ``node`` instead of a ``rank``: every rank of that node fails at that
    step (a whole machine lost at once), node ``n`` running ranks ``n * R`` to
    ``n * R + R - 1`` with ``R`` ranks per node.

    Args:
        events: The failures: events, or ``{step, rank | node[, phase, kind]}`` rows (each
            validated by :func:`parse_event`).
        world_size: Ranks in the job; an event on a rank outside it is refused. ``None``:
            not checked.
        key: The configuration key the events came from, naming them in errors.
        kind: The kind of an event that gives none (``faults.kind``).
        ranks_per_node: ``R``, for rows that name a node; ``None``: the launcher's
            (:func:`~lightning_moe_ckpt.core.nodes.launcher_node_size`).

    Raises:
        ConfigError: An event is malformed, or names a node with no ranks per node known;
            the message names it (``faults.events[i]``).
    """

    def __init__(self, events: Iterable[FailureEvent | Mapping[str, Any]],
                 world_size: int | None = None, key: str = "faults.events",
                 kind: FaultKind = "simulated", ranks_per_node: int | None = None) -> None:
        parsed = []
        for index, event in enumerate(events):
            where = f"{key}[{index}]"
            if isinstance(event, FailureEvent):
                event = {"step": event.step, "rank": event.rank, "phase": event.phase,
                         "kind": event.kind}
            for row in _node_rows(event, where, world_size, ranks_per_node):
                parsed.append(parse_event(row, where, world_size, default_kind=kind))
        super().__init__(parsed)


def _node_rows(row: Mapping[str, Any], where: str, world_size: int | None,
               ranks_per_node: int | None) -> list[Mapping[str, Any]]:
    """A row naming a ``node`` as one row per rank of that node; any other row as is."""
    if not isinstance(row, Mapping) or "node" not in row:
        return [row]
    require("rank" not in row, f"{where} names both a rank and a node; name one")
    node = row["node"]
    require(isinstance(node, int) and not isinstance(node, bool) and node >= 0,
            f"{fmt(f'{where}.node', node)} must be an integer >= 0")
    size = ranks_per_node if ranks_per_node is not None else launcher_node_size()
    require(size is not None,
            f"{where}.node={node} needs the ranks per node: set parallel.ranks_per_node "
            "(python -m lightning_moe_ckpt.supervise --ranks-per-node), or run under a "
            "launcher that says it (LOCAL_WORLD_SIZE, SLURM)")
    assert size is not None
    if world_size is not None:
        require((node + 1) * size <= world_size,
                f"{where}.node={node} is outside the {world_size // size} nodes of "
                f"{size} ranks (world size {world_size})")
    rest = {key: value for key, value in row.items() if key != "node"}
    return [{**rest, "rank": node * size + local} for local in range(size)]


class MtbfSchedule(_ListedSchedule):
    """``faults=mtbf``: a Poisson process of failures on uniformly random ranks.

    The same seed gives the same failures. Failure times are continuous; a failure fires in
    the step it falls in.

    Args:
        mtbf_steps: Mean steps between failures (a finite number > 0).
        world_size: Ranks in the job; failures strike uniformly random ones.
        seed: Seed of the schedule's private random generator.
        max_steps: Steps the run trains; failures are drawn over them.
        phase: The phase every failure strikes in.

    Raises:
        ConfigError: A bad value, naming its ``faults.<key>``.
    """

    def __init__(self, mtbf_steps: float, world_size: int, seed: int, max_steps: int,
                 phase: Phase = "optimizer") -> None:
        ok = isinstance(mtbf_steps, (int, float)) and not isinstance(mtbf_steps, bool)
        require(ok and math.isfinite(mtbf_steps) and mtbf_steps > 0,
                f"faults.mtbf_steps={mtbf_steps!r} must be a finite number > 0")
        require(world_size >= 1, f"world size {world_size} must be >= 1")
        require(max_steps >= 0, f"trainer.max_steps={max_steps} must be >= 0")
        require(phase in PHASES,
                f"{fmt('faults.phase', phase)} is unknown; choose one of {', '.join(PHASES)}")
        self.mtbf_steps = float(mtbf_steps)
        # A private generator: the schedule must not depend on (or disturb) global RNG use.
        rng = random.Random(seed)
        events = []
        time = rng.expovariate(1.0 / self.mtbf_steps)
        while time < max_steps:
            events.append(FailureEvent(int(time), rng.randrange(world_size), phase))
            time += rng.expovariate(1.0 / self.mtbf_steps)
        super().__init__(events)


class TraceSchedule(_ListedSchedule):
    """``faults=trace``: failures read from a JSON or CSV file.

    JSON: a list of rows, or ``{"events": [...]}``. CSV: a header naming the columns. A row
    has ``rank``, optionally ``phase``, and either ``step`` or ``time_s`` (seconds since
    the start of training, converted to the step running then with ``iteration_s``).

    Args:
        path: The ``.json`` or ``.csv`` file.
        world_size: Ranks in the job; a row on a rank outside it is refused. ``None``: not
            checked.
        iteration_s: Seconds per step, converting ``time_s`` rows to steps; ``None``: the
            trace must give steps.
        key: The configuration key the path came from, naming it in errors.

    Raises:
        ConfigError: The file is missing, unreadable or has a bad row; the message names
            the file and the row.
    """

    def __init__(self, path: str | Path, world_size: int | None = None,
                 iteration_s: float | None = None, key: str = "faults.path") -> None:
        file = Path(path)
        where = f"{key}={str(path)!r}"
        require(file.is_file(), f"{where}: no such failure trace file")
        if iteration_s is not None:
            require(math.isfinite(iteration_s) and iteration_s > 0,
                    f"faults.iteration_s={iteration_s!r} must be a finite number > 0")
        rows = _read_rows(file, where)
        events = []
        for index, row in enumerate(rows):
            row_where = f"{where} row {index}"
            if "time_s" in row:
                require("step" not in row, f"{row_where} gives both step and time_s")
                require(iteration_s is not None,
                        f"{row_where} gives time_s; set faults.iteration_s to convert it to "
                        "steps")
                time_s = row["time_s"]
                require(isinstance(time_s, (int, float)) and math.isfinite(time_s)
                        and time_s >= 0, f"{row_where}.time_s={time_s!r} must be >= 0")
                assert iteration_s is not None
                row = {**{k: v for k, v in row.items() if k != "time_s"},
                       # rounded first: 0.45 s at 0.05 s an iteration is the start of
                       # step 9, though 0.45 / 0.05 is 8.999... in binary floating point
                       "step": math.floor(round(time_s / iteration_s, 9))}
            events.append(parse_event(row, row_where, world_size))
        super().__init__(events)


def _read_rows(file: Path, where: str) -> list[Any]:
    text = file.read_text()
    if file.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{where} is not valid JSON: {error}") from None
        if isinstance(data, dict):
            require("events" in data, f"{where} lacks 'events'")
            data = data["events"]
        require(isinstance(data, list), f"{where} must hold a list of failure rows")
        return data  # rows are checked one by one, naming their index
    require(file.suffix.lower() == ".csv",
            f"{where}: failure traces are .json or .csv files")
    rows: list[Any] = []
    for row in csv.DictReader(line for line in text.splitlines()
                              if line.strip() and not line.lstrip().startswith("#")):
        rows.append({k.strip(): _number(v.strip()) for k, v in row.items()
                     if k is not None and v is not None and v.strip()})
    return rows


def _number(text: str) -> Any:
    """CSV cells are strings: integers and floats become numbers, names stay text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def schedule_from_config(values: Mapping[str, Any], *, world_size: int, max_steps: int,
                         seed: int, iteration_s: float | None = None,
                         ranks_per_node: int | None = None) -> FaultSchedule:
    """The schedule of a ``faults`` config section (``name`` in none, at, mtbf, trace).

    Args:
        values: The ``faults`` section: ``name`` and the keys of that schedule.
        world_size: Ranks in the job.
        max_steps: Steps the run trains; a failure at a later step is refused.
        seed: The default of ``faults.seed``.
        iteration_s: The default of ``faults.iteration_s`` (converting a trace's
            ``time_s``), e.g. a profiled iteration time; ``None``: no default.
        ranks_per_node: Ranks per node, for events that name a node (``faults=at``);
            ``None``: the launcher's.

    Returns:
        The schedule; with a ``faults.kind`` other than ``simulated`` every event has that
        kind.

    Raises:
        ConfigError: A bad value, or a failure that would never fire (outside the world or
            past ``max_steps``); the message names the key.
    """
    name = values.get("name", "none")
    require(name in SCHEDULES,
            f"{fmt('faults.name', name)} is unknown; choose one of {', '.join(SCHEDULES)}")
    kind = parse_kind(values.get("kind", "simulated"), "faults.kind")
    if name == "none":
        return NoFaults()
    if name == "at":
        events = values.get("events")
        if not isinstance(events, Sequence) or isinstance(events, str):
            raise ConfigError(f"faults.events={events!r} must be a list of "
                              "{step, rank | node[, phase, kind]}")
        at = AtSchedule(events, world_size, kind=kind, ranks_per_node=ranks_per_node)
        check_reachable(at, world_size=world_size, max_steps=max_steps, where="faults=at")
        return at
    schedule: _ListedSchedule
    if name == "mtbf":
        require("mtbf_steps" in values, "faults=mtbf needs faults.mtbf_steps")
        seed_value = values.get("seed")
        schedule = MtbfSchedule(values["mtbf_steps"], world_size,
                                seed if seed_value is None else int(seed_value), max_steps,
                                values.get("phase", "optimizer"))
    else:
        path = values.get("path")
        if not isinstance(path, (str, Path)):
            raise ConfigError(f"faults=trace needs faults.path (got {path!r})")
        configured = values.get("iteration_s")
        schedule = TraceSchedule(path, world_size,
                                 iteration_s if configured is None else float(configured))
    check_reachable(schedule, world_size=world_size, max_steps=max_steps,
                    where=f"faults={name}")
    if kind == "simulated":
        return schedule
    return _ListedSchedule(replace(event, kind=kind) for event in schedule.events)


def check_reachable(schedule: FaultSchedule, *, world_size: int, max_steps: int | None,
                    where: str) -> None:
    """Refuse failures that would never fire: on a rank outside the world, or at a step
    the run never reaches (``max_steps=None``: no end). A test whose fault silently does
    not happen tests nothing."""
    outside = [event for event in schedule.events if event.rank >= world_size]
    require(not outside, f"{where}: a failure on rank {outside[0].rank if outside else 0} "
                         f"is outside world size {world_size}; it would never fire")
    beyond = [event for event in schedule.events
              if max_steps is not None and event.step >= max_steps]
    require(not beyond, f"{where}: {len(beyond)} failure(s) at steps >= trainer.max_steps="
                        f"{max_steps} (the first at step {beyond[0].step if beyond else 0}); "
                        "they would never fire")


def has_real_faults(schedule: FaultSchedule) -> bool:
    """Whether any event of ``schedule`` is a real failure of a process (needs the
    supervisor; a full disk does not end the process)."""
    return isinstance(schedule, _ListedSchedule) and any(
        e.real and e.kind != "disk_full" for e in schedule.events)


@dataclass
class FailureCounter:
    """What the injector fired, for metrics.

    Args:
        events: The fired failures, in firing order (default: none yet).
    """

    events: list[FailureEvent] = field(default_factory=list)

    def record(self, event: FailureEvent) -> None:
        """Count one fired failure."""
        self.events.append(event)

    @property
    def total(self) -> int:
        """Failures fired so far."""
        return len(self.events)

    def by_phase(self) -> dict[str, int]:
        """Fired failures per phase."""
        return dict(Counter(e.phase for e in self.events))

    def by_rank(self) -> dict[int, int]:
        """Fired failures per rank."""
        return dict(Counter(e.rank for e in self.events))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``metrics.json``)."""
        return {"total": self.total, "by_phase": self.by_phase(),
                "by_rank": {str(r): n for r, n in sorted(self.by_rank().items())},
                "events": [{"step": e.step, "rank": e.rank, "phase": e.phase}
                           for e in self.events]}


@dataclass(frozen=True)
class LostState:
    """What :func:`destroy_rank_state` destroyed (counts).

    Attributes:
        parameters: Parameters (compute weights) garbled.
        master_weights: Master weights garbled (those that are not the parameters
            themselves).
        optimizer_states: Parameters whose optimizer state was emptied.
        host_stores: Local host stores dropped (the callables called).
        buffers: Persistent module buffers garbled.
    """

    parameters: int
    master_weights: int
    optimizer_states: int
    host_stores: int
    buffers: int = 0


@torch.no_grad()
def destroy_rank_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                       host_state_droppers: Iterable[Callable[[], None]] = (), *,
                       garbage: Literal["nan", "random"] = "nan",
                       seed: int = 0) -> LostState:
    """Destroy what a dead GPU worker loses, in place on this process.

    Parameters (compute weights) are overwritten with NaN or random values and lose their
    gradients; master weights (the copies a
    :class:`~lightning_moe_ckpt.core.precision.MasterWeightOptimizer` keeps) are garbled the
    same way and the optimizer state is emptied; each callable in ``host_state_droppers``
    drops one local host store (snapshots, upstream log). Tensors are overwritten rather
    than replaced, so every reference the training objects hold sees the loss.

    Args:
        model: The module whose parameters and persistent buffers are garbled.
        optimizer: Its optimizer, whose master weights are garbled and whose state is
            emptied; ``None``: no optimizer state to destroy.
        host_state_droppers: Callables that each drop one local host store.
        garbage: What overwrites the tensors: ``"nan"`` (integer tensors get random
            values) or ``"random"`` (large random values: finite, but nothing like a
            trained weight).
        seed: Seed of the random values.

    Returns:
        What was destroyed (counts).

    Raises:
        ConfigError: ``garbage`` is neither ``"nan"`` nor ``"random"``.
    """
    require(garbage in ("nan", "random"),
            f"garbage={garbage!r} is unknown; choose nan or random")
    generator = torch.Generator().manual_seed(seed)

    def garble(tensor: torch.Tensor) -> None:
        if garbage == "nan" and tensor.is_floating_point():
            tensor.fill_(math.nan)
        else:  # large random values: finite, but nothing like a trained weight
            noise = torch.randn(tensor.shape, generator=generator, device="cpu") * 1e3
            tensor.copy_(noise.to(dtype=tensor.dtype, device=tensor.device))

    params = list(model.parameters())
    for param in params:
        garble(param)
        param.grad = None
    buffers = persistent_buffers(model)  # the others the model rebuilds itself
    for buffer in buffers:
        garble(buffer.tensor)
    masters: list[torch.Tensor] = []
    states = 0
    if optimizer is not None:
        access = OptimizerStateAccess(optimizer)
        # Masters that are the parameters themselves (fp32) are garbled already.
        masters = [m for p in params if (m := access.master(p)) is not p]
        for master in masters:
            garble(master)
            master.grad = None
        states = len(optimizer.state)
        access.clear()
    droppers = list(host_state_droppers)
    for drop in droppers:
        drop()
    return LostState(len(params), len(masters), states, len(droppers), len(buffers))
