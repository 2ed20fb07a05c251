"""The sparse schedule: coverage, popularity order, minimal W (vs brute force), forced W,
the paper's Fig. 6 example and byte accounting on a real bf16 model."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models import MoEModelConfig, MoETransformer
from lightning_moe_ckpt.planning.schedule import (
    OperatorSpec,
    WindowSchedule,
    dense_bytes,
    order_operators,
    plan_window,
    specs_from_registry,
)


def _cuts(n: int, parts: int | None = None) -> list[list[int]]:
    """Every cut of ``range(n)`` into consecutive turns, as boundaries [0, ..., n]."""
    cuts = []
    for inner in range(n):
        if parts is not None and inner != parts - 1:
            continue
        for points in itertools.combinations(range(1, n), inner):
            cuts.append([0, *points, n])
    return cuts


def _costs(ordered: list[OperatorSpec], bounds: list[int]) -> list[int]:
    return [sum(s.master_state_bytes for s in ordered[a:b])
            + sum(s.compute_bytes for s in ordered[b:])
            for a, b in itertools.pairwise(bounds)]


def _ordered(specs: list[OperatorSpec]) -> list[OperatorSpec]:
    by_name = {s.name: s for s in specs}
    return [by_name[name] for name in order_operators(specs)]


@st.composite
def operator_specs(draw: st.DrawFn, max_size: int = 8,
                   master_at_least_compute: bool = False) -> list[OperatorSpec]:
    n = draw(st.integers(1, max_size))
    specs = []
    for i in range(n):
        compute = draw(st.integers(0, 1000))
        low = compute if master_at_least_compute else 0
        master = draw(st.integers(low, low + 6000))
        popularity = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]))
        specs.append(OperatorSpec(f"op{i}", compute, master, popularity))
    return specs


def _check_coverage(schedule: WindowSchedule, specs: list[OperatorSpec]) -> None:
    names = [s.name for s in specs]
    captured = [name for i in range(schedule.window) for name in schedule.master_at(i)]
    assert sorted(captured) == sorted(names)  # every operator's master state exactly once
    assert len(schedule.turns) == schedule.window
    for i in range(schedule.window):
        later = {name for turn in schedule.turns[i + 1:] for name in turn}
        assert set(schedule.compute_at(i)) == later  # waiting operators: compute weights
        assert not set(schedule.compute_at(i)) & set(schedule.master_at(i))
    popularity = {s.name: s.popularity for s in specs}
    shares = [popularity[name] for name in schedule.order]
    assert shares == sorted(shares)  # popular operators last


def test_paper_figure6_three_iteration_example() -> None:
    """§3.2 / Fig. 6: four experts, a non-expert (NE) and a gate (G) operator of equal size
    under fp16/fp32 mixed precision (2 vs 12 bytes per parameter). SS_10 captures E1, E2's
    master state and E3, E4, NE, G's compute weights; SS_11 E3, E4 and NE, G's compute
    weights; SS_12 NE and G. W_sparse = 3; per-snapshot size is 55% below dense."""
    params = 1000
    experts = [OperatorSpec(f"layers.0.moe.experts.{e}", 2 * params, 12 * params, share)
               for e, share in zip(range(1, 5), (0.1, 0.2, 0.3, 0.4), strict=True)]
    ne = OperatorSpec("layers.0.attn", 2 * params, 12 * params, 1.0)
    gate = OperatorSpec("layers.0.moe.gate", 2 * params, 12 * params, 1.0)
    specs = [*experts[::-1], ne, gate]  # given order: the tie (NE, G) keeps it
    # A budget of 35 KB per iteration: SS_10 = 12*2P + 2*4P = 32 KB fits, 3 turns of
    # masters (42 KB) do not; W = 2 would need a 38 KB+ snapshot.
    schedule = plan_window(specs, iteration_time_s=1.0, bandwidth_bytes_per_s=35_000)
    e1, e2, e3, e4 = (s.name for s in experts)
    assert schedule.window == 3 and schedule.fits
    assert schedule.turns == ((e1, e2), (e3, e4), ("layers.0.attn", "layers.0.moe.gate"))
    assert schedule.compute_at(0) == (e3, e4, "layers.0.attn", "layers.0.moe.gate")
    assert schedule.compute_at(1) == ("layers.0.attn", "layers.0.moe.gate")
    assert schedule.compute_at(2) == ()
    by_name = {s.name: s for s in specs}
    sizes = [schedule.snapshot_bytes(i, by_name) for i in range(3)]
    assert sizes == [32 * params, 28 * params, 24 * params]
    reduction = 1 - max(sizes) / dense_bytes(specs)
    assert reduction == pytest.approx(1 - 32 / 72) and round(100 * reduction) == 56  # "55%"
    assert not plan_window(specs, 1.0, 35_000, forced_window=2).fits


@settings(max_examples=150, deadline=None)
@given(specs=operator_specs(), budget=st.integers(1, 20_000))
def test_greedy_window_is_the_smallest_feasible_cut(specs: list[OperatorSpec],
                                                    budget: int) -> None:
    schedule = plan_window(specs, iteration_time_s=1.0, bandwidth_bytes_per_s=budget)
    _check_coverage(schedule, specs)
    ordered = _ordered(specs)
    feasible = [len(b) - 1 for b in _cuts(len(specs)) if max(_costs(ordered, b)) <= budget]
    if feasible:
        assert schedule.fits and schedule.window == min(feasible)
        by_name = {s.name: s for s in specs}
        assert all(schedule.snapshot_bytes(i, by_name) <= budget
                   for i in range(schedule.window))
    else:  # nothing fits: one operator per turn, flagged for the engine to report stall
        assert not schedule.fits and schedule.window == len(specs)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), specs=operator_specs(master_at_least_compute=True),
       budget=st.integers(1, 20_000))
def test_forced_window_is_exact_and_min_max(data: st.DataObject, specs: list[OperatorSpec],
                                            budget: int) -> None:
    window = data.draw(st.integers(1, len(specs)))
    schedule = plan_window(specs, 1.0, budget, forced_window=window)
    _check_coverage(schedule, specs)
    assert schedule.window == window
    ordered = _ordered(specs)
    best = min(max(_costs(ordered, b)) for b in _cuts(len(specs), window))
    largest = schedule.largest_snapshot_bytes({s.name: s for s in specs})
    assert largest == best
    assert schedule.fits == (largest <= budget)


@pytest.mark.parametrize("window", [0, -1])
def test_forced_window_out_of_range_names_the_key(window: int) -> None:
    specs = [OperatorSpec(f"op{i}", 2, 12, 0.5) for i in range(3)]
    with pytest.raises(ConfigError, match=rf"checkpoint\.window={window}"):
        plan_window(specs, 1.0, 100.0, forced_window=window)


def test_window_longer_than_the_operators_ends_in_empty_turns() -> None:
    """A rank with fewer operators than the W its peers agreed on (an unequal pipeline
    stage) captures one operator per turn, then nothing until the window ends."""
    specs = [OperatorSpec(f"op{i}", 2, 12, i / 10) for i in range(3)]
    schedule = plan_window(specs, 1.0, 100.0, forced_window=5)
    _check_coverage(schedule, specs)
    assert schedule.turns == (("op0",), ("op1",), ("op2",), (), ())
    assert [schedule.compute_at(i) for i in range(5)] == [("op1", "op2"), ("op2",), (), (),
                                                         ()]
    assert schedule.snapshot_bytes(4, {s.name: s for s in specs}) == 0
    assert WindowSchedule.from_dict(schedule.to_dict()) == schedule
    with pytest.raises(ValueError, match="only the last turns"):
        WindowSchedule(3, ("op0",), ((), ("op0",), ()))


def test_bad_profile_is_a_config_error() -> None:
    specs = [OperatorSpec("op", 2, 12, 0.5)]
    with pytest.raises(ConfigError, match="iteration time"):
        plan_window(specs, 0.0, 100.0)
    with pytest.raises(ConfigError, match="bandwidth"):
        plan_window(specs, 1.0, -5.0)


def test_operator_too_large_for_any_window_reports_instead_of_failing() -> None:
    specs = [OperatorSpec("small", 10, 60, 0.1), OperatorSpec("huge", 10, 10_000, 0.2)]
    schedule = plan_window(specs, 1.0, 1000.0)
    assert not schedule.fits
    assert schedule.turns == (("small",), ("huge",))


def test_order_is_stable_and_rejects_duplicates() -> None:
    specs = [OperatorSpec("b", 1, 1, 0.5), OperatorSpec("a", 1, 1, 0.5),
             OperatorSpec("c", 1, 1, 0.1)]
    assert order_operators(specs) == ("c", "b", "a")
    with pytest.raises(ValueError, match="duplicate"):
        order_operators([*specs, OperatorSpec("a", 1, 1, 0.2)])
    with pytest.raises(ValueError, match="popularity"):
        OperatorSpec("x", 1, 1, 1.5)


def test_schedule_round_trips_through_plain_python() -> None:
    specs = [OperatorSpec(f"op{i}", 2, 12, i / 10) for i in range(5)]
    schedule = plan_window(specs, 1.0, 30.0)
    encoded = json.loads(json.dumps(schedule.to_dict()))
    assert WindowSchedule.from_dict(encoded) == schedule
    broken = dict(encoded, turns=[["op0"], ["op0"]], window=2)
    with pytest.raises(ValueError):
        WindowSchedule.from_dict(broken)
    assert schedule.turn_of("op4") == schedule.window - 1


def test_bf16_model_snapshot_bytes_match_the_accounting() -> None:
    """Real operators of the default model in bf16-master: 2 bytes of compute weight and 12
    of master state per parameter; every snapshot's size and its reduction against a dense
    snapshot follow from the parameter counts alone."""
    model = MoETransformer(MoEModelConfig()).to(torch.bfloat16)
    registry = OperatorRegistry(model)
    generator = torch.Generator().manual_seed(0)
    popularity = {op.name: float(torch.rand((), generator=generator))
                  for op in registry if op.kind == "expert"}
    specs = specs_from_registry(registry, popularity=popularity)
    numel = {op.name: op.numel for op in registry}
    for spec in specs:
        assert spec.compute_bytes == 2 * numel[spec.name]
        assert spec.master_state_bytes == 12 * numel[spec.name]
    total = sum(numel.values())
    dense = dense_bytes(specs)
    assert dense == 12 * total
    by_name = {s.name: s for s in specs}
    for fraction in (0.25, 0.4, 0.6):
        schedule = plan_window(specs, 1.0, fraction * dense)
        assert schedule.fits
        _check_coverage(schedule, list(specs))
        sizes = []
        for i in range(schedule.window):
            turn = sum(numel[name] for name in schedule.master_at(i))
            waiting = sum(numel[name] for name in schedule.compute_at(i))
            assert schedule.snapshot_bytes(i, by_name) == 12 * turn + 2 * waiting
            sizes.append(12 * turn + 2 * waiting)
        reduction = 1 - max(sizes) / dense
        assert reduction >= 1 - fraction  # every snapshot within budget
        # The W snapshots carry every master state once, so the largest is >= dense / W.
        assert max(sizes) >= dense / schedule.window
    non_experts = [s.name for s in specs if s.popularity == 1.0]
    final = plan_window(specs, 1.0, 0.4 * dense)
    assert set(final.order[-len(non_experts):]) == set(non_experts)  # every token: last


def test_headroom_shrinks_the_budget_and_no_snapshot_exceeds_it() -> None:
    specs = [OperatorSpec(f"op{i}", 50, 600, i / 12) for i in range(12)]
    by_name = {spec.name: spec for spec in specs}
    full = plan_window(specs, 1.0, 3000.0)
    half = plan_window(specs, 1.0, 3000.0, headroom=0.5)
    assert full.fits and half.fits
    assert half.budget_bytes == 1500.0 and full.budget_bytes == 3000.0
    assert half.window > full.window  # a smaller budget needs more, smaller turns
    for schedule, budget in ((full, 3000.0), (half, 1500.0)):
        assert schedule.largest_snapshot_bytes(by_name) <= budget
    # The smallest W at that budget: one turn fewer would not fit it.
    assert plan_window(specs, 1.0, 1500.0).window == half.window


@pytest.mark.parametrize("headroom", [0.0, -0.5, 1.5, "half", True])
def test_a_headroom_outside_zero_to_one_is_refused_by_name(headroom: object) -> None:
    specs = [OperatorSpec("op", 10, 60, 0.0)]
    with pytest.raises(ConfigError, match=r"checkpoint\.headroom=.* must be a number in \(0, 1\]"):
        plan_window(specs, 1.0, 100.0, headroom=headroom)  # type: ignore[arg-type]
