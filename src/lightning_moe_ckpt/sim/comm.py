"""Affine (alpha-beta) cost of the collectives a training iteration runs.

Each collective costs ``alpha * steps + bytes_on_the_slowest_link / bandwidth``
(paper Appendix C: ``T_NCCL(m, p) = alpha(p) + beta(p) * m``). Ranks are laid out with
expert parallelism innermost, then data parallelism, then pipeline stages, so an EP group
sits inside a node whenever ``ep <= gpus_per_node``. A group that spans nodes is reduced
hierarchically: inside a node over NVLink, across nodes over the NICs, where the GPUs of a
node share the node's bandwidth because every group of the job communicates at once.
GPU-driven NCCL traffic is taken at line rate; host-staged copies (checkpoints) are not
collectives and use :attr:`SimJob.host_copy_per_gpu` instead. The ``*_parts`` functions
split a collective's time into its NVLink and NIC shares: the NIC share is the time the
training keeps the network busy, which checkpoint traffic then cannot use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_moe_ckpt.sim.inputs import ClusterSpec, JobPlan


@dataclass(frozen=True)
class Group:
    """A communication group: its size and how many of its ranks share one node."""

    size: int
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.ranks_per_node)


def expert_group(plan: JobPlan, cluster: ClusterSpec) -> Group:
    """The ``ep`` ranks that exchange tokens by all-to-all (contiguous)."""
    return Group(plan.ep, min(plan.ep, cluster.gpus_per_node))


def stage_group(plan: JobPlan, cluster: ClusterSpec) -> Group:
    """The ``dp x ep`` ranks of a stage that reduce non-expert gradients (contiguous)."""
    return Group(plan.stage_ranks, min(plan.stage_ranks, cluster.gpus_per_node))


def expert_data_group(plan: JobPlan, cluster: ClusterSpec) -> Group:
    """The ``dp`` replicas of one expert shard (stride ``ep``) that reduce expert gradients."""
    per_node = max(1, cluster.gpus_per_node // plan.ep)
    return Group(plan.dp, min(plan.dp, per_node))


def all_reduce_parts(message_bytes: float, group: Group,
                     cluster: ClusterSpec) -> tuple[float, float]:
    """(NVLink seconds, NIC seconds) of a hierarchical ring all-reduce of ``message_bytes``
    held by every rank of ``group``."""
    if group.size <= 1 or message_bytes <= 0:
        return 0.0, 0.0
    local, nodes = group.ranks_per_node, group.nodes
    intra = inter = 0.0
    if local > 1:  # reduce-scatter + all-gather inside the node
        intra = (2 * (local - 1) * cluster.intra_node_latency_us * 1e-6
                 + 2 * (local - 1) / local * message_bytes / cluster.nvlink_bytes_per_s)
    if nodes > 1:  # each local rank reduces its 1/local shard across the nodes
        inter = (2 * (nodes - 1) * cluster.inter_node_latency_us * 1e-6
                 + 2 * (nodes - 1) / nodes * (message_bytes / local)
                 / cluster.nic_share_per_gpu)
    return intra, inter


def all_reduce_s(message_bytes: float, group: Group, cluster: ClusterSpec) -> float:
    """Hierarchical ring all-reduce of ``message_bytes`` held by every rank of ``group``."""
    return sum(all_reduce_parts(message_bytes, group, cluster))


def all_to_all_parts(bytes_per_rank: float, group: Group,
                     cluster: ClusterSpec) -> tuple[float, float]:
    """(NVLink seconds, NIC seconds) of an all-to-all where each rank sends
    ``bytes_per_rank`` spread evenly over the group."""
    if group.size <= 1 or bytes_per_rank <= 0:
        return 0.0, 0.0
    local = group.ranks_per_node
    remote = group.size - local
    intra = ((local - 1) * cluster.intra_node_latency_us * 1e-6
             + bytes_per_rank * (local - 1) / group.size / cluster.nvlink_bytes_per_s)
    inter = 0.0
    if remote > 0:
        inter = (remote * cluster.inter_node_latency_us * 1e-6
                 + bytes_per_rank * remote / group.size / cluster.nic_share_per_gpu)
    return intra, inter


def all_to_all_s(bytes_per_rank: float, group: Group, cluster: ClusterSpec) -> float:
    """All-to-all where each rank sends ``bytes_per_rank`` spread evenly over the group."""
    return sum(all_to_all_parts(bytes_per_rank, group, cluster))


def p2p_s(message_bytes: float, crosses_node: bool, cluster: ClusterSpec) -> float:
    """One point-to-point send between neighbouring pipeline stages."""
    if message_bytes <= 0:
        return 0.0
    if crosses_node:
        return cluster.inter_node_latency_us * 1e-6 + message_bytes / cluster.nic_share_per_gpu
    return cluster.intra_node_latency_us * 1e-6 + message_bytes / cluster.nvlink_bytes_per_s


def boundary_crosses_node(stage: int, plan: JobPlan, cluster: ClusterSpec) -> bool:
    """Whether stage ``stage`` and ``stage + 1`` live on different nodes."""
    width, per_node = plan.stage_ranks, cluster.gpus_per_node
    first = stage * width
    last_next = (stage + 2) * width - 1
    return first // per_node != last_next // per_node
