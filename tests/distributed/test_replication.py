"""Snapshots replicated to peers (gloo, 4 processes): bitwise copies, bounded memory,
corrupted and missing pieces refused with the rank, operator and iteration named."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_ckpt.core.layout import ParallelPlan
from lightning_moe_ckpt.models import MoEModelConfig
from lightning_moe_ckpt.replication.replicator import (
    CorruptCheckpointError,
    replica_peers,
    verify_window,
)
from tests.distributed.harness import run_distributed
from tests.distributed.workloads import (
    abandoned_replication_thread,
    make_settings,
    replication_check,
    replication_partner_failure,
)

pytestmark = pytest.mark.distributed


def test_replica_placement_prefers_other_nodes() -> None:
    # 2 nodes x 4 ranks: rank 1's two replicas live on node 1, in ring order.
    assert replica_peers(1, 8, 2, ranks_per_node=4) == [4, 5]
    assert replica_peers(6, 8, 2, ranks_per_node=4) == [0, 1]
    assert replica_peers(0, 2, 2, ranks_per_node=1) == [1]  # capped by the world
    assert replica_peers(0, 1, 2, ranks_per_node=1) == []


def test_replica_placement_leaves_a_rank_s_shard_group_last() -> None:
    """``parallel.dp_shard=2 parallel.ep=2``: rank 2 shares its shard group with rank 0
    (same stage and experts), so its replicas go to ranks 3 and 1 first; across nodes the
    node rule still comes first."""
    model = MoEModelConfig(n_layers=4, n_experts=8)
    plan = ParallelPlan.validate(pp=1, dp=1, ep=2, microbatches=2, schedule="1f1b",
                                 model=model, dp_shard=2)
    assert [plan.shard_group(r) for r in range(4)] == [0, 1, 0, 1]
    assert replica_peers(2, 4, 2, ranks_per_node=4) == [3, 0]
    assert replica_peers(2, 4, 2, ranks_per_node=4, shard_group=plan.shard_group) == [3, 1]
    assert replica_peers(0, 4, 3, ranks_per_node=4, shard_group=plan.shard_group) == [1, 3, 2]
    # Two nodes of two ranks: both replicas on the other node, its rank outside the shard
    # group first; the same-node peer 3 comes after rank 0 of the shard group.
    assert replica_peers(2, 4, 3, ranks_per_node=2, shard_group=plan.shard_group) == [1, 0, 3]


@pytest.mark.parametrize(("ranks_per_node", "steps"), [(1, 30), (4, 18)],
                         ids=["copied", "mapped"])
def test_persisted_window_equals_its_replicas_and_memory_is_bounded(
        ranks_per_node: int, steps: int) -> None:
    # One rank per node: every replica is a copy. One node: every peer maps its sources'
    # shared memory instead, and holds no copy of its own (its slots are reused from the
    # fifth window on, so six windows show that memory stays bounded).
    window = 3  # ten (six) windows: memory must stay bounded throughout
    settings = make_settings(2, 1, 2, steps=steps)
    ranks = run_distributed(4, replication_check, settings, steps, window,
                            ranks_per_node)["ranks"]
    for rank, report in enumerate(ranks):
        start = report["start"]
        assert start % window == 0 and steps - 2 * window <= start < steps
        assert max(report["windows_held"]) <= 3  # persisted + in flight (+ one lagging)
        peers = replica_peers(rank, 4, 2, ranks_per_node=ranks_per_node)
        assert len(peers) == 2
        sources = [s for s in range(4) if rank in replica_peers(s, 4, 2, ranks_per_node)]
        if ranks_per_node == 1:
            assert report["mapped_sources"] == report["mapping_peers"] == []
            assert report["mapped_bytes"] == report["slot_bytes"] == 0
            assert report["acknowledgements"] == 0
            assert report["exchanges"] == 2 * report["snapshots"]  # lengths, then payloads
            assert report["copied_bytes"] > 0
        else:
            assert report["mapped_sources"] == sorted(sources)
            assert report["mapping_peers"] == sorted(peers)
            assert report["copied_bytes"] == 0 and report["mapped_bytes"] > 0
            # No message at all: every snapshot was announced in the rank's page. Each peer
            # filed each slot's first snapshot before that counted replicated, and no
            # other: the snapshots of the fifth window on lie in slots it maps already.
            assert report["exchanges"] == 0
            assert report["acknowledgements"] == len(peers) * report["slots"]
            assert report["slots"] < report["snapshots"] - window
            # Its own encoded snapshots: the four windows a peer may still read, plus spare.
            assert 0 < report["slot_bytes"] <= 6 * report["window_bytes"]
        for peer in peers:
            copy = ranks[peer]["held"][rank]
            assert sorted(copy) == sorted(report["local"]), (rank, peer)
            for step, pieces in report["local"].items():
                assert pieces.keys() == copy[step].keys()
                for operator, tensors in pieces.items():
                    for name, tensor in tensors.items():
                        assert torch.equal(copy[step][operator]["tensors"][name], tensor)
        assert report["peak"] <= 3 * report["window_bytes"] + 1
        # The fetch API (collective, from the first intact replica peer) returns every rank's
        # window with checksums verified, bitwise equal to what that rank holds locally.
        for steps_pieces in report["fetched"].values():
            assert sorted(steps_pieces) == list(range(report["common_start"],
                                                      report["common_start"] + window))
        # A flipped header byte, a crafted frame whose checksums are valid, a length of
        # 2**40 announced: each refused, the next replica peer used.
        window_steps = list(range(report["common_start"], report["common_start"] + window))
        for how, outcome in report["damaged"].items():
            assert outcome == {"steps": window_steps, "holder": report["second"]}, how
        # One corrupt copy: the fetch falls through to the next replica peer.
        assert report["fetched_despite_corrupt"] == list(range(report["common_start"],
                                                               report["common_start"] + window))
        # Both copies corrupt: refused, naming each holder, the operator and the iteration.
        assert report["corrupt_error"] is not None
        assert report["corrupt_error"].count("fails its checksum") == 2
        assert "rank 0, operator" in report["corrupt_error"]
        assert f"iteration {report['common_start']}" in report["corrupt_error"]
        assert report["fetched_without_holder"] == list(range(report["common_start"],
                                                              report["common_start"] + window))
    for rank, report in enumerate(ranks):  # fetched copies equal the owners' local pieces
        owner = ranks[rank]
        if owner["start"] == report["common_start"]:
            for step, pieces in owner["local"].items():
                for operator, tensors in pieces.items():
                    for name, tensor in tensors.items():
                        got = ranks[0]["fetched"][rank][step][operator]["tensors"][name]
                        assert torch.equal(got, tensor)


def test_missing_piece_is_refused_by_name() -> None:
    snapshots = {10: {"pieces": {"embed": {}}}, 11: {"pieces": {}}}
    with pytest.raises(CorruptCheckpointError,
                       match=r"rank 3, operator 'layers\.0\.attn', iteration 11 is missing"):
        verify_window(snapshots, rank=3, window_start=10, window=2,
                      expected=lambda step: ["layers.0.attn"] if step == 11 else ["embed"])
    with pytest.raises(CorruptCheckpointError, match=r"rank 3, iteration 12 .* is missing"):
        verify_window(snapshots, rank=3, window_start=10, window=3, expected=lambda step: [])


@pytest.mark.parametrize("ranks_per_node", [1, 2], ids=["copied", "mapped"])
def test_a_replication_thread_that_fails_lets_its_partner_stop(ranks_per_node: int) -> None:
    # Copied: rank 1's thread waits on rank 0 in their last exchange (a gloo send waits
    # for its receive) when rank 0's thread fails there. Rank 0 destroys its replication
    # group at once, so rank 1's thread fails too instead of waiting on a rank whose
    # training may itself be waiting on rank 1 to learn of the failure: rank 1's close,
    # given the 10 s a survivor's recovery gives it, finds the thread stopped. Mapped:
    # rank 0 fails before it announces its last snapshot, and marks its page failed; rank
    # 1's close waits for that announcement, reads the state instead, and stops with an
    # error just the same.
    ranks = run_distributed(2, replication_partner_failure, make_settings(1, 2, 1, steps=4),
                            4, ranks_per_node)["ranks"]
    assert ranks[0]["staged"] == [3] and "staged" in ranks[0]["error"]
    assert all(report["stopped"] for report in ranks), ranks
    assert ranks[1]["error"] is not None and not ranks[1]["staged"]
    # Neither goes on silently: the next iteration says replication stopped, once.
    for rank, report in enumerate(ranks):
        (warning,) = report["warned"]
        assert warning.startswith(f"rank {rank}: snapshot replication stopped"), warning


def test_a_window_does_not_persist_while_its_partner_never_announced_the_same_step() -> None:
    """Windows of two iterations, on one node: rank 0's replication fails before it
    announces its snapshot of step 11, the last of window 10, long after both map each
    other's slots (a snapshot in a mapped slot counts once announced). Rank 1 announced
    step 11, but it holds rank 0's window 10 incomplete: its own window 10 must not
    persist either (it would free window 8, the one recovery needs), just as a failed
    exchange would not have persisted it."""
    ranks = run_distributed(2, replication_partner_failure, make_settings(1, 2, 1, steps=12),
                            12, 2)["ranks"]
    assert ranks[0]["staged"] == [11]
    assert ranks[1]["error"] is not None
    for report in ranks:  # (step 10 counts once the partner's step 10 was filed in time)
        assert report["persisted"] == 8 and 11 not in report["replicated"][10], report


def test_a_replication_thread_given_up_on_files_and_counts_nothing_more() -> None:
    """Rank 0's close gives up on its thread while it waits for rank 1 to map its first
    slot; when rank 1 files it, the abandoned thread neither counts the snapshot nor
    files rank 1's (its replicas went to the next replicator): it stops with an error."""
    ranks = run_distributed(2, abandoned_replication_thread,
                            make_settings(1, 2, 1, steps=1))["ranks"]
    first, second = ranks
    assert second["slept"] and first["stopped"] is False, ranks
    assert first["completed"] == first["counted_at_close"] == 0, ranks
    assert first["held"] == {} and "given up" in (first["error"] or ""), ranks
