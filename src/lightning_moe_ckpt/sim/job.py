"""One simulated training job: model, plan, cluster and precision wired into cost models.

:func:`build_job` validates the combination (raising :class:`ConfigError` with the config
key), draws the expert popularity, derives the operators and pipeline stages and times the
fault-free iteration. :class:`SimJob` then answers the byte and bandwidth questions every
checkpoint policy asks: how much state a GPU holds, how fast it can reach host memory, a
peer's host memory or durable storage, and how much the upstream log adds per iteration.
The stage whose GPUs hold the most state bounds every checkpoint transfer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_moe_ckpt.errors import require
from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.sim.calibration import NEUTRAL, Calibration
from lightning_moe_ckpt.sim.inputs import ClusterSpec, JobPlan, PrecisionSpec
from lightning_moe_ckpt.sim.iteration import IterationModel, IterationTime
from lightning_moe_ckpt.sim.popularity import sample_shares
from lightning_moe_ckpt.sim.profile import MeasuredProfile
from lightning_moe_ckpt.sim.workload import OperatorCost, Stage, build_operators, split_stages


@dataclass(frozen=True)
class JobSpec:
    """Everything that defines a simulated job. :func:`build_job` validates it.

    Args:
        model: The model's shape.
        plan: Its layout and batch shape.
        cluster: The cluster it runs on.
        precision: Bytes per parameter element and the GEMM format.
        replicas: Peer copies of in-memory checkpoints (paper §4: r = 2).
        popularity_alpha: The Dirichlet alpha of the expert popularity; ``None``: balanced
            routing.
        popularity_seed: Seed of the popularity draw.
        grad_sync_overlap: Share of the gradient all-reduce hidden behind backward, in
            [0, 1).
        restart_s: Failure detection plus replacement, seconds, equal for every policy.
        profile: Measured timings that replace the cluster's estimates; ``None``: the
            estimates.
        calibration: The fitted constants; default: neutral.
        key: Prefixes error messages (the configuration key of the job).
    """

    model: MoEModelConfig
    plan: JobPlan
    cluster: ClusterSpec
    precision: PrecisionSpec
    replicas: int = 2
    popularity_alpha: float | None = None
    popularity_seed: int = 0
    grad_sync_overlap: float = 0.0
    restart_s: float = 0.0
    profile: MeasuredProfile | None = None
    calibration: Calibration = NEUTRAL
    key: str = "sim"


@dataclass
class SimJob:
    """A built job: operators, stages, iteration time, and checkpoint transfer rates.

    Attributes:
        spec: What defines the job.
        shares: Expert token shares, ``[layers, experts]``.
        operators: The checkpointable operators with their state bytes and FLOPs.
        stages: The pipeline stages and the share of state each of their GPUs holds.
        timing: The fault-free iteration's timing model.
    """

    spec: JobSpec
    shares: np.ndarray
    operators: tuple[OperatorCost, ...]
    stages: tuple[Stage, ...]
    timing: IterationModel

    @property
    def time(self) -> IterationTime:
        return self.timing.time

    @property
    def iteration_s(self) -> float:
        return self.time.iteration_s

    @property
    def cluster(self) -> ClusterSpec:
        return self.timing.cluster

    @property
    def plan(self) -> JobPlan:
        return self.spec.plan

    @property
    def overlap_window_s(self) -> float:
        """Time a snapshot of step t may take before step t+1's optimizer overwrites it."""
        return max(self.iteration_s - self.time.update_s, 0.0)

    # -- state sizes -----------------------------------------------------------------
    @functools.cached_property
    def total_params(self) -> int:
        return sum(op.numel for op in self.operators)

    @functools.cached_property
    def dense_bytes_total(self) -> float:
        """Master weights + optimizer state of the whole model (one dense checkpoint)."""
        return sum(op.master_state_bytes for op in self.operators)

    @functools.cached_property
    def dense_bytes_per_gpu(self) -> float:
        """One dense checkpoint's share on a GPU of the largest stage."""
        return max(stage.master_state_per_gpu for stage in self.stages)

    @property
    def node_gpus(self) -> int:
        return min(self.cluster.gpus_per_node, self.plan.world_size)

    @functools.cached_property
    def log_bytes_per_iteration(self) -> float:
        """Upstream log one GPU writes per iteration: the activation it sends downstream
        and the gradient it sends upstream, per micro-batch (paper §3.4)."""
        model, plan = self.spec.model, self.plan
        per_message = plan.tokens_per_rank * model.d_model * self.spec.precision.activation_bytes
        directions = 0 if plan.pp == 1 else 2
        return plan.microbatches * per_message * directions

    # -- transfer rates and times ----------------------------------------------------
    @property
    def calibration(self) -> Calibration:
        return self.spec.calibration

    @functools.cached_property
    def training_network_share(self) -> float:
        """Share of an iteration the training's own inter-node traffic keeps a GPU's NIC
        share busy."""
        return min(self.timing.network_busy_s() / self.iteration_s, 1.0)

    @property
    def host_copy_per_gpu(self) -> float:
        """Per-GPU rate of host-staged copies to peers during training: the calibrated
        share of line rate, in the NIC time the training's own traffic leaves free, but at
        least half of it (two competing flows share a link fairly; what checkpoint traffic
        then takes from training is its network interference)."""
        free = max(1.0 - self.training_network_share, 0.5)
        return (self.cluster.nic_share_per_gpu * self.calibration.host_network_efficiency
                * free)

    @property
    def host_copy_per_node(self) -> float:
        """Per-node rate of host-staged copies while training is stopped (a replacement
        node fetching its state during recovery)."""
        return self.cluster.nic_bytes_per_s * self.calibration.host_network_efficiency

    @property
    def storage_bytes_per_s(self) -> float:
        """Aggregate rate of checkpoint files to or from durable storage."""
        return self.cluster.storage_bytes_per_s * self.calibration.storage_efficiency

    def to_host_s(self, nbytes: float) -> float:
        """GPU to its own host memory over PCIe."""
        return nbytes / self.cluster.pcie_bytes_per_s

    def to_peers_s(self, nbytes: float) -> float:
        """Replicating ``nbytes`` of one GPU to ``replicas`` peers' host memory."""
        return nbytes * self.spec.replicas / self.host_copy_per_gpu

    def node_fetch_s(self, nbytes_per_gpu: float) -> float:
        """A replacement node pulling ``nbytes_per_gpu`` for each of its GPUs from peers."""
        return nbytes_per_gpu * self.node_gpus / self.host_copy_per_node

    def storage_s(self, nbytes_total: float) -> float:
        """Moving ``nbytes_total`` between the cluster and durable storage."""
        return nbytes_total / self.storage_bytes_per_s

    def node_storage_s(self, nbytes_per_gpu: float) -> float:
        """A replacement node reading its GPUs' state back from durable storage."""
        rate = min(self.storage_bytes_per_s, self.host_copy_per_node)
        return nbytes_per_gpu * self.node_gpus / rate

    @property
    def global_restart_s(self) -> float:
        """Restart cost of a failure that rolls every rank back: detection and replacement,
        plus every rank's restart, one bootstrap step per doubling of the nodes."""
        nodes = self.plan.nodes(self.cluster.gpus_per_node)
        steps = math.log2(nodes) if nodes > 1 else 0.0
        return self.spec.restart_s + self.calibration.global_restart_s_per_doubling * steps

    def interference(self, pcie_bytes: Any, network_bytes: Any) -> Any:
        """Runtime overhead fraction of one GPU's checkpoint traffic per iteration:
        ``pcie_bytes`` device-to-host and ``network_bytes`` leaving the node (replicas or
        storage), each slowing training in proportion to the share of the iteration it
        keeps its link busy (at most all of it). Arrays give one value per element."""
        pcie_busy = np.minimum(pcie_bytes / self.cluster.pcie_bytes_per_s / self.iteration_s,
                               1.0)
        network_busy = np.minimum(network_bytes / self.host_copy_per_gpu / self.iteration_s,
                                  1.0)
        c = self.calibration
        return c.copy_interference * pcie_busy + c.network_interference * network_busy


def build_job(spec: JobSpec) -> SimJob:
    """Validate ``spec`` and build the job's operators, stages and timing.

    Args:
        spec: The job.

    Returns:
        The built job.

    Raises:
        ConfigError: A value out of range or a plan that cannot hold the model, naming
            the key (prefixed by ``spec.key``).
    """
    key = spec.key
    spec.plan.check_model(spec.model, key)
    require(isinstance(spec.replicas, int) and spec.replicas >= 0,
            f"{key}.replicas={spec.replicas} must be an integer >= 0")
    require(0.0 <= spec.grad_sync_overlap < 1.0,
            f"{key}.grad_sync_overlap={spec.grad_sync_overlap} must be in [0, 1)")
    require(spec.restart_s >= 0, f"{key}.restart_s={spec.restart_s} must be >= 0")
    cluster = spec.cluster
    if spec.profile is not None:
        spec.profile.check_plan(spec.model.name, spec.plan.pp, spec.plan.microbatches,
                                "sim.profile")
        cluster = spec.profile.apply_bandwidths(cluster)
    rng = np.random.default_rng(spec.popularity_seed)
    shares = sample_shares(spec.popularity_alpha, spec.model.n_layers, spec.model.n_experts, rng)
    operators = build_operators(spec.model, spec.precision, spec.plan.seq_len, shares)
    stages = split_stages(operators, spec.plan, spec.model.n_layers)
    timing = IterationModel(spec.model, stages, spec.plan, cluster, spec.precision,
                            spec.profile, spec.grad_sync_overlap)
    return SimJob(spec, shares, operators, stages, timing)
