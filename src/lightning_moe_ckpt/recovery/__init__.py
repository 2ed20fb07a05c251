"""Recovery: :func:`recover`, the one entry point every failure detector calls, and what
it is made of: window agreement and fetch, the recovery scope, the upstream log,
sparse-to-dense conversion and replay, localized and global rollback, and the durable
fallback.

:mod:`~lightning_moe_ckpt.recovery.upstream_log` keeps host copies of every boundary
tensor a rank sends (plus inputs, labels and per-iteration scalars) so a failed stage can
replay from its neighbours' logs; :mod:`~lightning_moe_ckpt.recovery.scope` computes which
ranks roll back (paper §3.4 and Appendix A) and which pause.
"""

from lightning_moe_ckpt.recovery.api import RecoveryOutcome, RecoveryRequest, recover
from lightning_moe_ckpt.recovery.durable import DurableSource, newest_committed_durable
from lightning_moe_ckpt.recovery.scope import (
    RecoveryScope,
    adjacent,
    paused_ranks,
    recovery_scopes,
    restarted,
)
from lightning_moe_ckpt.recovery.side import CheckpointSide
from lightning_moe_ckpt.recovery.sparse_to_dense import Cascade, RecoveryReport
from lightning_moe_ckpt.recovery.upstream_log import (
    IterationScalars,
    LogBufferPool,
    LoggedBatch,
    UpstreamLog,
)

__all__ = ["Cascade", "CheckpointSide", "DurableSource", "IterationScalars", "LogBufferPool",
           "LoggedBatch", "RecoveryOutcome", "RecoveryReport", "RecoveryRequest",
           "RecoveryScope", "UpstreamLog", "adjacent", "newest_committed_durable",
           "paused_ranks", "recover", "recovery_scopes", "restarted"]
