"""The built-in plan for Hugging Face decoder-only MoE causal LMs (transformers 5.x).

Qwen3-MoE, Mixtral, OLMoE and DeepSeek-V3 share one shape: ``model.embed_tokens``,
``model.layers`` (a ``ModuleList`` of decoder layers), ``model.norm``,
``model.rotary_emb`` and ``lm_head``, with each MoE layer's routed experts fused in a
module named ``experts`` (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``).

The plan prunes the model in place: ``model.layers`` becomes a ``ModuleDict`` of this
rank's layers under their global index (so ``model.layers.3.mlp.gate.weight`` keeps its
name), the embedding lives only on the first stage, the final norm and ``lm_head`` only on
the last; every ``experts`` module is sharded over ``ep``. With a ``dp_shard`` mesh
dimension above 1 the embedding, every decoder layer, the final norm and ``lm_head`` are
then each ``fully_shard``-ed over it (FSDP2). :class:`HFDecoderStage` runs a
stage exactly as the model's own forward runs those layers: the same causal mask, rotary
position embeddings and per-layer call.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.parallel.fsdp import shard_units
from lightning_moe_ckpt.parallel.fused_experts import expert_count, shard_fused_experts
from lightning_moe_ckpt.parallel.model_plans import (
    ModelShape,
    StagedModel,
    check_layout,
    mesh_position,
    stage_layer_ids,
)


def _decoder(model: nn.Module) -> nn.Module | None:
    """``model.model`` when ``model`` has the decoder-only causal LM shape, else None."""
    inner = model._modules.get("model")
    if inner is None or not isinstance(model._modules.get("lm_head"), nn.Linear):
        return None
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(isinstance(inner._modules.get(p), nn.Module) for p in parts):
        return None
    return inner if isinstance(inner._modules["layers"], nn.ModuleList) else None


def _fused_experts_modules(root: nn.Module) -> list[nn.Module]:
    return [module for path, module in root.named_modules()
            if path.split(".")[-1] == "experts" and not isinstance(module, nn.ModuleList)]


def hf_decoder_shape(model: nn.Module) -> ModelShape | None:
    """Layers and experts per MoE layer of a Hugging Face decoder-only MoE, or None when
    ``model`` does not have that shape."""
    inner = _decoder(model)
    if inner is None:
        return None
    experts = _fused_experts_modules(inner)
    counts = {expert_count(module) for module in experts}
    if len(counts) != 1:
        return None
    return ModelShape(len(cast(nn.ModuleList, inner.layers)), counts.pop())


class HFDecoderStage(nn.Module):
    """A contiguous block of decoder layers of a (pruned) HF causal LM, plus the embedding
    on the first stage and the final norm and ``lm_head`` on the last."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool,
                 last: bool) -> None:
        super().__init__()
        inner = cast(Any, model).model
        self.config = cast(Any, model).config
        self.embed: nn.Module | None = inner.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): inner.layers[str(i)] for i in layer_ids})
        self.rotary = inner.rotary_emb
        self.norm: nn.Module | None = inner.norm if last else None
        self.head: nn.Module | None = cast(Any, model).lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        hidden = self.embed(x) if self.embed is not None else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        sliding = getattr(self.config, "sliding_window", None) is not None
        mask_function = create_sliding_window_causal_mask if sliding else create_causal_mask
        mask = mask_function(config=self.config, inputs_embeds=hidden, attention_mask=None,
                             past_key_values=None, position_ids=position_ids)
        position_embeddings = self.rotary(hidden, position_ids=position_ids)
        for layer in self.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids,
                           position_embeddings=position_embeddings)
        if self.norm is not None and self.head is not None:
            hidden = self.head(self.norm(hidden))
        return hidden


def parallelize_hf_decoder(model: nn.Module, mesh: DeviceMesh) -> StagedModel:
    """Prune ``model`` to this rank's stage and experts (see the module docstring)."""
    shape = hf_decoder_shape(model)
    if shape is None:
        raise TypeError(f"{type(model).__name__} is not a Hugging Face decoder-only MoE "
                        "causal LM")
    pp, ep = mesh["pp"].size(), mesh["ep"].size()
    check_layout(shape, pp=pp, ep=ep, what=type(model).__name__)
    pp_rank, _, _ = mesh_position(mesh)
    lm = cast(Any, model)
    inner = lm.model
    owned = stage_layer_ids(shape.n_layers, pp, pp_rank)
    inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in owned})
    first, last = pp_rank == 0, pp_rank == pp - 1
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = None
        lm.lm_head = None
    if ep > 1:
        group = mesh.get_group("ep")
        for experts in _fused_experts_modules(inner):
            shard = shard_fused_experts(experts, group)
            # HF's expert loop one-hots over ``num_experts``: the shard's count now.
            cast(Any, shard).num_experts = shard.local_experts
    if mesh["dp_shard"].size() > 1:
        head = lm.lm_head
        if first and last and head is not None and head.weight is inner.embed_tokens.weight:
            raise ConfigError(
                f"{type(model).__name__} ties lm_head to the embedding "
                "(tie_word_embeddings=True), which parallel.dp_shard cannot shard as two "
                "units; untie them, or use parallel.dp")
        shard_units([inner.embed_tokens, *inner.layers.values(), inner.norm, head],
                    mesh["dp_shard"])
    config = lm.config
    return StagedModel(model, [HFDecoderStage(model, owned, first, last)],
                       hidden_size=int(config.hidden_size), output_size=int(config.vocab_size))
