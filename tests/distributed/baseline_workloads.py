"""Workloads of the baseline-recovery tests: the same layout and failure under several
checkpoint policies, run one after the other in one spawned gloo world (module-level so
``spawn`` can pickle them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.testing import FailureInjector
from lightning_moe_ckpt.testing.faults import AtSchedule
from lightning_moe_ckpt.training.consolidate import gather_consolidated_state
from moe_recipes.settings import RunSettings, settings_from_config
from tests.distributed.workloads import _rank_engine

Scenario = tuple[str, str, dict[str, Any]]  # (label, policy, checkpoint options)


def capacity_settings(pp: int, dp: int, ep: int, steps: int) -> RunSettings:
    """Tiny model with a capacity limit (so MoEtion's boost changes what experts accept)."""
    return settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 16, "capacity_factor": 1.0},
        "data": {"seq_len": 16},
        "parallel": {"pp": pp, "dp": dp, "ep": ep, "microbatches": 2},
        "trainer": {"max_steps": steps, "precision": "32", "global_batch": 16,
                    "val_batches": 1, "optim": {"max_grad_norm": 1.0}},
    }))


def _capacity_facts(engine: Any, planner: Any, seq_len: int) -> dict[str, Any]:
    """Experts whose capacity the model currently boosts, and the planner's stale ones."""
    boosted = {}
    for layer, moe in engine.model.moe_layers().items():
        scaled = moe.expert_capacities(seq_len)
        if scaled is None:
            continue
        for expert, capacity in enumerate(scaled.tolist()):
            if capacity > moe.capacity(seq_len):
                boosted[f"layers.{layer}.moe.experts.{expert}"] = capacity
    stale = getattr(planner, "stale_experts", lambda: ())()
    return {"boosted": boosted, "stale": list(stale),
            "base_capacity": next(iter(engine.model.moe_layers().values())).capacity(seq_len)}


def _run(settings: RunSettings, scenario: Scenario | None, fail_step: int,
         failed: list[int]) -> dict[str, Any]:
    engine, coords, sampler, shard = _rank_engine(settings)
    rank, world = dist.get_rank(), dist.get_world_size()

    def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sampler.iteration(t, shard)

    checkpointing = injector = None
    if scenario is not None:
        _, policy, options = scenario
        checkpointing = SparseCheckpointing(policy, replicas=2, **options)
        checkpointing.attach(engine, rank=rank, world_size=world)
        events = [{"step": fail_step, "rank": r} for r in failed]
        injector = FailureInjector(AtSchedule(events, world), checkpointing)
        engine.batch = batch
        injector.attach(engine, rank, world)
    losses, after = [], None
    for t in range(settings.max_steps):
        losses.append(float(engine.train_iteration(*batch(t)).loss))
        if t == fail_step and checkpointing is not None:
            assert checkpointing.coordinator is not None
            after = _capacity_facts(engine, checkpointing.coordinator.planner,
                                    settings.data.seq_len)
    if checkpointing is not None:
        checkpointing.close()
    state = gather_consolidated_state(engine, coords, settings.max_steps)
    return {"state": state, "losses": losses, "after": after,
            "failures": 0 if injector is None else injector.counter.total,
            "recoveries": [] if injector is None else injector.recoveries}


def baseline_runs(settings: RunSettings, scenarios: list[Scenario], fail_step: int,
                  failed: list[int]) -> dict[str, dict[str, Any]]:
    """The fault-free run (``"golden"``) and each scenario with ``failed`` failing at
    ``fail_step``; rank 0's view of each."""
    results = {"golden": _run(settings, None, fail_step, failed)}
    for scenario in scenarios:
        results[scenario[0]] = _run(settings, scenario, fail_step, failed)
    return results
