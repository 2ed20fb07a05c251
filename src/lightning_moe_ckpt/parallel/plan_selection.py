"""Which plan splits a user's model: the user's ``parallelize_fn`` when given, else the
built-in plan that recognises the model (:mod:`~lightning_moe_ckpt.parallel.hf_plan`)."""

from __future__ import annotations

from torch import nn

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.parallel.hf_plan import hf_decoder_shape, parallelize_hf_decoder
from lightning_moe_ckpt.parallel.model_plans import ModelShape, ParallelizeFn, check_layout


def resolve_plan(model: nn.Module, parallelize_fn: ParallelizeFn | None,
                 ) -> tuple[ParallelizeFn, ModelShape | None]:
    """The plan for ``model``: the user's ``parallelize_fn`` when given, else the built-in
    plan that recognises the model; with the model's shape when the plan knows it."""
    if parallelize_fn is not None:
        return parallelize_fn, None
    shape = hf_decoder_shape(model)
    if shape is None:
        raise ConfigError(
            f"no parallel plan for {type(model).__name__}: the built-in plans cover the "
            "library's model and Hugging Face decoder-only MoE causal LMs (model.layers, "
            "model.embed_tokens, model.norm, lm_head); pass MoEParallelStrategy("
            "parallelize_fn=...) returning a StagedModel for any other model")
    return parallelize_hf_decoder, shape


def check_user_model(model: nn.Module, parallelize_fn: ParallelizeFn | None, *, pp: int,
                     ep: int) -> None:
    """Before launch: ``model`` has a plan, and a built-in plan's model fits the layout."""
    _, shape = resolve_plan(model, parallelize_fn)
    if shape is not None:
        check_layout(shape, pp=pp, ep=ep, what=type(model).__name__)
