"""Pipeline parallelism on ``torch.distributed.pipelining`` with a boundary-tensor hook.

:class:`HookedPipelineStage` is a ``PipelineStage`` that shows every activation it sends
downstream and every input gradient it sends upstream to the registered hooks, tagged
``(iteration, micro-batch, stage)``. The hook points are ``forward_one_chunk`` and
``backward_one_chunk``, which every schedule calls exactly once per micro-batch; what
they expose (``fwd_cache[mb][0]`` and ``bwd_cache[mb]``) is exactly what the stage's send
ops transmit. Upstream logging attaches here.

Stages get static input/output metadata: without it ``PipelineStage`` runs a shape
inference forward on the first step, which would pollute the router statistics and run
expert-parallel collectives on garbage. Schedules use ``scale_grads=False``: gradients
are summed over micro-batches and divided once, in fp32, by the master-weight optimizer,
exactly as the single-process reference does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from typing_extensions import override

from lightning_moe_ckpt.core.layout import ParallelPlan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BoundaryEvent:
    """One tensor crossing a pipeline boundary, seen on the sending stage."""

    kind: Literal["activation", "gradient"]
    iteration: int
    microbatch: int
    stage: int
    tensors: tuple[torch.Tensor | None, ...]  # gradient entries may be None (zeros sent)


BoundaryHook = Callable[[BoundaryEvent], None]


class HookedPipelineStage(PipelineStage):
    """``PipelineStage`` that reports every boundary send to its hooks."""

    def __init__(self, *args: Any, hooks: list[BoundaryHook], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hooks = hooks
        self.iteration = 0  # negative while evaluating: nothing is reported

    @override
    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...],
                          kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self.hooks and not self.is_last and self.iteration >= 0:
            sent = tuple(t.detach() for t in self.fwd_cache[fwd_chunk_id][0])
            self._emit(BoundaryEvent("activation", self.iteration, fwd_chunk_id,
                                     self.stage_index, sent))
        return output

    @override
    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if self.hooks and self.has_backward and not self.is_first and self.iteration >= 0:
            grads = tuple(self.bwd_cache[bwd_chunk_id])
            self._emit(BoundaryEvent("gradient", self.iteration, bwd_chunk_id,
                                     self.stage_index, grads))

    def _emit(self, event: BoundaryEvent) -> None:
        for hook in self.hooks:
            hook(event)

    # -- replay: logged tensors stand in for a paused neighbour --------------------------
    # ``replay_prev`` (micro-batch -> activations the previous stage sent) replaces the
    # receives from a previous stage that is not replaying, and drops the gradients that
    # would be sent back to it; ``replay_next`` does the same toward the next stage.

    replay_prev: dict[int, tuple[torch.Tensor, ...]] | None = None
    replay_next: dict[int, tuple[torch.Tensor | None, ...]] | None = None

    @override
    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if self.replay_prev is None or self.is_first:
            return super().get_fwd_recv_ops(fwd_chunk_id)
        for info, tensor in zip(self.args_recv_info[fwd_chunk_id],
                                self.replay_prev[fwd_chunk_id], strict=True):
            info.buffer = tensor.detach().clone()
        return []

    @override
    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.replay_next is None or self.is_last or not self.has_backward:
            return super().get_bwd_recv_ops(bwd_chunk_id)
        for info, grad in zip(self.grad_recv_info[bwd_chunk_id],
                              self.replay_next[bwd_chunk_id], strict=True):
            if info.buffer is not None:
                info.buffer = (torch.zeros_like(info.buffer)
                               if grad is None else grad.detach().clone())
        return []

    @override
    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        return [] if self.replay_next is not None else ops

    @override
    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)  # pops the cache either way
        return [] if self.replay_prev is not None else ops


class PipelineRunner:
    """A pipeline rank's stages and schedule; runs one iteration's micro-batches."""

    def __init__(self, stages: Sequence[nn.Module], plan: ParallelPlan, pp_rank: int,
                 group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 micro_batch: int, seq_len: int, d_model: int, vocab_size: int,
                 loss_fn: LossFn, hooks: list[BoundaryHook]) -> None:
        self.plan = plan
        self.stages: list[HookedPipelineStage] = []
        for stage_index, module in zip(plan.stages_of(pp_rank), stages, strict=True):
            first, last = stage_index == 0, stage_index == plan.num_stages - 1
            if first:
                example_in = torch.empty(micro_batch, seq_len, dtype=torch.int64, device="meta")
            else:  # must require grad, or the stage computes and sends no input gradient
                example_in = torch.empty(micro_batch, seq_len, d_model, dtype=dtype,
                                         device="meta", requires_grad=True)
            width = vocab_size if last else d_model
            example_out = torch.empty(micro_batch, seq_len, width, dtype=dtype, device="meta",
                                      requires_grad=True)
            self.stages.append(HookedPipelineStage(
                module, stage_index, plan.num_stages, device, input_args=(example_in,),
                output_args=(example_out,), group=group, hooks=hooks))
        # iteration -> stage index -> (logged activations from the previous stage,
        # logged gradients from the next stage), set for a localized replay.
        self.replay: dict[int, dict[int, tuple[Any, Any]]] = {}
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.schedule: Schedule1F1B | ScheduleInterleaved1F1B
        if plan.stages_per_rank == 1:
            self.schedule = Schedule1F1B(self.stages[0], plan.microbatches, loss_fn=loss_fn,
                                         scale_grads=False)
        else:
            stages_of_rank: list[Any] = list(self.stages)
            self.schedule = ScheduleInterleaved1F1B(stages_of_rank, plan.microbatches,
                                                    loss_fn=loss_fn, scale_grads=False)

    def run(self, iteration: int, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """All micro-batches of ``inputs``/``targets`` (``[M, b, S]``); returns the summed
        micro-batch loss on the rank holding the last stage, zero elsewhere."""
        logged = self.replay.get(iteration, {})
        for stage in self.stages:
            stage.iteration = iteration
            stage.replay_prev, stage.replay_next = logged.get(stage.stage_index, (None, None))
        args = (inputs.flatten(0, 1),) if self.has_first else ()
        losses: list[torch.Tensor] = []
        try:
            if self.has_last:
                self.schedule.step(*args, target=targets.flatten(0, 1), losses=losses)
            else:
                self.schedule.step(*args)
        finally:
            for stage in self.stages:
                stage.replay_prev = stage.replay_next = None
        return _sequential_sum(losses, inputs.device)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward-only pass over all micro-batches (boundary hooks stay silent); returns the
        summed micro-batch loss on the last stage's rank, zero elsewhere."""
        for stage in self.stages:
            stage.iteration = -1
        args = (inputs.flatten(0, 1),) if self.has_first else ()
        losses: list[torch.Tensor] = []
        if self.has_last:
            self.schedule.eval(*args, target=targets.flatten(0, 1), losses=losses)
        else:
            self.schedule.eval(*args)
        return _sequential_sum(losses, inputs.device)


def _sequential_sum(losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for loss in losses:  # sequential, in micro-batch order, like the reference loop
        total = total + loss.detach()
    return total
