"""Model configuration: the shape of an MoE transformer, validated before anything is built.

A :class:`MoEModelConfig` is what the Hydra ``model`` group holds (``conf/model/*.yaml``).
Validation happens in ``__post_init__`` so a bad preset or override fails with a
:class:`~lightning_moe_ckpt.errors.ConfigError` naming the ``model.*`` key and value
before any process, tensor or data loader exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_moe_ckpt.errors import ConfigError, fmt, is_number, require

MODEL_FAMILIES = ("builtin", "hf_qwen3_moe")


@dataclass(frozen=True)
class MoEModelConfig:
    """Shape and routing hyper-parameters of a GPT-style decoder with MoE feed-forward layers.

    ``expert_hidden`` is each routed expert's SwiGLU hidden size; ``n_shared_experts``
    DeepSeek-style always-on experts share that hidden size. ``capacity_factor=None``
    means no capacity limit (no token is ever dropped).
    """

    name: str = "tiny"
    # builtin: the library's MoETransformer; hf_qwen3_moe: a Hugging Face Qwen3-MoE of
    # this shape (randomly initialised from its config, no download)
    family: str = "builtin"
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128
    n_shared_experts: int = 0
    capacity_factor: float | None = None
    max_seq_len: int = 64
    aux_loss_coef: float = 0.01
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        require(self.family in MODEL_FAMILIES,
                f"model.family={self.family!r} is unknown; choose one of "
                f"{', '.join(MODEL_FAMILIES)}")
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "top_k",
                    "expert_hidden", "max_seq_len"):
            value = getattr(self, key)
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                    f"{fmt('model.' + key, value)} must be a positive integer")
        require(isinstance(self.n_shared_experts, int)
                and not isinstance(self.n_shared_experts, bool) and self.n_shared_experts >= 0,
                f"{fmt('model.n_shared_experts', self.n_shared_experts)} must be an integer "
                ">= 0")
        for key in ("norm_eps", "init_std"):  # a negative one trains on (NaN loss, exit 0)
            value = getattr(self, key)
            require(is_number(value) and value > 0,
                    f"{fmt('model.' + key, value)} must be a number > 0")
        require(self.top_k <= self.n_experts,
                f"model.top_k={self.top_k} must be <= model.n_experts={self.n_experts}")
        require(self.d_model % self.n_heads == 0,
                f"model.d_model={self.d_model} must be divisible by "
                f"model.n_heads={self.n_heads}")
        if self.capacity_factor is not None:
            require(is_number(self.capacity_factor) and self.capacity_factor > 0,
                    f"{fmt('model.capacity_factor', self.capacity_factor)} must be > 0 "
                    "(or null for no capacity limit)")
        require(is_number(self.aux_loss_coef) and self.aux_loss_coef >= 0,
                f"{fmt('model.aux_loss_coef', self.aux_loss_coef)} must be a number >= 0")
        if self.family == "hf_qwen3_moe":  # what the Hugging Face model cannot honour
            for key, value, supported in (
                    ("n_shared_experts", self.n_shared_experts, 0),
                    ("capacity_factor", self.capacity_factor, None),
                    ("aux_loss_coef", self.aux_loss_coef, 0)):
                require(value == supported,
                        f"{fmt('model.' + key, value)} is not supported with "
                        f"model.family={self.family!r}: Qwen3-MoE has no shared experts, "
                        "no expert capacity, and the recipe trains it on the language-model "
                        f"loss alone; set it to {supported if supported is not None else 'null'}")

    @property
    def head_dim(self) -> int:
        """Per-head width of the attention."""
        return self.d_model // self.n_heads

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> MoEModelConfig:
        """Build from a plain mapping (e.g. a resolved Hydra node); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown model config key(s) {', '.join('model.' + k for k in unknown)}; "
                f"known keys: {', '.join(sorted(known))}"
            )
        return cls(**dict(values))
