"""Iteration time of a 1F1B pipeline job, and of a localized replay of one stage.

Per micro-batch, a stage's GPU computes ``tokens x FLOPs/token / (peak x MFU)`` (or the
profiled time), blocks on the expert all-to-all (dispatch and combine, forward and
backward, for each MoE layer) and exchanges activations/gradients with its neighbours;
1F1B overlaps those point-to-point transfers with the next micro-batch's compute, so one
pipeline slot is ``max(compute + all-to-all, p2p)``. Following Appendix C,
``T_pipeline = (M + (S - 1) / v) x max_s slot_s`` (``v`` model chunks per GPU of the
interleaved schedule, 1 without interleaving) and ``T_iter = T_pipeline + T_sync + T_update``
with an alpha-beta gradient all-reduce (optionally partly overlapped with backward) and a
memory-bound optimizer step. A localized replay (MoEvement's upstream logging) runs one
stage's ``M`` micro-batches with inputs from the neighbours' logs: no pipeline bubble,
and frozen operators skip their weight-gradient GEMMs and optimizer update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.sim import comm
from lightning_moe_ckpt.sim.inputs import ClusterSpec, JobPlan, PrecisionSpec
from lightning_moe_ckpt.sim.profile import MeasuredProfile
from lightning_moe_ckpt.sim.workload import Stage


@dataclass(frozen=True)
class StageTiming:
    """Fault-free costs of one stage; per micro-batch unless named per iteration."""

    index: int
    compute_s: float  # forward + backward on one GPU, all operators active
    all_to_all_s: float  # expert dispatch/combine, forward and backward
    p2p_s: float  # slowest boundary transfer of the stage
    grad_sync_s: float  # per iteration
    update_s: float  # per iteration

    @property
    def slot_s(self) -> float:
        """One 1F1B slot: p2p overlaps compute, the all-to-all does not."""
        return max(self.compute_s + self.all_to_all_s, self.p2p_s)


@dataclass(frozen=True)
class IterationTime:
    """The decomposition of one fault-free iteration."""

    stages: tuple[StageTiming, ...]
    microbatches: int
    pipeline_s: float
    sync_s: float
    update_s: float
    iteration_s: float

    @property
    def slot_s(self) -> float:
        return max(stage.slot_s for stage in self.stages)


class IterationModel:
    """Times iterations of one job; optionally calibrated by a measured profile."""

    def __init__(self, model: MoEModelConfig, stages: Sequence[Stage], plan: JobPlan,
                 cluster: ClusterSpec, precision: PrecisionSpec,
                 profile: MeasuredProfile | None = None, grad_sync_overlap: float = 0.0) -> None:
        self.model, self.stages, self.plan = model, tuple(stages), plan
        self.cluster, self.precision, self.profile = cluster, precision, profile
        self.grad_sync_overlap = grad_sync_overlap
        self._flops_per_s = cluster.flops_per_s(precision.compute_format)
        self.time = self._iteration()

    # -- per micro-batch -------------------------------------------------------------
    def compute_s(self, stage: Stage, frozen: frozenset[str] = frozenset()) -> float:
        """Forward + backward of one micro-batch on one GPU of ``stage``."""
        flops = stage.flops_per_token(frozen)
        if self.profile is not None:
            # Measured time already includes the all-to-all; freezing scales it by FLOPs.
            measured = self.profile.stages[stage.index].total_s
            return measured * flops / stage.flops_per_token()
        return self.plan.tokens_per_rank * flops / self._flops_per_s

    def all_to_all_s(self, stage: Stage) -> float:
        if self.profile is not None or self.plan.ep == 1:
            return 0.0
        moe_layers = len(stage.layers)
        per_rank = (self.plan.tokens_per_rank * self.model.top_k * self.model.d_model
                    * self.precision.activation_bytes)
        group = comm.expert_group(self.plan, self.cluster)
        return 4 * moe_layers * comm.all_to_all_s(per_rank, group, self.cluster)

    def p2p_s(self, stage: Stage) -> float:
        message = self.plan.tokens_per_rank * self.model.d_model * self.precision.activation_bytes
        sends = []
        if stage.index + 1 < self.plan.pp:
            sends.append(comm.boundary_crosses_node(stage.index, self.plan, self.cluster))
        if stage.index > 0:
            sends.append(comm.boundary_crosses_node(stage.index - 1, self.plan, self.cluster))
        return max((comm.p2p_s(message, crosses, self.cluster) for crosses in sends), default=0.0)

    # -- per iteration ---------------------------------------------------------------
    def grad_sync_s(self, stage: Stage, active_share: float = 1.0) -> float:
        """Non-expert gradients over ``dp x ep``, expert gradients over ``dp``."""
        if self.profile is not None and self.profile.grad_sync_s is not None:
            return self.profile.grad_sync_s * active_share
        grad = self.precision.grad_bytes
        dense = comm.all_reduce_s(stage.numel(expert=False) * grad,
                                  comm.stage_group(self.plan, self.cluster), self.cluster)
        experts = comm.all_reduce_s(stage.numel(expert=True) / self.plan.ep * grad,
                                    comm.expert_data_group(self.plan, self.cluster), self.cluster)
        return (dense + experts) * (1.0 - self.grad_sync_overlap) * active_share

    def update_s(self, stage: Stage, active_share: float = 1.0) -> float:
        """AdamW over this GPU's shard: read and write master state, read the gradient,
        write the compute weights; memory-bound."""
        if self.profile is not None and self.profile.optimizer_s is not None:
            return self.profile.optimizer_s * active_share
        p = self.precision
        bytes_per_param = 2 * p.master_state_bytes + p.grad_bytes + p.compute_bytes
        return stage.params_per_gpu * bytes_per_param / self.cluster.hbm_bytes_per_s * active_share

    def network_busy_s(self) -> float:
        """Seconds per iteration the training's own traffic keeps one GPU's NIC share busy
        (cross-node pipeline sends, expert all-to-all and gradient all-reduce), on the
        busiest stage: the network time checkpoint copies cannot use."""
        plan, cluster = self.plan, self.cluster
        message = plan.tokens_per_rank * self.model.d_model * self.precision.activation_bytes
        grad = self.precision.grad_bytes
        busiest = 0.0
        for stage in self.stages:
            # One activation downstream and one gradient upstream per micro-batch, for each
            # boundary of this stage that leaves the node.
            boundaries = [i for i in (stage.index - 1, stage.index) if 0 <= i < plan.pp - 1]
            crossing = sum(comm.boundary_crosses_node(i, plan, cluster) for i in boundaries)
            sends = plan.microbatches * crossing * message / cluster.nic_share_per_gpu
            dispatch = 0.0
            if plan.ep > 1:
                per_rank = plan.tokens_per_rank * self.model.top_k * self.model.d_model * \
                    self.precision.activation_bytes
                dispatch = 4 * len(stage.layers) * plan.microbatches * comm.all_to_all_parts(
                    per_rank, comm.expert_group(plan, cluster), cluster)[1]
            sync = (comm.all_reduce_parts(stage.numel(expert=False) * grad,
                                          comm.stage_group(plan, cluster), cluster)[1]
                    + comm.all_reduce_parts(stage.numel(expert=True) / plan.ep * grad,
                                            comm.expert_data_group(plan, cluster), cluster)[1])
            busiest = max(busiest, sends + dispatch + sync)
        return busiest

    def _stage_timing(self, stage: Stage) -> StageTiming:
        return StageTiming(stage.index, self.compute_s(stage), self.all_to_all_s(stage),
                           self.p2p_s(stage), self.grad_sync_s(stage), self.update_s(stage))

    def _iteration(self) -> IterationTime:
        timings = tuple(self._stage_timing(stage) for stage in self.stages)
        slots = self.plan.microbatches + self.plan.bubble_slots
        pipeline = slots * max(t.slot_s for t in timings)
        sync = max(t.grad_sync_s for t in timings)
        update = max(t.update_s for t in timings)
        total = pipeline + sync + update
        if self.profile is not None and self.profile.iteration_s is not None:
            total = self.profile.iteration_s  # measured beats modelled
        return IterationTime(timings, self.plan.microbatches, pipeline, sync, update, total)

    # -- recovery --------------------------------------------------------------------
    def replay_iteration_s(self, stage: Stage, frozen: frozenset[str] = frozenset()) -> float:
        """One iteration of ``stage`` replayed locally from upstream logs: ``M`` slots with
        no bubble; frozen operators skip weight gradients, their reduction and update."""
        total = sum(op.numel for op in stage.operators) or 1
        active = 1.0 - sum(op.numel for op in stage.operators if op.name in frozen) / total
        slot = max(self.compute_s(stage, frozen) + self.all_to_all_s(stage), self.p2p_s(stage))
        return (self.plan.microbatches * slot + self.grad_sync_s(stage, active)
                + self.update_s(stage, active))

    def expert_compute_per_iteration_s(self) -> float:
        """Routed-expert GEMM time of one iteration on the slowest stage (lost-token
        compensation reprocesses this much work per lost iteration of tokens)."""
        worst = 0.0
        for stage in self.stages:
            share = stage.expert_flops_per_token / max(stage.flops_per_token(), 1e-30)
            worst = max(worst, self.compute_s(stage) * share)
        return self.plan.microbatches * worst
