"""Simulator inputs: the cluster, the parallel plan and the precision, validated up front.

The hardware presets (``conf/hardware/*.yaml``, block ``cluster``) quote link speeds in
Gbit/s the way vendors do; :class:`ClusterSpec` converts them to bytes per second once,
so every other simulator module works in bytes, FLOPs and seconds. A :class:`JobPlan`
is the paper's (pp, dp, ep) layout with batch shape; expert parallelism is carved out of
data parallelism (DeepSpeed-MoE), so non-expert parameters are replicated over ``dp x ep``
ranks of a stage and experts over ``dp``. :data:`PRECISIONS` lists the bytes per parameter
element of compute weights, master weights and optimizer state, including the FP8
variants of the paper's Table 7. Bad values raise :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightning_moe_ckpt.errors import ConfigError, fmt, require
from lightning_moe_ckpt.models.config import MoEModelConfig

BYTES_PER_GBIT = 1e9 / 8
ComputeFormat = Literal["fp32", "bf16", "fp16", "fp8"]


def _positive(key: str, value: Any, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and value > 0
    require(ok, f"{fmt(key, value)} must be a positive {'integer' if integer else 'number'}")


@dataclass(frozen=True)
class ClusterSpec:
    """One homogeneous GPU cluster (``hardware.cluster``); rates as configured, in Gbit/s.

    The constructor checks nothing; :meth:`from_mapping` and :meth:`validate` do.

    Args:
        name: The cluster's name (reported in outputs).
        gpus_per_node: GPUs per node.
        peak_tflops: Dense 16-bit tensor-core peak per GPU, TFLOP/s.
        mfu: Fraction of peak the stage GEMMs sustain, in (0, 1].
        device_memory_gbps: HBM bandwidth; bounds the optimizer step.
        intra_node_gbps: Per-GPU NVLink bandwidth.
        inter_node_gbps: Per-node NIC bandwidth, shared by its GPUs.
        device_to_host_gbps: Per-GPU PCIe bandwidth.
        remote_storage_gbps: Aggregate bandwidth of the whole cluster to durable storage.
        host_memory_gb: Host memory per node, GB.
        intra_node_latency_us: Collective latency within a node, microseconds (the alpha
            term of the collective model).
        inter_node_latency_us: Collective latency across nodes, microseconds.
        fp8_tflops: Dense FP8 peak per GPU, TFLOP/s; 0: no FP8 tensor cores.
        fp32_tflops: FP32 (TF32 tensor core) peak per GPU, TFLOP/s; ``None``: half the
            16-bit peak.
    """

    name: str
    gpus_per_node: int
    peak_tflops: float
    mfu: float
    device_memory_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    device_to_host_gbps: float
    remote_storage_gbps: float
    host_memory_gb: float
    intra_node_latency_us: float
    inter_node_latency_us: float
    fp8_tflops: float = 0.0
    fp32_tflops: float | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], name: str = "",
                     key: str = "hardware.cluster") -> ClusterSpec:
        """Build from a hardware preset's ``cluster`` block; unknown numeric keys are ignored
        (``gpu``, ``device_memory_gb`` describe the machine but do not enter the model)."""
        fields = [f for f in dataclasses.fields(cls) if f.name != "name"]
        kwargs: dict[str, Any] = {}
        for field in fields:
            if field.name not in values:
                if field.default is not dataclasses.MISSING:
                    continue
                raise ConfigError(f"{key}.{field.name} is missing; the ETTR simulator needs it "
                                  f"(see conf/hardware/a100.yaml for its meaning)")
            kwargs[field.name] = values[field.name]
        spec = cls(name=name, **kwargs)
        spec.validate(key)
        return spec

    def validate(self, key: str = "hardware.cluster") -> None:
        """Check every rate and fraction is in range."""
        _positive(f"{key}.gpus_per_node", self.gpus_per_node, integer=True)
        for field in ("peak_tflops", "device_memory_gbps", "intra_node_gbps", "inter_node_gbps",
                      "device_to_host_gbps", "remote_storage_gbps", "host_memory_gb"):
            _positive(f"{key}.{field}", getattr(self, field))
        require(isinstance(self.mfu, (int, float)) and 0 < self.mfu <= 1,
                f"{fmt(key + '.mfu', self.mfu)} must be in (0, 1]")
        for field in ("intra_node_latency_us", "inter_node_latency_us", "fp8_tflops"):
            value = getattr(self, field)
            require(isinstance(value, (int, float)) and value >= 0,
                    f"{fmt(key + '.' + field, value)} must be >= 0")
        if self.fp32_tflops is not None:
            _positive(f"{key}.fp32_tflops", self.fp32_tflops)

    def flops_per_s(self, compute_format: ComputeFormat) -> float:
        """Sustained FLOP/s of one GPU for GEMMs in ``compute_format``."""
        if compute_format == "fp8":
            return self.fp8_tflops * 1e12 * self.mfu
        if compute_format == "fp32":
            fp32 = self.peak_tflops / 2 if self.fp32_tflops is None else self.fp32_tflops
            return fp32 * 1e12 * self.mfu
        return self.peak_tflops * 1e12 * self.mfu

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.intra_node_gbps * BYTES_PER_GBIT

    @property
    def nic_bytes_per_s(self) -> float:
        """Whole node's inter-node bandwidth (GPU-driven NCCL traffic reaches line rate)."""
        return self.inter_node_gbps * BYTES_PER_GBIT

    @property
    def nic_share_per_gpu(self) -> float:
        """Inter-node bandwidth of one GPU when all GPUs of a node communicate at once."""
        return self.nic_bytes_per_s / self.gpus_per_node

    @property
    def pcie_bytes_per_s(self) -> float:
        return self.device_to_host_gbps * BYTES_PER_GBIT

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.device_memory_gbps * BYTES_PER_GBIT

    @property
    def storage_bytes_per_s(self) -> float:
        """Line rate of the whole cluster to durable storage, shared by every writer."""
        return self.remote_storage_gbps * BYTES_PER_GBIT


@dataclass(frozen=True)
class JobPlan:
    """Layout and batch shape of one training job.

    ``global_batch / micro_batch`` micro-batches flow through the 1F1B pipeline per
    iteration. The constructor checks nothing; :meth:`from_mapping` and :meth:`validate`
    do.

    Args:
        pp: Pipeline stages.
        dp: Data-parallel replicas.
        ep: Expert-parallel ranks (carved out of data parallelism).
        global_batch: Sequences per iteration; a multiple of ``micro_batch``.
        micro_batch: Sequences of one pipeline micro-batch; they are split over the
            ``dp x ep`` data-parallel ranks of a stage.
        seq_len: Tokens per sequence.
        gpus: The job's GPUs, checked against ``pp x dp x ep``; ``None``: not given.
        virtual_stages: The interleaved 1F1B schedule's model chunks per GPU (the paper's
            DeepSpeed runs use one such schedule, §5.1): the pipeline bubble shrinks to
            ``(pp - 1) / virtual_stages`` slots.
    """

    pp: int
    dp: int
    ep: int
    global_batch: int
    micro_batch: int
    seq_len: int
    gpus: int | None = None
    virtual_stages: int = 1

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], key: str) -> JobPlan:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        require(not unknown, f"unknown parallel plan key(s) "
                             f"{', '.join(key + '.' + k for k in unknown)}; known: {sorted(known)}")
        missing = sorted(k for k in known - {"gpus", "virtual_stages"} if k not in values)
        require(not missing, f"parallel plan {key} lacks {', '.join(missing)}")
        plan = cls(**dict(values))
        plan.validate(key)
        return plan

    def validate(self, key: str) -> None:
        for field in ("pp", "dp", "ep", "global_batch", "micro_batch", "seq_len",
                      "virtual_stages"):
            _positive(f"{key}.{field}", getattr(self, field), integer=True)
        require(self.global_batch % self.micro_batch == 0,
                f"{key}.global_batch={self.global_batch} must be a multiple of "
                f"{key}.micro_batch={self.micro_batch}")
        require(self.micro_batch % (self.dp * self.ep) == 0,
                f"{key}.micro_batch={self.micro_batch} must be divisible by dp*ep="
                f"{self.dp * self.ep} so every data-parallel rank gets whole sequences")
        if self.gpus is not None:
            require(self.gpus == self.world_size,
                    f"{key}.gpus={self.gpus} does not fit the plan: pp*dp*ep = {self.pp}*"
                    f"{self.dp}*{self.ep} = {self.world_size}")

    def check_model(self, model: MoEModelConfig, key: str) -> None:
        """Check the plan can hold ``model`` (stages, expert sharding, sequence length)."""
        require(self.pp <= model.n_layers,
                f"{key}.pp={self.pp} exceeds model.n_layers={model.n_layers} of "
                f"{model.name!r}: every pipeline stage needs at least one layer")
        experts, ep = model.n_experts, self.ep
        require(experts % ep == 0 or ep % experts == 0,
                f"{key}.ep={ep} must divide model.n_experts={experts} of {model.name!r} "
                f"(or be a multiple of it, slicing each expert)")
        require(self.seq_len <= model.max_seq_len,
                f"{key}.seq_len={self.seq_len} exceeds model.max_seq_len={model.max_seq_len} "
                f"of {model.name!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep

    @property
    def stage_ranks(self) -> int:
        """GPUs of one pipeline stage (the ``dp x ep`` data-parallel group)."""
        return self.dp * self.ep

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.micro_batch

    @property
    def bubble_slots(self) -> float:
        """Pipeline fill and drain, in micro-batch slots (interleaving divides it)."""
        return (self.pp - 1) / self.virtual_stages

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one GPU processes per micro-batch."""
        return self.micro_batch * self.seq_len // self.stage_ranks

    @property
    def tokens_per_iteration(self) -> int:
        return self.global_batch * self.seq_len

    def nodes(self, gpus_per_node: int) -> int:
        return math.ceil(self.world_size / gpus_per_node)


@dataclass(frozen=True)
class PrecisionSpec:
    """Bytes per parameter element of each kind of state, and the GEMM format.

    Args:
        name: The precision's name (a key of :data:`PRECISIONS`).
        compute_format: The GEMM format: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"``.
        compute_bytes: Weights read by forward/backward.
        master_bytes: Master weights.
        optimizer_bytes: AdamW first + second moment.
        activation_bytes: Activations and gradients on the wire.
        grad_bytes: Gradients reduced over data parallel ranks.
        native_dtype: Marks the precisions the library trains in (``trainer.precision``):
            their bytes are read from the real parameters' dtypes via the operator
            registry; ``None``: the others multiply parameter counts by the table's bytes
            per element.
    """

    name: str
    compute_format: ComputeFormat
    compute_bytes: float
    master_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    grad_bytes: float
    native_dtype: torch.dtype | None = None

    @property
    def master_state_bytes(self) -> float:
        return self.master_bytes + self.optimizer_bytes


# Table 7 rows are named compute-master-optimizer; the optimizer's two moments may differ
# (e.g. "fp8fp16": FP8 first moment, FP16 second moment). Activations stay 16-bit in all
# FP8 recipes cited there; gradients are reduced in the master precision.
PRECISIONS: dict[str, PrecisionSpec] = {
    spec.name: spec for spec in (
        PrecisionSpec("32", "fp32", 4, 4, 8, 4, 4, torch.float32),
        PrecisionSpec("bf16-master", "bf16", 2, 4, 8, 2, 2, torch.bfloat16),
        PrecisionSpec("fp16-fp16-fp16", "fp16", 2, 2, 4, 2, 2),  # Table 7 row 1 [87]
        PrecisionSpec("fp8-fp32-fp32", "fp8", 1, 4, 8, 2, 4),  # row 2 [55]
        PrecisionSpec("fp8-fp16-fp32", "fp8", 1, 2, 8, 2, 2),  # row 3 [52]
        PrecisionSpec("fp8-fp16-fp8fp16", "fp8", 1, 2, 3, 2, 2),  # row 4 [64]
        PrecisionSpec("fp8-fp8-fp8fp16", "fp8", 1, 1, 3, 2, 2),  # row 5 [64]
    )
}


def precision_spec(value: object, cluster: ClusterSpec,
                    key: str = "sim.precision") -> PrecisionSpec:
    """Look up a precision by name and check the cluster can run its GEMM format."""
    name = str(value)
    if name not in PRECISIONS:
        raise ConfigError(f"{fmt(key, value)} is not a known precision; choose one of "
                          f"{', '.join(PRECISIONS)}")
    spec = PRECISIONS[name]
    if spec.compute_format == "fp8":
        require(cluster.fp8_tflops > 0,
                f"{fmt(key, name)} computes in FP8 but hardware.cluster.fp8_tflops="
                f"{cluster.fp8_tflops} on {cluster.name or 'this cluster'} (no FP8 tensor cores)")
    return spec
