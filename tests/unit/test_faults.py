"""Failure injection: schedules, trace files, config errors, destroying a rank's state."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from lightning_moe_ckpt.core.precision import MasterWeightAdamW
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.recovery import UpstreamLog
from lightning_moe_ckpt.testing import (
    AtSchedule,
    FailureCounter,
    FailureEvent,
    MtbfSchedule,
    NoFaults,
    TraceSchedule,
    destroy_rank_state,
    schedule_from_config,
)
from lightning_moe_ckpt.testing.faults import check_reachable


def test_at_schedule_fires_listed_events_at_their_steps() -> None:
    schedule = AtSchedule([{"step": 13, "rank": 3}, {"step": 5, "rank": 0, "phase": "backward"},
                           FailureEvent(13, 1, "snapshot_copy")], world_size=4)
    assert schedule.events_at(13) == [FailureEvent(13, 1, "snapshot_copy"),
                                      FailureEvent(13, 3, "optimizer")]
    assert schedule.events_at(5) == [FailureEvent(5, 0, "backward")]
    assert schedule.events_at(6) == [] and NoFaults().events_at(0) == []


@pytest.mark.parametrize(("event", "message"), [
    ({"step": 1, "rank": 7}, r"faults\.events\[0\]\.rank=7 is outside world size 4"),
    ({"step": -1, "rank": 0}, r"faults\.events\[0\]\.step=-1 must be an integer >= 0"),
    ({"step": 1, "rank": 0, "phase": "lunch"}, r"faults\.events\[0\]\.phase='lunch' is unknown"),
    ({"step": 1}, r"faults\.events\[0\] lacks 'rank'"),
    ({"step": 1, "rank": 0, "when": 3}, r"faults\.events\[0\] has unknown keys \['when'\]"),
])
def test_at_schedule_errors_name_the_key(event: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AtSchedule([event], world_size=4)


def test_an_event_naming_a_node_fails_every_rank_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = AtSchedule([{"step": 13, "node": 1, "kind": "kill"}], world_size=6,
                          ranks_per_node=2)
    assert schedule.events_at(13) == [FailureEvent(13, 2, "optimizer", "kill"),
                                      FailureEvent(13, 3, "optimizer", "kill")]
    monkeypatch.setenv("MOE_RANKS_PER_NODE", "3")  # the supervisor's --ranks-per-node
    assert [e.rank for e in AtSchedule([{"step": 1, "node": 1}], world_size=6).events_at(1)
            ] == [3, 4, 5]


@pytest.mark.parametrize(("event", "per_node", "message"), [
    ({"step": 1, "node": 2}, 2, r"faults\.events\[0\]\.node=2 is outside the 2 nodes of 2 "
                                r"ranks \(world size 4\)"),
    ({"step": 1, "node": 0, "rank": 1}, 2, r"names both a rank and a node"),
    ({"step": 1, "node": -1}, 2, r"faults\.events\[0\]\.node=-1 must be an integer >= 0"),
    ({"step": 1, "node": 0}, None, r"node=0 needs the ranks per node: set "
                                   r"parallel\.ranks_per_node"),
])
def test_a_node_event_errors_name_the_key(event: dict[str, object], per_node: int | None,
                                          message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MOE_RANKS_PER_NODE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE",
                "SLURM_STEP_TASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match=message):
        AtSchedule([event], world_size=4, ranks_per_node=per_node)


def test_mtbf_schedule_is_deterministic_per_seed() -> None:
    first = MtbfSchedule(20, world_size=8, seed=3, max_steps=1000)
    again = MtbfSchedule(20, world_size=8, seed=3, max_steps=1000)
    other = MtbfSchedule(20, world_size=8, seed=4, max_steps=1000)
    assert first.events == again.events and first.events != other.events
    assert all(0 <= e.step < 1000 and 0 <= e.rank < 8 for e in first.events)
    assert [e for s in range(1000) for e in first.events_at(s)] == list(first.events)


def test_mtbf_schedule_has_the_requested_mean() -> None:
    # 200k steps at a mean of 50 steps: ~4000 failures, standard deviation ~63 (Poisson).
    # Allow 5%: more than 3 standard deviations, still tight enough to catch a wrong rate.
    mtbf, steps, world = 50.0, 200_000, 4
    schedule = MtbfSchedule(mtbf, world_size=world, seed=0, max_steps=steps)
    count = len(schedule.events)
    assert abs(count - steps / mtbf) <= 0.05 * steps / mtbf
    # Uniform ranks: each rank within 10% of its share.
    for rank in range(world):
        share = sum(1 for e in schedule.events if e.rank == rank)
        assert abs(share - count / world) <= 0.1 * count / world
    # Exponential inter-arrival times give ~1/mtbf of steps with a failure when mtbf >> 1.
    steps_hit = {e.step for e in schedule.events}
    assert abs(len(steps_hit) / steps - (1 - math.exp(-1 / mtbf))) < 0.002


@pytest.mark.parametrize("mtbf", [0, -5, math.inf])
def test_mtbf_must_be_positive(mtbf: float) -> None:
    with pytest.raises(ConfigError, match=r"faults\.mtbf_steps="):
        MtbfSchedule(mtbf, world_size=2, seed=0, max_steps=10)


def test_trace_json_and_csv_with_steps_and_timestamps(tmp_path: Path) -> None:
    as_json = tmp_path / "trace.json"
    as_json.write_text(json.dumps({"events": [
        {"step": 4, "rank": 1}, {"time_s": 10.5, "rank": 2, "phase": "replication"}]}))
    schedule = TraceSchedule(as_json, world_size=4, iteration_s=2.0)
    assert schedule.events == (FailureEvent(4, 1), FailureEvent(5, 2, "replication"))

    as_csv = tmp_path / "trace.csv"
    as_csv.write_text("# node failures\nstep,rank,phase\n3,0,forward\n9,3,\n")
    assert TraceSchedule(as_csv, world_size=4).events == (
        FailureEvent(3, 0, "forward"), FailureEvent(9, 3, "optimizer"))

    timed = tmp_path / "times.csv"
    timed.write_text("time_s,rank\n0.0,0\n2.99,1\n3.0,1\n")
    assert [e.step for e in TraceSchedule(timed, iteration_s=1.5).events] == [0, 1, 2]
    timed.write_text("time_s,rank\n0.45,0\n0.449,1\n")  # a boundary, and just before it
    assert [e.step for e in TraceSchedule(timed, iteration_s=0.05).events] == [8, 9]


def test_trace_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"faults\.path='.*missing\.json': no such failure"):
        TraceSchedule(tmp_path / "missing.json")
    timed = tmp_path / "times.csv"
    timed.write_text("time_s,rank\n1.0,0\n")
    with pytest.raises(ConfigError, match=r"row 0 gives time_s; set faults\.iteration_s"):
        TraceSchedule(timed)
    bad_rank = tmp_path / "rank.json"
    bad_rank.write_text('[{"step": 1, "rank": 9}]')
    with pytest.raises(ConfigError, match=r"row 0\.rank=9 is outside world size 4"):
        TraceSchedule(bad_rank, world_size=4)


def test_schedule_from_config(tmp_path: Path) -> None:
    cfg = OmegaConf.create({"name": "at", "events": [{"step": 13, "rank": 3}]})
    at = schedule_from_config(cfg, world_size=4, max_steps=20, seed=0)
    assert at.events_at(13) == [FailureEvent(13, 3)]
    with pytest.raises(ConfigError, match=r"faults\.events\[0\]\.rank=3 is outside world size 2"):
        schedule_from_config(cfg, world_size=2, max_steps=20, seed=0)
    mtbf = {"name": "mtbf", "mtbf_steps": 5}
    a = schedule_from_config(mtbf, world_size=4, max_steps=100, seed=1)
    b = schedule_from_config(mtbf, world_size=4, max_steps=100, seed=1)
    assert [a.events_at(s) for s in range(100)] == [b.events_at(s) for s in range(100)]
    with pytest.raises(ConfigError, match=r"faults\.mtbf_steps=0"):
        schedule_from_config({"name": "mtbf", "mtbf_steps": 0}, world_size=4, max_steps=1,
                             seed=0)
    with pytest.raises(ConfigError, match=r"faults\.name='sometimes' is unknown"):
        schedule_from_config({"name": "sometimes"}, world_size=4, max_steps=1, seed=0)
    with pytest.raises(ConfigError, match=r"faults=trace needs faults\.path"):
        schedule_from_config({"name": "trace"}, world_size=4, max_steps=1, seed=0)
    timed = tmp_path / "times.json"
    timed.write_text('[{"time_s": 7.0, "rank": 1}]')
    trace = {"name": "trace", "path": str(timed)}
    assert schedule_from_config(trace, world_size=4, max_steps=9, seed=0,
                                iteration_s=2.0).events_at(3) == [FailureEvent(3, 1)]
    assert schedule_from_config({**trace, "iteration_s": 7.0}, world_size=4, max_steps=9,
                                seed=0, iteration_s=2.0).events_at(1) == [FailureEvent(1, 1)]
    assert schedule_from_config({"name": "none"}, world_size=4, max_steps=9,
                                seed=0).events_at(0) == []


def test_failure_counter() -> None:
    counter = FailureCounter()
    for event in (FailureEvent(1, 0), FailureEvent(4, 2, "forward"), FailureEvent(4, 0)):
        counter.record(event)
    assert counter.total == 3
    assert counter.by_phase() == {"optimizer": 2, "forward": 1}
    assert counter.by_rank() == {0: 2, 2: 1}
    summary = counter.as_dict()
    assert summary["total"] == 3 and json.loads(json.dumps(summary)) == summary


def _trained(precision: str) -> tuple[nn.Module, MasterWeightAdamW]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    if precision == "bf16-master":
        model = model.to(torch.bfloat16)
    optimizer = MasterWeightAdamW(model.named_parameters(), precision)  # type: ignore[arg-type]
    x = torch.randn(3, 4, dtype=next(model.parameters()).dtype)
    model(x).float().sum().backward()
    optimizer.collect_grads()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("precision", ["32", "bf16-master"])
@pytest.mark.parametrize("garbage", ["nan", "random"])
def test_destroy_rank_state_garbles_weights_and_clears_optimizer(precision: str,
                                                                  garbage: str) -> None:
    model, optimizer = _trained(precision)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters_before = {n: m.detach().clone() for n, m in optimizer.master.items()}
    assert len(optimizer.state) == len(before)
    log = UpstreamLog()
    log.log_inputs(0, torch.zeros(2, 3, dtype=torch.long), None)
    dropped: list[str] = []

    lost = destroy_rank_state(model, optimizer, [log.drop, lambda: dropped.append("snap")],
                              garbage=garbage)  # type: ignore[arg-type]
    for name, param in model.named_parameters():
        assert not torch.equal(param, before[name]), name
        assert param.grad is None
        if garbage == "nan":
            assert bool(param.isnan().all())
    for name, master in optimizer.master.items():
        assert not torch.equal(master, masters_before[name]), name
    assert len(optimizer.state) == 0 and len(optimizer.inner.state) == 0
    assert log.nbytes() == 0 and dropped == ["snap"]
    separate_masters = 0 if precision == "32" else len(before)
    assert lost.parameters == len(before) and lost.master_weights == separate_masters
    assert lost.optimizer_states == len(before) and lost.host_stores == 2


def test_failures_that_would_never_fire_are_refused(tmp_path: Path) -> None:
    beyond = OmegaConf.create({"name": "at", "events": [{"step": 2, "rank": 0},
                                                        {"step": 99, "rank": 1}]})
    with pytest.raises(ConfigError, match=r"faults=at: 1 failure\(s\) at steps >= "
                                          r"trainer\.max_steps=3 \(the first at step 99\)"):
        schedule_from_config(beyond, world_size=2, max_steps=3, seed=0)
    rows = tmp_path / "long.csv"
    rows.write_text("step,rank\n1,0\n50,0\n60,1\n")
    with pytest.raises(ConfigError, match=r"faults=trace: 2 failure\(s\) at steps >= "
                                          r"trainer\.max_steps=10"):
        schedule_from_config({"name": "trace", "path": str(rows)}, world_size=2,
                             max_steps=10, seed=0)
    unchecked = AtSchedule([{"step": 2, "rank": 3}])  # the API: no world size given
    with pytest.raises(ConfigError, match=r"FailureInjector: a failure on rank 3 is outside "
                                          r"world size 1"):
        check_reachable(unchecked, world_size=1, max_steps=None, where="FailureInjector")
    check_reachable(unchecked, world_size=4, max_steps=3, where="FailureInjector")
