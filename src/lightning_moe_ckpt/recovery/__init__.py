"""Recovery groundwork: upstream logging, failure injection and recovery scopes.

:mod:`~lightning_moe_ckpt.recovery.upstream_log` keeps host copies of every boundary
tensor a rank sends (plus inputs, labels and per-iteration scalars) so a failed stage can
replay from its neighbours' logs; :mod:`~lightning_moe_ckpt.recovery.faults` decides when
and where ranks fail and destroys what a dead worker loses;
:mod:`~lightning_moe_ckpt.recovery.scope` computes which ranks roll back (paper §3.4 and
Appendix A) and which pause.
"""

from lightning_moe_ckpt.recovery.faults import (
    PHASES,
    AtSchedule,
    FailureCounter,
    FailureEvent,
    FaultSchedule,
    LostState,
    MtbfSchedule,
    NoFaults,
    Phase,
    TraceSchedule,
    destroy_rank_state,
    parse_event,
    schedule_from_config,
)
from lightning_moe_ckpt.recovery.scope import (
    RecoveryScope,
    adjacent,
    paused_ranks,
    recovery_scopes,
    restarted,
)
from lightning_moe_ckpt.recovery.upstream_log import (
    IterationScalars,
    LogBufferPool,
    LoggedBatch,
    UpstreamLog,
)

__all__ = [
    "PHASES",
    "AtSchedule",
    "FailureCounter",
    "FailureEvent",
    "FaultSchedule",
    "IterationScalars",
    "LogBufferPool",
    "LoggedBatch",
    "LostState",
    "MtbfSchedule",
    "NoFaults",
    "Phase",
    "RecoveryScope",
    "TraceSchedule",
    "UpstreamLog",
    "adjacent",
    "destroy_rank_state",
    "parse_event",
    "paused_ranks",
    "recovery_scopes",
    "restarted",
    "schedule_from_config",
]
