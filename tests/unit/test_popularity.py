"""Popularity schemes (hard, soft, EMA, capacity-aware), the reorder rule, device-only
accumulation and the one-step-late host mirror."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.planning.popularity import (
    HostMirror,
    PopularityTracker,
    should_reorder,
)

HARD = torch.tensor([[6.0, 2.0, 0.0, 8.0], [4.0, 4.0, 4.0, 4.0]])  # 8 tokens x top-2
SOFT = torch.tensor([[3.0, 1.0, 0.5, 3.5], [2.0, 2.0, 2.0, 2.0]])  # probabilities sum to 8


def test_hard_counts_give_token_activation_frequency() -> None:
    tracker = PopularityTracker(2, 4, top_k=2)
    tracker.update(HARD, SOFT)
    freq = tracker.frequencies()
    assert freq["layers.0.moe.experts.0"] == pytest.approx(6 / 8)
    assert freq["layers.0.moe.experts.3"] == pytest.approx(1.0)
    assert freq["layers.0.moe.experts.2"] == 0.0
    assert freq["layers.1.moe.experts.1"] == pytest.approx(0.5)
    assert len(freq) == 8
    tracker.update(HARD * 0, SOFT)  # a layer's frequency is over every token seen
    assert tracker.frequencies()["layers.0.moe.experts.0"] == pytest.approx(6 / 8)


def test_soft_counts_give_probability_share() -> None:
    tracker = PopularityTracker(2, 4, top_k=2, scheme="soft")
    tracker.update(HARD, SOFT)
    freq = tracker.frequencies()
    assert freq["layers.0.moe.experts.3"] == pytest.approx(3.5 / 8)
    assert freq["layers.1.moe.experts.2"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="soft_counts"):
        tracker.update(HARD, None)


def test_ema_follows_recent_iterations() -> None:
    alpha = 0.5
    tracker = PopularityTracker(1, 2, top_k=1, scheme="ema", alpha=alpha)
    history = [torch.tensor([[10.0, 0.0]]), torch.tensor([[0.0, 10.0]]),
               torch.tensor([[0.0, 10.0]])]
    ema = torch.zeros(1, 2, dtype=torch.float64)
    for counts in history:
        tracker.update(counts, counts)
        ema = alpha * ema + (1 - alpha) * counts.double()
    freq = tracker.frequencies()
    expected = ema / ema.sum()
    assert freq["layers.0.moe.experts.0"] == pytest.approx(float(expected[0, 0]))
    assert freq["layers.0.moe.experts.1"] == pytest.approx(6 / 7)  # EMA [1.25, 7.5]
    cumulative = PopularityTracker(1, 2, top_k=1)
    for counts in history:
        cumulative.update(counts, counts)
    assert cumulative.frequencies()["layers.0.moe.experts.1"] == pytest.approx(2 / 3)


def test_capacity_aware_ranks_by_utilisation() -> None:
    capacity = [[1.0, 2.0, 1.0, 4.0], [1.0, 1.0, 1.0, 1.0]]
    tracker = PopularityTracker(2, 4, top_k=2, scheme="capacity", capacity_factors=capacity)
    tracker.update(HARD, SOFT)
    freq = tracker.frequencies()
    # hard frequency x min(C) / C: expert 3 (frequency 1.0, capacity 4) ranks below expert 0
    assert freq["layers.0.moe.experts.3"] == pytest.approx(0.25)
    assert freq["layers.0.moe.experts.0"] == pytest.approx(0.75)
    assert freq["layers.0.moe.experts.1"] == pytest.approx(0.25 / 2)
    assert all(0.0 <= share <= 1.0 for share in freq.values())


def test_layer_ids_name_the_rows() -> None:
    tracker = PopularityTracker(2, 4, top_k=2, layer_ids=[4, 5])
    tracker.update(HARD, SOFT)
    assert "layers.5.moe.experts.3" in tracker.frequencies()
    assert PopularityTracker(2, 4).frequencies()["layers.1.moe.experts.0"] == 0.0


def test_accumulation_never_reads_device_data() -> None:
    """Meta tensors have no data: any host read (``.cpu()``, ``.item()``, ``bool()``) of
    them raises, so updates that succeed on them never sync with the device."""
    for scheme in ("hard", "soft", "ema", "capacity"):
        tracker = PopularityTracker(2, 4, top_k=2, scheme=scheme)
        for _ in range(3):
            tracker.update(HARD.to("meta"), SOFT.to("meta"))
        assert tracker.iterations == 3
        with pytest.raises((NotImplementedError, RuntimeError)):
            tracker.frequencies()  # the blocking host read (a boundary reads a publication)


def test_a_publication_is_read_once_and_keeps_its_values() -> None:
    tracker = PopularityTracker(2, 4, top_k=2)
    assert tracker.published_frequency_matrix() is None  # nothing published
    tracker.update(HARD, SOFT)
    tracker.publish()
    published = tracker.frequency_matrix()
    tracker.update(HARD.flip(1), SOFT)  # after the publication: not in it
    read = tracker.published_frequency_matrix()
    assert read is not None and np.array_equal(read, published)
    assert not np.array_equal(read, tracker.frequency_matrix())
    assert tracker.published_frequency_matrix() is None  # read once
    tracker.publish()
    tracker.reset()
    assert tracker.published_frequency_matrix() is None  # forgotten with the counters


def test_state_dict_round_trip() -> None:
    first = PopularityTracker(2, 4, top_k=2, scheme="ema", alpha=0.8)
    first.update(HARD, SOFT)
    second = PopularityTracker(2, 4, top_k=2, scheme="ema", alpha=0.8)
    second.load_state_dict(first.state_dict())
    for tracker in (first, second):
        tracker.update(HARD.flip(1), SOFT)
    assert first.frequencies() == second.frequencies()
    assert second.iterations == 2
    with pytest.raises(ValueError, match="scheme"):
        PopularityTracker(2, 4).load_state_dict(first.state_dict())


def test_bad_inputs_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.popularity='loud'"):
        PopularityTracker(2, 4, scheme="loud")
    with pytest.raises(ConfigError, match=r"checkpoint\.ema_alpha=1\.0"):
        PopularityTracker(2, 4, scheme="ema", alpha=1.0)
    with pytest.raises(ConfigError, match=r"checkpoint\.reorder_change_threshold=-0\.1"):
        should_reorder({}, {}, change_threshold=-0.1)
    with pytest.raises(ConfigError, match=r"checkpoint\.reorder_fraction_threshold=0 "):
        should_reorder({}, {}, fraction_threshold=0)
    with pytest.raises(ValueError, match="shape"):
        PopularityTracker(2, 4).update(torch.zeros(3, 4))


def _experts(values: list[float]) -> dict[str, float]:
    return {f"layers.0.moe.experts.{e}": v for e, v in enumerate(values)}


def test_reorder_thresholds_at_their_edges() -> None:
    before = _experts([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    one_moved = _experts([0.6, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])  # 20% for 1/8
    two_moved = _experts([0.6, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])  # 20% for 2/8 = 25%
    two_by_ten = _experts([0.55, 0.45, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])  # exactly 10%: no
    assert not should_reorder(before, one_moved)
    assert should_reorder(before, two_moved)
    assert not should_reorder(before, two_by_ten)
    assert should_reorder(before, one_moved, fraction_threshold=0.125)
    assert not should_reorder(before, two_moved, change_threshold=0.25)
    assert should_reorder(_experts([0.0, 0.0]), _experts([0.1, 0.0]), fraction_threshold=0.5)
    assert not should_reorder(_experts([0.0, 0.0]), _experts([0.0, 0.0]))
    assert not should_reorder({}, before)


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(0.0, 1.0)), min_size=1,
                      max_size=16),
       change=st.sampled_from([0.05, 0.1, 0.3]), fraction=st.sampled_from([0.1, 0.25, 0.5]))
def test_reorder_rule_matches_its_definition(pairs: list[tuple[float, float]], change: float,
                                             fraction: float) -> None:
    before = _experts([p for p, _ in pairs])
    after = _experts([c for _, c in pairs])
    moved = sum(abs(c - p) / p > change for p, c in pairs)
    assert should_reorder(before, after, change, fraction) == (moved >= fraction * len(pairs))


def test_host_mirror_reads_the_previous_publication() -> None:
    mirror = HostMirror()
    assert mirror.read() is None
    source = torch.tensor([1.0, 2.0])
    mirror.publish(source)
    source.add_(10.0)  # later device updates do not leak into the published copy
    assert torch.equal(mirror.read(), torch.tensor([1.0, 2.0]))  # type: ignore[arg-type]
    mirror.publish(source)
    assert torch.equal(mirror.read(), source)  # type: ignore[arg-type]
    mirror.clear()
    assert mirror.read() is None
