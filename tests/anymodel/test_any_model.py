"""A user's own MoE model, optimizer and loop: sparse checkpoints and bitwise recovery.

Each case is a plain LightningModule around the user's model, ``torch.optim.AdamW``, a
standard DataLoader of seeded random tokens, ``L.Trainer(accelerator="cpu", devices=1)``,
``SparseCheckpointing("moevement", window=3)`` and a ``FailureInjector`` failing rank 0
mid-window. After the failure every parameter, optimizer-state tensor and loss equals the
fault-free run bitwise, the injector fired, snapshots were sparse and the replay activated
operators snapshot by snapshot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_moe_ckpt.callbacks import SparseCheckpointing
from lightning_moe_ckpt.core.operators import expert_position
from lightning_moe_ckpt.recovery.durable import RNG_KEY
from tests.anymodel.harness import FAIL_AT, WINDOW, Run, assert_bitwise, fit
from tests.anymodel.models import (
    BUILDERS,
    LMModule,
    ModuleListLM,
    ModuleListMoE,
    bias_balanced_moe,
    dropout_moe,
    grouped_experts_moe,
    mixtral,
    modulelist_moe,
    qwen3_moe,
    random_token_loader,
)


def _assert_recovered_sparsely(reference: Run, failed: Run, user_frozen: int = 0) -> None:
    """``user_frozen``: operators the user froze, frozen throughout."""
    assert failed.injector is not None and failed.injector.counter.total == 1
    (recovery,) = failed.injector.recoveries
    assert recovery["failed_step"] == FAIL_AT
    assert recovery["window_start"] == FAIL_AT - FAIL_AT % WINDOW - WINDOW  # the persisted one
    assert recovery["window"] == WINDOW
    assert_bitwise(reference, failed, FAIL_AT)
    # Sparse: an iteration's snapshot holds master state for only part of the operators.
    assert 0 < failed.metrics["snapshot_bytes_per_iter"] < failed.metrics["dense_state_bytes"]
    # Conversion: frozen operators become active snapshot by snapshot, then all replay.
    frozen = failed.spy.frozen_during_replay
    assert len(frozen) == recovery["iterations_replayed"] == WINDOW
    assert frozen[0] > frozen[1] > user_frozen and frozen[-1] == user_frozen


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_user_model_recovers_bitwise(name: str) -> None:
    builder = BUILDERS[name]
    options = {"top_k": 2} if name == "modulelist_moe" else {}  # its router returns logits
    reference = fit(builder, **options)
    failed = fit(builder, FAIL_AT, **options)
    _assert_recovered_sparsely(reference, failed)
    assert failed.metrics["routing_telemetry"] == "router hooks"


def _qwen3_moe_frozen_routers(seed: int = 0) -> torch.nn.Module:
    """Fine-tuning with the routers frozen by the user (``requires_grad_(False)``)."""
    model = qwen3_moe(seed=seed)
    for name, param in model.named_parameters():
        if ".mlp.gate." in name:
            param.requires_grad_(False)
    return model


def test_parameters_the_user_froze_stay_frozen_through_recovery() -> None:
    reference = fit(_qwen3_moe_frozen_routers)
    failed = fit(_qwen3_moe_frozen_routers, FAIL_AT)
    routers = [name for name in failed.params if ".mlp.gate." in name]
    _assert_recovered_sparsely(reference, failed, user_frozen=len(routers))
    assert routers and not set(routers) & set(failed.optimizer_state)  # never trained
    registry = failed.checkpointing.target.registry
    for name in routers:  # the replay froze and activated them; the user's choice stands
        operator = next(op for op in registry if any(n == name for n, _ in op.params))
        assert all(not param.requires_grad for _, param in operator.params)


def test_buffers_the_model_updates_in_training_recover_bitwise() -> None:
    """A load-balancing bias and a token counter kept as buffers (no optimizer touches
    them) are snapshotted with their operators and restored exactly."""
    reference = fit(bias_balanced_moe, top_k=2)
    failed = fit(bias_balanced_moe, FAIL_AT, top_k=2)
    _assert_recovered_sparsely(reference, failed)  # buffers compared bitwise too
    biases = [name for name in failed.buffers if name.endswith("router.expert_bias")]
    assert biases and all(bool(reference.buffers[name].abs().sum() > 0) for name in biases)
    registry = failed.checkpointing.target.registry
    held = {buffer.name: op.name for op in registry for buffer in op.buffers}
    assert held["model.blocks.0.moe.router.expert_bias"] == "model.blocks.0.moe.router"
    assert held["model.blocks.0.moe.tokens_seen"] == "model.blocks.0.attn"


class _CurriculumModule(LMModule):
    """A loss weighted by ``self.global_step`` and ``self.current_epoch`` (a curriculum,
    an annealed auxiliary term): replay must see the counters of the step it reruns."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * (1 + 0.1 * self.global_step) * (1 + 0.5 * self.current_epoch)


def test_replay_sees_the_global_step_and_epoch_it_reruns() -> None:
    """Five batches an epoch: the replayed window (steps 4..6) crosses from epoch 0 into
    epoch 1, and the failure strikes in epoch 1 at step 7."""
    options: dict[str, Any] = {"module_type": _CurriculumModule, "batches_per_epoch": 5}
    reference = fit(modulelist_moe, top_k=2, **options)
    failed = fit(modulelist_moe, FAIL_AT, top_k=2, **options)
    _assert_recovered_sparsely(reference, failed)


class _StepHookBalancedMoE(ModuleListMoE):
    """torchtitan's load balancing: ``forward`` counts tokens per expert in a buffer; an
    optimizer step pre-hook moves the bias by them and clears the counts. Under
    Lightning's closure the pre-hook runs before its iteration's forward, so the counts
    carry over from one iteration to the next: they are state, in a persistent buffer."""

    def __init__(self, dim: int, ff: int, n_experts: int, top_k: int) -> None:
        super().__init__(dim, ff, n_experts, top_k)
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1)
        chosen = (probs.detach() + self.get_buffer("expert_bias")).topk(self.top_k).indices
        weights = probs.gather(-1, chosen)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        with torch.no_grad():
            self.get_buffer("tokens_per_expert").add_(
                torch.bincount(chosen.flatten(), minlength=len(self.experts)).float())
        return out.reshape(x.shape)

    @torch.no_grad()
    def update_bias(self) -> None:
        counts = self.get_buffer("tokens_per_expert")
        self.get_buffer("expert_bias").add_(1e-2 * torch.sign(counts.mean() - counts))
        counts.zero_()


class _StepHookBalancedModule(LMModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizers()
        layers = [m for m in self.modules() if isinstance(m, _StepHookBalancedMoE)]

        def update_biases(*_: Any) -> None:
            for layer in layers:
                layer.update_bias()

        optimizer.register_step_pre_hook(update_biases)
        return optimizer


def _step_hook_balanced_moe(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ModuleListLM(moe=_StepHookBalancedMoE)


def test_buffers_an_optimizer_step_hook_updates_recover_bitwise() -> None:
    reference = fit(_step_hook_balanced_moe, top_k=2, module_type=_StepHookBalancedModule)
    failed = fit(_step_hook_balanced_moe, FAIL_AT, top_k=2,
                 module_type=_StepHookBalancedModule)
    _assert_recovered_sparsely(reference, failed)  # buffers compared bitwise too
    biases = [name for name in failed.buffers if name.endswith("expert_bias")]
    assert biases and all(bool(reference.buffers[name].abs().sum() > 0) for name in biases)


def test_manual_optimization_recovers_bitwise() -> None:
    reference = fit(qwen3_moe, manual=True)
    failed = fit(qwen3_moe, FAIL_AT, manual=True)
    _assert_recovered_sparsely(reference, failed)


def test_bf16_mixed_precision_recovers_bitwise() -> None:
    reference = fit(qwen3_moe, precision="bf16-mixed")
    failed = fit(qwen3_moe, FAIL_AT, precision="bf16-mixed")
    _assert_recovered_sparsely(reference, failed)


@pytest.mark.parametrize("manual", [False, True])
def test_gradient_clipping_replays_the_logged_coefficient(manual: bool) -> None:
    reference = fit(qwen3_moe, clip=0.05, manual=manual)
    failed = fit(qwen3_moe, FAIL_AT, clip=0.05, manual=manual)
    _assert_recovered_sparsely(reference, failed)
    # The conversion replays (operators frozen) applied logged coefficients below one.
    assert failed.spy.clip_during_replay
    assert min(failed.spy.clip_during_replay) < 1.0


@pytest.mark.parametrize("builder", [qwen3_moe, mixtral])
def test_hf_models_have_one_operator_per_expert(builder: object) -> None:
    run = fit(builder, steps=1)  # type: ignore[arg-type]
    names = run.checkpointing.operator_names()
    experts = [n for n in names if expert_position(n) is not None]
    assert len(experts) == 16  # 2 layers x 8 experts, from fused [E, ...] tensors
    expected = {(layer, e) for layer in range(2) for e in range(8)}
    assert {expert_position(n) for n in experts} == expected


def test_torchtitan_style_grouped_experts_are_sliced() -> None:
    run = fit(grouped_experts_moe, steps=1)
    target = run.checkpointing.target
    assert target is not None
    expert = target.registry["model.layers.1.moe.experts.5"]
    assert sorted(p.key for p in expert.parts) == [
        f"model.layers.1.moe.experts.{w}[5]" for w in ("w1", "w2", "w3")]
    assert "model.layers.0.moe.router" in target.registry  # not swallowed by the block


def test_operator_names_before_training_is_an_error() -> None:
    from lightning_moe_ckpt.callbacks import SparseCheckpointing

    with pytest.raises(RuntimeError, match="once training started"):
        SparseCheckpointing("moevement").operator_names()


def test_snapshot_bytes_are_measured_from_the_optimizer() -> None:
    run = fit(qwen3_moe, steps=2)
    params = sum(p.numel() for p in run.params.values())
    # fp32 AdamW: weight 4 + master 4 (the weight itself) + moments 8 per element, and a
    # 4-byte step per parameter, which each of the 8 expert slices of a fused tensor
    # carries (2 layers x gate_up_proj/down_proj): measured, not assumed.
    fused = [n for n in run.params if n.endswith(("gate_up_proj", "down_proj"))]
    assert len(fused) == 4
    steps = len(run.params) + (8 - 1) * len(fused)
    assert run.metrics["dense_state_bytes"] == params * (4 + 4 + 8) + 4 * steps
    assert torch.tensor(run.metrics["snapshot_bytes_per_iter"]) > 0


def _dropout_fit(steps: int, durable_dir: Path, ckpt_path: str | None = None
                 ) -> tuple[dict[str, torch.Tensor], SparseCheckpointing]:
    torch.manual_seed(1)  # the RNG dropout draws from, as a user's script seeds it
    module = LMModule(dropout_moe(seed=0))
    checkpointing = SparseCheckpointing("moevement", window=3, top_k=2, durable_every=1,
                                        durable_dir=str(durable_dir), durable_keep=10)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpointing])
    trainer.fit(module, random_token_loader(n_batches=4), ckpt_path=ckpt_path)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, checkpointing


def test_a_durable_checkpoint_resumes_a_dropout_model_bitwise(tmp_path: Path) -> None:
    """The durable checkpoint carries the RNG: a plain ckpt_path resume at an epoch
    boundary (4 batches an epoch) draws the same dropout masks as the run it came from."""
    reference, checkpointing = _dropout_fit(10, tmp_path / "a")
    boundary = next(p for p in checkpointing.durable.committed()
                    if p.endswith("step=4.ckpt"))
    assert RNG_KEY in torch.load(boundary, weights_only=False)
    torch.manual_seed(12345)  # whatever the RNG holds before the resume
    resumed, _ = _dropout_fit(10, tmp_path / "b", ckpt_path=boundary)
    for name, value in reference.items():
        assert torch.equal(value, resumed[name]), name
