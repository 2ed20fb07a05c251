"""Measured compute of one training job, per pipeline stage: the simulator's profile inputs.

:func:`measure_compute` times, in this process, what the ETTR simulator's profile file
(``sim.profile``, see :mod:`lightning_moe_ckpt.sim.profile`) describes: per pipeline rank,
the forward and the backward of one micro-batch through the layers that rank holds (its
stages as :func:`~lightning_moe_ckpt.parallel.partition.stage_modules` split the model,
every virtual stage of an interleaved schedule included), with the micro-batch one rank of
a stage processes (``global_batch / microbatches / (dp x ep)`` sequences); one optimizer
step (gradients into the master weights, master-weight AdamW, gradients dropped) of the
rank holding the most parameters; and the device-to-host copy bandwidth the snapshot
engine sees. Every figure is the median of ``repeats`` timed runs after ``warmup`` untimed
ones, with as many threads as one process of the run gets (cores // world size on CPU).

Approximations, stated so the profile is read correctly: the stage runs with all of its
experts on random tokens, so the expert all-to-all of ``ep > 1`` is not in the stage time
(the simulator then models it as part of the stage, as it does for profiled stages); the
optimizer step of a rank is the whole model's step scaled by that rank's share of the
parameters (experts divided over ``ep``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lightning_moe_ckpt.errors import fmt, require
from lightning_moe_ckpt.models.transformer import MoETransformer
from lightning_moe_ckpt.parallel.partition import StageModule
from lightning_moe_ckpt.planning.profiler import BANDWIDTH_PROBE_BYTES, measure_bandwidth
from lightning_moe_ckpt.training.iteration import build_model, build_optimizer, language_model_loss
from moe_recipes.settings import RunSettings


@dataclass(frozen=True)
class StageTimes:
    """One micro-batch through one pipeline rank's layers, in seconds."""

    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class ComputeProfile:
    """What :func:`measure_compute` measured."""

    stages: tuple[StageTimes, ...]  # one per pipeline rank
    optimizer_s: float  # one optimizer step of the rank with the most parameters
    device_to_host_bytes_per_s: float
    sequences_per_microbatch: int
    threads: int


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], object], device: torch.device, warmup: int,
                   repeats: int, before: Callable[[], object] | None = None) -> float:
    """Median wall time of ``run()`` over ``repeats`` calls after ``warmup`` untimed ones;
    ``before()`` runs untimed ahead of every call."""
    samples = []
    for index in range(warmup + repeats):
        if before is not None:
            before()
        _synchronize(device)
        started = time.perf_counter()
        run()
        _synchronize(device)
        if index >= warmup:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


@contextmanager
def _threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _rank_numel(modules: list[StageModule], ep: int) -> float:
    """Parameters one rank holds: non-expert ones whole, routed experts split over ``ep``."""
    seen: dict[int, float] = {}
    for module in modules:
        for name, param in module.named_parameters():
            seen[id(param)] = param.numel() / (ep if ".experts." in name else 1)
    return sum(seen.values())


def measure_compute(settings: RunSettings, warmup: int = 2, repeats: int = 5,
                    device: torch.device | str = "cpu",
                    threads: int | None = None) -> ComputeProfile:
    """Time the job's stages, optimizer step and host-copy bandwidth (see module doc) with
    ``threads`` threads (default: what one of the run's processes gets)."""
    require(isinstance(repeats, int) and repeats >= 1, f"{fmt('repeats', repeats)} must be >= 1")
    require(isinstance(warmup, int) and warmup >= 0, f"{fmt('warmup', warmup)} must be >= 0")
    require(threads is None or threads >= 1, f"{fmt('threads', threads)} must be >= 1")
    plan, device = settings.layout, torch.device(device)
    sequences = settings.global_batch // plan.microbatches // plan.data_shards
    require(sequences >= 1,
            f"trainer.global_batch={settings.global_batch} gives no whole sequence per rank "
            f"with parallel.microbatches={plan.microbatches}, "
            f"dp*dp_shard*ep={plan.data_shards}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // plan.world_size) if device.type == "cpu" \
            else torch.get_num_threads()
    with _threads(threads):
        model = build_model(settings.model, settings.precision, settings.seed).to(device)
        generator = torch.Generator().manual_seed(settings.seed)
        tokens = torch.randint(0, settings.model.vocab_size,
                               (sequences, settings.data.seq_len + 1), generator=generator,
                               device="cpu")
        inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        per_stage = _time_stages(model, settings, inputs, targets, device, warmup, repeats)
        ranks = [[StageModule(model, plan.stage_layers(stage), stage == 0,
                              stage == plan.num_stages - 1) for stage in plan.stages_of(rank)]
                 for rank in range(plan.pp)]
        stages = tuple(StageTimes(sum(per_stage[s][0] for s in plan.stages_of(rank)),
                                  sum(per_stage[s][1] for s in plan.stages_of(rank)))
                       for rank in range(plan.pp))
        total = sum(p.numel() for p in model.parameters())
        share = max(_rank_numel(modules, plan.ep) for modules in ranks) / total
        optimizer_s = share * _time_optimizer(model, settings, inputs, targets, device,
                                              warmup, repeats)
        bandwidth = measure_bandwidth(BANDWIDTH_PROBE_BYTES, device)
    return ComputeProfile(stages, optimizer_s, bandwidth, sequences, threads)


def _time_stages(model: MoETransformer, settings: RunSettings, inputs: torch.Tensor,
                 targets: torch.Tensor, device: torch.device, warmup: int,
                 repeats: int) -> list[tuple[float, float]]:
    """(forward, backward) seconds of every pipeline stage in data-flow order; a stage's
    input is the previous stage's output, detached as a received activation is."""
    plan = settings.layout
    times = []
    hidden: torch.Tensor = inputs
    for stage in range(plan.num_stages):
        last = stage == plan.num_stages - 1
        module = StageModule(model, plan.stage_layers(stage), stage == 0, last)
        source = hidden if stage == 0 else hidden.detach().requires_grad_(True)

        def forward(module: StageModule = module, source: torch.Tensor = source) -> torch.Tensor:
            return module(source)

        def forward_backward(module: StageModule = module, source: torch.Tensor = source,
                             last: bool = last) -> None:
            out = module(source)
            if last:
                language_model_loss(out, targets).backward()
            else:
                out.backward(torch.ones_like(out))

        def clear(module: StageModule = module, source: torch.Tensor = source) -> None:
            module.zero_grad(set_to_none=True)
            source.grad = None

        forward_s = median_seconds(forward, device, warmup, repeats, clear)
        both_s = median_seconds(forward_backward, device, warmup, repeats, clear)
        times.append((forward_s, max(both_s - forward_s, 0.0)))
        with torch.no_grad():
            hidden = module(source)
    return times


def _time_optimizer(model: MoETransformer, settings: RunSettings, inputs: torch.Tensor,
                    targets: torch.Tensor, device: torch.device, warmup: int,
                    repeats: int) -> float:
    """One whole-model optimizer step as the training iteration runs it (gradients into
    the master weights, AdamW, gradients dropped), after an untimed forward/backward."""
    optimizer = build_optimizer(model, settings.precision, settings.optim)
    microbatches = settings.layout.microbatches

    def backward() -> None:
        language_model_loss(model(inputs), targets).backward()

    def step() -> None:
        optimizer.collect_grads(divisor=microbatches)
        optimizer.step()
        optimizer.zero_grad()

    return median_seconds(step, device, warmup, repeats, backward)
