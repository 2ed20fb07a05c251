"""Capture planners of every policy, the factory and the profiler."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.models import MoEModelConfig, MoETransformer
from lightning_moe_ckpt.planning import profiler
from lightning_moe_ckpt.planning.planner import CapturePlan
from lightning_moe_ckpt.planning.schedule import OperatorSpec, specs_from_registry
from lightning_moe_ckpt.policies.checkfreq import CheckFreqPlanner, checkfreq_interval
from lightning_moe_ckpt.policies.gemini import GeminiPlanner, gemini_interval
from lightning_moe_ckpt.policies.moc import MoCPlanner
from lightning_moe_ckpt.policies.moetion import MoEtionPlanner
from lightning_moe_ckpt.policies.moevement import MoEvementPlanner
from lightning_moe_ckpt.policies.registry import PLANNER_NAMES, make_planner

LAYERS, EXPERTS = 2, 4


def _registry(n_experts: int = EXPERTS) -> OperatorRegistry:
    cfg = MoEModelConfig(vocab_size=32, d_model=16, n_layers=LAYERS, n_heads=2,
                         n_experts=n_experts, top_k=2, expert_hidden=32, n_shared_experts=1,
                         max_seq_len=8)
    return OperatorRegistry(MoETransformer(cfg).to(torch.bfloat16))


@pytest.fixture(scope="module")
def specs() -> tuple[OperatorSpec, ...]:
    return specs_from_registry(_registry())


def _experts_of(plan: CapturePlan) -> set[str]:
    return {name for name in plan.master if ".moe.experts." in name}


def _non_experts(specs: tuple[OperatorSpec, ...]) -> set[str]:
    return {s.name for s in specs if ".moe.experts." not in s.name}


def _counts(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# --- MoEvement ---------------------------------------------------------------------------

def _window_plans(planner: MoEvementPlanner, first: int,
                  counts: Iterator[torch.Tensor] | None = None) -> list[CapturePlan]:
    plans = []
    iteration = first
    while True:
        if counts is not None:
            hard = next(counts)
            planner.observe(iteration, hard, hard)
        plan = planner.plan(iteration)
        assert plan is not None
        plans.append(plan)
        iteration += 1
        if plan.window_index == plan.window - 1:
            return plans


def test_moevement_window_covers_every_operator_once(specs: tuple[OperatorSpec, ...]) -> None:
    by_name = {s.name: s for s in specs}
    dense = sum(s.master_state_bytes for s in specs)
    planner = MoEvementPlanner(specs, iteration_time_s=1.0, bandwidth_bytes_per_s=0.4 * dense)
    first = 1
    for _ in range(3):
        plans = _window_plans(planner, first)
        window = plans[0].window
        assert [p.window_index for p in plans] == list(range(window))
        assert all(p.window_start == first and p.schedule == plans[0].schedule for p in plans)
        captured = [name for p in plans for name in p.master]
        assert sorted(captured) == sorted(by_name)  # master state exactly once per window
        for i, plan in enumerate(plans):
            later = {name for p in plans[i + 1:] for name in p.master}
            assert set(plan.compute) == later  # waiting operators: compute weights
            nbytes = (sum(by_name[n].master_state_bytes for n in plan.master)
                      + sum(by_name[n].compute_bytes for n in plan.compute))
            assert nbytes <= 0.4 * dense  # within budget: no stall
        first += window


def test_moevement_waits_for_a_profile(specs: tuple[OperatorSpec, ...]) -> None:
    planner = MoEvementPlanner(specs)
    assert planner.plan(1) is None
    planner.set_profile(1.0, float(sum(s.master_state_bytes for s in specs)))
    plan = planner.plan(2)
    assert plan is not None and plan.window == 1 and plan.window_start == 2
    forced = MoEvementPlanner(specs, window=3).plan(1)
    assert forced is not None and forced.window == 3
    assert forced.schedule is not None and forced.schedule["budget_bytes"] is None


def test_a_forced_window_beyond_the_operators_warns_and_plans_empty_turns(
        specs: tuple[OperatorSpec, ...]) -> None:
    window = len(specs) + 2
    with pytest.warns(UserWarning, match=rf"checkpoint\.window={window} exceeds the "
                                         rf"{len(specs)} operators"):
        planner = MoEvementPlanner(specs, window=window)
    plans = [planner.plan(step) for step in range(1, window + 1)]
    assert all(plan is not None and plan.window == window for plan in plans)
    assert [plan.master for plan in plans[-2:] if plan is not None] == [(), ()]


def _skewed(order: list[int]) -> torch.Tensor:
    """Counts where expert order[i] gets (i + 1) * 10 tokens in every layer."""
    row = [0.0] * EXPERTS
    for rank, expert in enumerate(order):
        row[expert] = 10.0 * (rank + 1)
    return _counts([row] * LAYERS)


def _expert_order(plan: CapturePlan, layer: int = 0) -> list[int]:
    assert plan.schedule is not None
    prefix = f"layers.{layer}.moe.experts."
    return [int(n[len(prefix):]) for n in plan.schedule["order"] if n.startswith(prefix)]


def _latest_only(specs: tuple[OperatorSpec, ...], **options: float) -> MoEvementPlanner:
    """EMA with alpha 0: frequencies are exactly the last iteration's, easy to steer."""
    return MoEvementPlanner(specs, window=2, top_k=2, n_layers=LAYERS, n_experts=EXPERTS,
                            popularity="ema", ema_alpha=0.0, **options)


def test_moevement_reorders_only_at_window_boundaries(specs: tuple[OperatorSpec, ...]) -> None:
    planner = _latest_only(specs)
    ascending, descending = _skewed([0, 1, 2, 3]), _skewed([3, 2, 1, 0])
    # First boundary: routing differs from the spec popularity (all 0): reorder, popular last.
    plans = _window_plans(planner, 1, iter([ascending, descending]))
    assert planner.reorders == 1 and _expert_order(plans[0]) == [0, 1, 2, 3]
    assert _expert_order(plans[0], layer=1) == [0, 1, 2, 3]
    # The flip observed mid-window left the window's schedule alone...
    assert plans[1].schedule == plans[0].schedule
    # ...and takes effect at the next boundary.
    plans = _window_plans(planner, 3, iter([descending, descending]))
    assert planner.reorders == 2 and _expert_order(plans[0]) == [3, 2, 1, 0]
    non_experts = _non_experts(specs)
    assert plans[0].schedule is not None
    assert set(plans[0].schedule["order"][-len(non_experts):]) == non_experts
    plans = _window_plans(planner, 5, iter([descending, descending]))  # unchanged: keep
    assert planner.reorders == 2


def test_moevement_reads_no_popularity_while_a_window_is_one_iteration(
        specs: tuple[OperatorSpec, ...]) -> None:
    """At W = 1 every operator's full state is taken each iteration: order cannot matter,
    so shifting routing causes no reorder (and no rebuilt copy list) until W grows."""
    dense = float(sum(s.master_state_bytes + s.compute_bytes for s in specs))
    planner = MoEvementPlanner(specs, iteration_time_s=1.0, bandwidth_bytes_per_s=dense,
                               top_k=2, n_layers=LAYERS, n_experts=EXPERTS,
                               popularity="ema", ema_alpha=0.0)
    routing = iter([_skewed([0, 1, 2, 3]), _skewed([3, 2, 1, 0])] * 4)
    plans = [p for start in range(1, 9) for p in _window_plans(planner, start, routing)]
    assert [p.window for p in plans] == [1] * 8
    assert {frozenset(p.master) for p in plans} == {frozenset(s.name for s in specs)}
    assert planner.reorders == 1  # the first window's order, then none
    planner.set_profile(1.0, dense / 4)  # W grows: popularity decides the order again
    plans = _window_plans(planner, 9, iter([_skewed([3, 2, 1, 0])] * 8))
    assert plans[0].window > 1 and planner.reorders == 2


# Layer 0 starts at [10, 20, 30, 40] tokens (frequencies 0.2, 0.4, 0.6, 0.8; top-2).
SWAP_01 = _counts([[20.0, 10.0, 30.0, 40.0], [10.0, 20.0, 30.0, 40.0]])  # 2 of 8: +100%, -50%
NUDGE_01 = _counts([[10.5, 19.5, 30.0, 40.0], [10.0, 20.0, 30.0, 40.0]])  # +5%, -2.5%


@pytest.mark.parametrize(("counts", "options", "reorders"), [
    (SWAP_01, {}, 2),  # 25% of experts moved > 10%: reorder
    (SWAP_01, {"reorder_fraction_threshold": 0.3}, 1),  # 25% < 30%: keep
    (SWAP_01, {"reorder_change_threshold": 1.0}, 1),  # no expert moved by more than 100%
    (NUDGE_01, {}, 1),  # moves under 10%: keep
    (NUDGE_01, {"reorder_change_threshold": 0.04, "reorder_fraction_threshold": 0.125}, 2),
])
def test_moevement_reorder_thresholds(specs: tuple[OperatorSpec, ...], counts: torch.Tensor,
                                      options: dict[str, float], reorders: int) -> None:
    planner = _latest_only(specs, **options)
    first = _window_plans(planner, 1, iter([_skewed([0, 1, 2, 3])] * 2))
    # The boundary at 3 reads the counters published at 2 (the first window's routing):
    # the second window's routing decides at the boundary after it.
    _window_plans(planner, 3, iter([counts] * 2))
    third = _window_plans(planner, 5, iter([counts] * 2))
    assert planner.reorders == reorders
    assert (third[0].schedule == first[0].schedule) == (reorders == 1)


def test_moevement_reads_popularity_published_before_the_boundary(
        specs: tuple[OperatorSpec, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """A boundary orders by the counters published at the window's last iteration, whose
    host copy had an iteration to finish: never by a read of the live counters, which
    would wait for the device (only the first boundary, with nothing published, does)."""
    planner = _latest_only(specs)
    ascending, descending = _skewed([0, 1, 2, 3]), _skewed([3, 2, 1, 0])
    plans = _window_plans(planner, 1, iter([ascending, ascending]))
    assert planner.reorders == 1 and _expert_order(plans[0]) == [0, 1, 2, 3]
    assert planner.tracker is not None

    def blocking_read() -> None:
        raise AssertionError("a boundary read the live counters")

    monkeypatch.setattr(planner.tracker, "frequency_matrix", blocking_read)
    # Live counters at 3 are descending, but 2 published ascending: the order stands.
    plans = _window_plans(planner, 3, iter([descending, descending]))
    assert planner.reorders == 1 and _expert_order(plans[0]) == [0, 1, 2, 3]
    # 4 published descending: the boundary at 5 adopts it, whatever 5 routed.
    plans = _window_plans(planner, 5, iter([ascending, ascending]))
    assert planner.reorders == 2 and _expert_order(plans[0]) == [3, 2, 1, 0]
    # 6 published ascending; a recovery rolls back what it counted.
    planner.on_recovery(6)
    assert planner.tracker.published_frequency_matrix() is None


def test_moevement_restarts_windows_and_round_trips(specs: tuple[OperatorSpec, ...]) -> None:
    planner = MoEvementPlanner(specs, window=3)
    assert [p.window_index for p in _window_plans(planner, 1)] == [0, 1, 2]
    planner.plan(4)
    planner.on_recovery(3)
    plan = planner.plan(4)
    assert plan is not None and (plan.window_start, plan.window_index) == (4, 0)
    skipped = planner.plan(9)  # not consecutive: a fresh window
    assert skipped is not None and skipped.window_start == 9
    clone = MoEvementPlanner(specs, window=3)
    clone.load_state_dict(planner.state_dict())
    assert [clone.plan(t) for t in range(10, 15)] == [planner.plan(t) for t in range(10, 15)]


class _FakeAgreement:
    """Ranks agreeing on the largest W: this rank's proposals against a peer's W that the
    test sets (a proposal is agreed as it is started, the way an all-reduce would be
    once every rank started it)."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.proposals: list[int] = []
        self.agreed: int | None = None

    def start(self, window: int) -> None:
        self.proposals.append(window)
        self.agreed = max(window, self.peer)

    def result(self) -> int:
        assert self.agreed is not None
        return self.agreed


def test_moevement_window_agreement(specs: tuple[OperatorSpec, ...]) -> None:
    dense = sum(s.master_state_bytes for s in specs)
    agreement = _FakeAgreement(peer=5)
    planner = MoEvementPlanner(specs, iteration_time_s=1.0, bandwidth_bytes_per_s=dense,
                               window_agreement=agreement)
    plan = planner.plan(1)
    # The first boundary waits for its own agreement, then proposes for the next one.
    assert agreement.proposals == [1, 1] and plan is not None and plan.window == 5
    assert plan.schedule is not None and plan.schedule["fits"]


def test_moevement_agrees_on_w_in_the_background(specs: tuple[OperatorSpec, ...]) -> None:
    """A boundary uses the W agreed for the previous boundary's proposals and starts the
    next agreement, so no boundary waits on the other ranks; a recovery (every rank at
    once) starts over with an agreement the boundary waits for."""
    dense = sum(s.master_state_bytes for s in specs)
    agreement = _FakeAgreement(peer=1)
    planner = MoEvementPlanner(specs, iteration_time_s=1.0, bandwidth_bytes_per_s=dense,
                               window_agreement=agreement, agreement_every=1)
    first = planner.plan(1)
    assert first is not None and first.window == 1 and agreement.proposals == [1, 1]
    agreement.peer = 3  # another rank's W grew: agreed with the proposal of boundary 2
    second = planner.plan(2)
    assert second is not None and second.window == 1  # boundary 2 uses boundary 1's
    assert agreement.proposals == [1, 1, 1]  # one agreement per boundary from now on
    third = planner.plan(3)
    assert third is not None and third.window == 3 and third.window_start == 3
    assert agreement.proposals == [1, 1, 1, 1]  # this rank's own W, agreed as 3
    assert [planner.plan(t) is not None for t in (4, 5)] == [True, True]
    assert agreement.proposals == [1, 1, 1, 1]  # inside the window: no agreement
    planner.on_recovery(6)
    agreement.peer = 1
    after = planner.plan(6)
    # This rank proposes what it needs (1), not the W it ran with (3): once no rank needs
    # more, W comes back down. The first boundary after the recovery waits for its own
    # agreement again.
    assert after is not None and after.window == 1
    assert agreement.proposals == [1, 1, 1, 1, 1, 1]


def test_moevement_agrees_at_most_every_agreement_every_iterations(
        specs: tuple[OperatorSpec, ...]) -> None:
    """With W = 1 every iteration is a boundary, but the ranks agree only every
    ``agreement_every`` iterations (16 by default); the boundaries in between keep the W
    last agreed, and the first boundary after a recovery agrees again at once."""
    dense = sum(s.master_state_bytes for s in specs)
    agreement = _FakeAgreement(peer=1)
    planner = MoEvementPlanner(specs, iteration_time_s=1.0, bandwidth_bytes_per_s=dense,
                               window_agreement=agreement)
    assert planner.agreement_every == 16
    assert all(planner.plan(t) is not None for t in range(1, 17))
    assert agreement.proposals == [1, 1]  # the first boundary's, waited for, and the next
    agreement.peer = 2  # another rank's W grew: agreed with the proposal of iteration 17
    plan = planner.plan(17)
    assert plan is not None and plan.window == 1 and agreement.proposals == [1, 1, 1]
    assert [p.window for t in range(18, 33) if (p := planner.plan(t)) is not None] == [1] * 15
    plan = planner.plan(33)
    assert plan is not None and plan.window == 2 and len(agreement.proposals) == 4
    planner.on_recovery(40)
    assert planner.plan(41) is not None and len(agreement.proposals) == 6
    with pytest.raises(ConfigError, match="agreement_every=0"):
        MoEvementPlanner(specs, window_agreement=agreement, agreement_every=0)


def test_moevement_within_window_plans_never_read_the_device(
        specs: tuple[OperatorSpec, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    planner = MoEvementPlanner(specs, window=4, top_k=2, n_layers=LAYERS, n_experts=EXPERTS)
    planner.observe(1, _skewed([0, 1, 2, 3]), _skewed([0, 1, 2, 3]))
    assert planner.plan(1) is not None  # the first boundary: one host read of the tracker
    assert planner.tracker is not None
    published: list[int] = []  # the window's last plan starts the next boundary's copy
    monkeypatch.setattr(planner.tracker, "publish", lambda: published.append(t))
    meta = _skewed([3, 2, 1, 0]).to("meta")  # any host read of these raises
    for t in (2, 3, 4):
        planner.observe(t, meta, meta)
        assert planner.plan(t) is not None
    assert published == [4]


# --- Dense: Gemini and CheckFreq -----------------------------------------------------------

def _ettr(k: int, mtbf: float, t_iter: float, t_ckpt: float, fixed: float) -> float:
    return (1 / (1 + t_ckpt / (t_iter * k))) / (1 + (fixed + 0.5 * k * t_iter) / mtbf)


@settings(max_examples=60, deadline=None)
@given(mtbf=st.floats(60, 7200), t_iter=st.floats(0.1, 5), t_ckpt=st.floats(0, 30),
       fixed=st.floats(0, 60))
def test_gemini_oracle_matches_brute_force(mtbf: float, t_iter: float, t_ckpt: float,
                                           fixed: float) -> None:
    limit = math.ceil(mtbf / t_iter)
    values = [_ettr(k, mtbf, t_iter, t_ckpt, fixed) for k in range(1, limit + 1)]
    best = max(values)
    chosen = gemini_interval(mtbf, t_iter, t_ckpt, fixed)
    assert values[chosen - 1] == pytest.approx(best, rel=1e-12)
    assert chosen == 1 + values.index(best) or values[chosen - 1] == best


def test_gemini_fixed_and_oracle_cadence(specs: tuple[OperatorSpec, ...]) -> None:
    fixed = GeminiPlanner(specs, interval=3)
    plans = {t: fixed.plan(t) for t in range(1, 10)}
    assert [t for t, p in plans.items() if p is not None] == [1, 4, 7]
    plan = plans[4]
    assert plan is not None and set(plan.master) == {s.name for s in specs}
    assert (plan.compute, plan.window, plan.window_index, plan.schedule) == ((), 1, 0, None)
    oracle = GeminiPlanner(specs, mtbf_s=3600.0)
    assert oracle.interval == 1  # snapshots until its cost is measured
    oracle.record_overhead(1.0, 2.0)
    assert oracle.interval == gemini_interval(3600.0, 1.0, 2.0) > 1
    oracle.on_recovery(10)
    assert oracle.plan(11) is None


@pytest.mark.parametrize(("options", "key"), [
    ({}, "checkpoint.interval"), ({"interval": 2, "mtbf_s": 60.0}, "checkpoint.mtbf_s=60.0"),
    ({"interval": 0}, "checkpoint.interval=0"), ({"mtbf_s": -1.0}, "checkpoint.mtbf_s=-1.0")])
def test_gemini_bad_config(specs: tuple[OperatorSpec, ...], options: dict[str, float],
                           key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        make_planner("gemini", specs, **options)


@settings(max_examples=100, deadline=None)
@given(t_iter=st.floats(0.01, 10), t_ckpt=st.floats(0, 100))
def test_checkfreq_interval_is_smallest_within_overhead(t_iter: float, t_ckpt: float) -> None:
    k = checkfreq_interval(t_iter, t_ckpt, 0.03)
    assert t_ckpt / (k * t_iter) <= 0.03
    assert k == 1 or t_ckpt / ((k - 1) * t_iter) > 0.03


def test_checkfreq_adapts_its_cadence(specs: tuple[OperatorSpec, ...]) -> None:
    planner = CheckFreqPlanner(specs)
    assert planner.plan(1) is not None and planner.plan(2) is not None
    planner.record_overhead(iteration_time_s=1.0, snapshot_time_s=0.15)  # 15% -> k = 5
    assert planner.interval == 5
    assert [t for t in range(3, 13) if planner.plan(t) is not None] == [7, 12]
    with pytest.raises(ConfigError, match=r"checkpoint\.max_overhead=0"):
        CheckFreqPlanner(specs, max_overhead=0)


# --- Partial: MoC and MoEtion -------------------------------------------------------------

@pytest.mark.parametrize(("experts", "k"), [(4, 1), (8, 3), (6, 4), (5, 5)])
def test_moc_round_robin_covers_every_expert(experts: int, k: int) -> None:
    specs = specs_from_registry(_registry(experts))
    planner = MoCPlanner(specs, experts_per_layer=k)
    rounds = math.ceil(experts / k)
    plans = [planner.plan(t) for t in range(1, 4 * rounds + 3)]
    assert all(p is not None for p in plans)
    every = {s.name for s in specs if ".moe.experts." in s.name}
    for start in range(len(plans) - rounds + 1):
        window = plans[start:start + rounds]
        assert set().union(*(_experts_of(p) for p in window if p)) == every
    for plan in plans:
        assert plan is not None and _non_experts(specs) <= set(plan.master)
        assert len(_experts_of(plan)) == LAYERS * k and plan.compute == ()
        assert plan.window == rounds and plan.window_index == (plan.iteration - 1) % rounds
    assert planner.last_saved["layers.1.moe.experts.0"] <= len(plans)


def test_moc_lost_tokens_and_dynamic_k(specs: tuple[OperatorSpec, ...]) -> None:
    uniform = _counts([[1.0] * EXPERTS] * LAYERS)
    planner = MoCPlanner(specs, experts_per_layer=1)
    for t in (1, 2):
        planner.observe(t, uniform, uniform)
        planner.plan(t)
    assert planner.lost_token_portion() == 0.0  # nothing is lost until a recovery
    planner.on_recovery(2)
    # Layer 0 saved experts 0 then 1, layer 1 experts 1 then 2: 5 of 8 tokens unsaved.
    assert planner.lost_token_portion() == pytest.approx(5 / 8)
    assert planner.experts_per_layer == 2  # PLT 62.5% > 3.75%: K doubles
    plan = planner.plan(3)
    assert plan is not None and plan.window == 2 and plan.window_start == 3
    planner.on_recovery(3)
    assert planner.experts_per_layer == 4  # still over budget: doubles up to E
    planner.on_recovery(3)
    assert planner.experts_per_layer == 4
    lenient = MoCPlanner(specs, experts_per_layer=1, lost_token_budget=0.9)
    lenient.observe(1, uniform, uniform)
    lenient.plan(1)
    lenient.on_recovery(1)
    assert lenient.experts_per_layer == 1 and lenient.lost_token_portion() == pytest.approx(0.75)
    clone = MoCPlanner(specs)
    clone.load_state_dict(planner.state_dict())
    assert clone.plan(4) == planner.plan(4)
    with pytest.raises(ConfigError, match=r"checkpoint\.experts_per_layer=5"):
        MoCPlanner(specs, experts_per_layer=5)


def test_moc_bookkeeping_never_reads_the_device(specs: tuple[OperatorSpec, ...]) -> None:
    planner = MoCPlanner(specs, experts_per_layer=1)
    meta = _counts([[1.0] * EXPERTS] * LAYERS).to("meta")
    for t in range(1, 6):
        planner.observe(t, meta, meta)
        assert planner.plan(t) is not None


def _reference_moetion(history: list[list[list[float]]], selected: int) -> list[set[str]]:
    """MoEtion's choice after each step, from the counters as of the step before."""
    deficit = [[0.0] * EXPERTS for _ in range(LAYERS)]
    known = [[0.0] * EXPERTS for _ in range(LAYERS)]
    choices = []
    for counts in history:
        chosen = set()
        for layer in range(LAYERS):
            for e in range(EXPERTS):
                deficit[layer][e] += counts[layer][e]
            ranked = sorted(range(EXPERTS), key=lambda e, row=known[layer]: (-row[e], e))
            for e in ranked[:selected]:
                deficit[layer][e] = 0.0
                chosen.add(f"layers.{layer}.moe.experts.{e}")
        known = [row[:] for row in deficit]
        choices.append(chosen)
    return choices


@settings(max_examples=40, deadline=None)
@given(history=st.lists(st.lists(st.lists(st.integers(0, 6).map(float), min_size=EXPERTS,
                                          max_size=EXPERTS), min_size=LAYERS,
                                 max_size=LAYERS), min_size=1, max_size=8),
       selected=st.integers(1, EXPERTS))
def test_moetion_picks_highest_deficit_experts(history: list[list[list[float]]],
                                               selected: int) -> None:
    specs = specs_from_registry(_registry())
    planner = MoEtionPlanner(specs, experts_per_layer=selected)
    expected = _reference_moetion(history, selected)
    for t, (counts, choice) in enumerate(zip(history, expected, strict=True), start=1):
        planner.observe(t, _counts(counts), _counts(counts))
        plan = planner.plan(t)
        assert plan is not None and _experts_of(plan) == choice
        assert _non_experts(specs) <= set(plan.master)
        assert (plan.window, plan.window_start) == (1, t)


def test_moetion_capacity_boost_until_deficit_repaid(specs: tuple[OperatorSpec, ...]) -> None:
    planner = MoEtionPlanner(specs, experts_per_layer=2)
    busy = _counts([[10.0, 0.0, 0.0, 0.0], [0.0] * EXPERTS])
    planner.observe(1, busy, busy)
    planner.plan(1)  # no counters known yet: saves experts 0 and 1 (zeroing expert 0)
    planner.observe(2, busy, busy)
    planner.plan(2)  # picks by step-1 counters, all zero after that save: experts 0, 1
    planner.observe(3, _counts([[0.0, 0.0, 4.0, 0.0], [0.0] * EXPERTS]), busy)
    planner.plan(3)  # still experts 0, 1 (step-2 counters all zero): expert 2 owes 4
    assert planner.stale_experts() == ()
    planner.on_recovery(3)
    assert planner.stale_experts() == ("layers.0.moe.experts.2",)
    assert planner.capacity_boost("layers.0.moe.experts.2") == pytest.approx(1.1)
    assert planner.capacity_boost("layers.0.moe.experts.0") == 1.0
    assert planner.capacity_factors().shape == (LAYERS, EXPERTS)
    to_expert2 = _counts([[0.0, 0.0, 20.0, 0.0], [0.0] * EXPERTS])
    planner.observe(4, to_expert2, to_expert2)  # repays 10% of 20 = 2 of 4
    assert planner.stale_experts() == ("layers.0.moe.experts.2",)
    planner.observe(5, to_expert2, to_expert2)
    assert planner.stale_experts() == ()
    assert planner.capacity_boost("layers.0.moe.experts.2") == 1.0
    clone = MoEtionPlanner(specs, experts_per_layer=2)
    clone.load_state_dict(planner.state_dict())
    assert clone.plan(6) == planner.plan(6)


# --- Factory, none, profiler --------------------------------------------------------------

def test_factory_builds_every_policy(specs: tuple[OperatorSpec, ...]) -> None:
    options: dict[str, dict[str, object]] = {
        "moevement": {"window": 2}, "gemini": {"interval": 2}}
    for name in PLANNER_NAMES:
        planner = make_planner(name, specs, **options.get(name, {}))
        assert planner.name == name
        planner.observe(1, _counts([[1.0] * EXPERTS] * LAYERS),
                        _counts([[1.0] * EXPERTS] * LAYERS))
        assert (planner.plan(1) is None) == (name == "none")
    with pytest.raises(ConfigError, match="checkpoint='dense'"):
        make_planner("dense", specs)
    with pytest.raises(ConfigError, match=r"checkpoint\.bogus"):
        make_planner("moc", specs, bogus=1)


def test_iteration_profiler_median_after_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 3.0, 10.0, 12.0, 20.0, 30.0])  # read only by measured iterations
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: next(clock))
    timer = profiler.IterationProfiler(warmup_iterations=3, skip=1)
    for _ in range(6):  # iteration 0 skipped, then 3 measured (3 s, 2 s, 10 s), then none
        timer.begin()
        timer.end()
        if not timer.done:
            assert timer.iteration_time_s is None
    assert timer.samples == [3.0, 2.0, 10.0] and timer.iteration_time_s == 3.0
    with pytest.raises(ConfigError, match=r"checkpoint\.warmup_iterations=0"):
        profiler.IterationProfiler(warmup_iterations=0)


def test_bandwidth_probe_reports_bytes_per_second() -> None:
    bandwidth = profiler.measure_bandwidth(1 << 16, "cpu", repeats=2)
    assert bandwidth > 0 and math.isfinite(bandwidth)
    assert profiler.Profile(2.0, bandwidth).budget_bytes == pytest.approx(2 * bandwidth)
    with pytest.raises(ConfigError, match=r"checkpoint\.bandwidth_probe_bytes=0"):
        profiler.measure_bandwidth(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_counters_plan_like_cpu(specs: tuple[OperatorSpec, ...]) -> None:
    """Pinned host mirrors, events and asynchronous masks give the CPU decisions."""
    generator = torch.Generator().manual_seed(3)
    history = [torch.randint(0, 9, (LAYERS, EXPERTS), generator=generator).float()
               for _ in range(8)]
    for make in (lambda: MoCPlanner(specs, experts_per_layer=1),
                 lambda: MoEtionPlanner(specs, experts_per_layer=2),
                 lambda: _latest_only(specs)):
        plans = []
        for device in ("cpu", "cuda"):
            planner = make()
            plans.append([])
            for t, counts in enumerate(history, start=1):
                planner.observe(t, counts.to(device), counts.to(device))
                plans[-1].append(planner.plan(t))
            planner.on_recovery(len(history))
        assert plans[0] == plans[1]
    assert profiler.measure_bandwidth(1 << 20, "cuda") > 0
