"""GPT-style decoder with MoE feed-forward layers, splittable into pipeline stages.

The layers live in an ``nn.ModuleDict`` keyed by their global index (torchtitan's
convention), so a pipeline stage that keeps layers 2..3 still names them ``layers.2``
and ``layers.3``; the embedding and the output head are ``None`` on stages that do not
own them. Parameter names are therefore identical in every parallel layout, which is
what makes operator names and consolidated checkpoints layout-independent.

Initialisation is per parameter from a generator seeded by ``(seed, parameter name)``:
a rank that materialises only part of the model gets exactly the values the full model
would have, with no need to build the full model first.
"""

from __future__ import annotations

import zlib
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe_ckpt.models.config import MoEModelConfig
from lightning_moe_ckpt.models.moe import MoELayer


class Embedding(nn.Module):
    """Token plus learned absolute position embedding (the ``embed`` operator)."""

    def __init__(self, vocab_size: int, d_model: int, max_seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        shape = (batch, seq_len, self.n_heads, d_model // self.n_heads)
        q, k, v = (w(x).view(shape).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, d_model))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + moe(norm(h))``."""

    def __init__(self, cfg: MoEModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.moe = MoELayer(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.expert_hidden,
                            cfg.n_shared_experts, cfg.capacity_factor, cfg.aux_loss_coef)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self.moe(self.ffn_norm(h))


class OutputHead(nn.Module):
    """Final norm and vocabulary projection (the ``head`` operator)."""

    def __init__(self, d_model: int, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d_model, eps=eps)
        self.proj = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def run_blocks(embed: nn.Module | None, layers: nn.ModuleDict, head: nn.Module | None,
               x: torch.Tensor) -> torch.Tensor:
    """Embedding (if present), the layers in key order, the head (if present)."""
    if embed is not None:
        x = embed(x)
    for layer in layers.values():
        x = layer(x)
    if head is not None:
        x = head(x)
    return x


class MoETransformer(nn.Module):
    """Decoder-only MoE language model. ``forward`` maps tokens (or hidden states on a
    non-first pipeline stage) to logits (or hidden states on a non-last stage)."""

    def __init__(self, cfg: MoEModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: Embedding | None = Embedding(cfg.vocab_size, cfg.d_model, cfg.max_seq_len)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.head: OutputHead | None = OutputHead(cfg.d_model, cfg.vocab_size, cfg.norm_eps)
        self.init_weights(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.embed, self.layers, self.head, x)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from a generator keyed by ``(seed, name)``."""
        for name, param in self.named_parameters():
            if param.device.type == "meta":
                continue
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            std = self.cfg.init_std
            if name.endswith(("wo.weight", "w2.weight")):
                # GPT-2 style scaling of residual-branch outputs by depth.
                std = std / (2 * self.cfg.n_layers) ** 0.5
            # Drawn on the CPU (the generator's device) whatever the default device: a
            # model built under Lightning's init_module() on a GPU gets the same weights.
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32,
                                 device="cpu") * std
            param.copy_(values)

    def moe_layers(self) -> dict[int, MoELayer]:
        """The MoE layers present in this (possibly partial) model, by global index."""
        return {int(i): cast(TransformerBlock, layer).moe for i, layer in self.layers.items()}

    def expert_load(self) -> torch.Tensor:
        """Hard counts ``[present layers, E]`` accumulated since the last reset."""
        return torch.stack([moe.gate.hard_counts for moe in self.moe_layers().values()])

    def reset_stats(self) -> None:
        """Zero per-iteration routing telemetry of every MoE layer."""
        for moe in self.moe_layers().values():
            moe.reset_stats()
