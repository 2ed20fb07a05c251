"""Tiny MoE models and a plain LightningModule for the any-model test suite.

The suite checks that sparse checkpointing works on a user's *own* MoE model, trained by an
ordinary ``LightningModule`` that knows nothing about the library. So the models here deliberately
cover the layouts a real user brings:

* ``qwen3_moe`` / ``mixtral``: Hugging Face models; in transformers 5.x their experts are *fused*
  3-D parameters (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) and
  the router is ``mlp.gate.weight`` [E, H].
* ``modulelist_moe``: experts as an ``nn.ModuleList`` of small MLPs with the author's own names
  (``blocks.<i>.moe.experts.<e>.up.weight``, ``blocks.<i>.moe.router.weight``).
* ``grouped_experts_moe``: torchtitan-style grouped experts (``layers.<i>.moe.experts.w1``
  [E, F, D]) in an ``nn.ModuleDict`` with a ``router.gate`` Linear.

Every model is tiny (vocab 64, hidden 32, 2 layers, 8 experts, top-2), deterministic on CPU and
needs no download. ``logits_of`` hides the HF ``ModelOutput`` vs plain-tensor difference.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

VOCAB = 64
HIDDEN = 32
N_LAYERS = 2
N_EXPERTS = 8
TOP_K = 2
EXPERT_FF = 16


# --------------------------------------------------------------------------------------------
# Hugging Face models
# --------------------------------------------------------------------------------------------


def qwen3_moe(seed: int = 0, experts_implementation: str = "eager") -> nn.Module:
    """A freshly initialised tiny ``Qwen3MoeForCausalLM``.

    ``experts_implementation="eager"`` pins the reference per-expert loop: transformers 5.x
    otherwise picks ``"grouped_mm"`` whenever torch supports it (it does on CPU with torch 2.13),
    and the suite should not depend on which kernel the installed versions happen to select.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=EXPERT_FF,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=64,
        output_router_logits=False,
        tie_word_embeddings=False,
        # No KV cache: training only, and a cache object in the output is dead weight.
        use_cache=False,
        # Eager attention: SDPA may pick different CPU kernels across versions/threads.
        attn_implementation="eager",
        experts_implementation=experts_implementation,
    )
    torch.manual_seed(seed)  # HF initialises weights from the global RNG
    return Qwen3MoeForCausalLM(config)


def mixtral(seed: int = 0, experts_implementation: str = "eager") -> nn.Module:
    """A freshly initialised tiny ``MixtralForCausalLM``.

    transformers 5.x layout (per layer ``i``), the same fused layout as Qwen3-MoE but with the
    router *before* the experts in registration order and no q/k norms::

        model.layers.i.self_attn.{q,o}_proj.weight [32, 32], {k,v}_proj.weight [16, 32]
        model.layers.i.mlp.gate.weight             [8, 32]        (router, no bias)
        model.layers.i.mlp.experts.gate_up_proj    [8, 32, 32]    [E, 2*I, H]
        model.layers.i.mlp.experts.down_proj       [8, 32, 16]    [E, H, I]
        model.layers.i.{input,post_attention}_layernorm.weight [32]
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=EXPERT_FF,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=64,
        output_router_logits=False,
        tie_word_embeddings=False,
        # Jitter noise would draw from the RNG inside forward; keep it off (the default).
        router_jitter_noise=0.0,
        use_cache=False,
        attn_implementation="eager",
        experts_implementation=experts_implementation,
    )
    torch.manual_seed(seed)
    return MixtralForCausalLM(config)


# --------------------------------------------------------------------------------------------
# Hand-written model 1: experts as an nn.ModuleList, the author's own parameter names
# --------------------------------------------------------------------------------------------


class ExpertMLP(nn.Module):
    """One expert: ``down(gelu(up(x)))``."""

    def __init__(self, dim: int, ff: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, ff)
        self.down = nn.Linear(ff, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class ModuleListMoE(nn.Module):
    """Top-k softmax router over an ``nn.ModuleList`` of experts.

    Only routed tokens reach an expert, so an expert that gets no token in a step has
    ``grad is None`` -- the genuinely sparse case that per-expert checkpointing must handle.
    """

    def __init__(self, dim: int, ff: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(dim, ff) for _ in range(n_experts))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat), dim=-1)
        # Weights are the softmax probabilities themselves, so the router gets a gradient.
        weights, chosen = probs.topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.reshape(shape)


class BiasBalancedMoE(ModuleListMoE):
    """DeepSeek-V3-style balancing without an auxiliary loss: a per-expert bias, a buffer
    of the router updated in ``forward`` (never by the optimizer), shifts the top-k
    choice toward experts that got fewer tokens; a token counter buffer counts along."""

    def __init__(self, dim: int, ff: int, n_experts: int, top_k: int) -> None:
        super().__init__(dim, ff, n_experts, top_k)
        self.router.register_buffer("expert_bias", torch.zeros(n_experts))
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat), dim=-1)
        bias = self.router.get_buffer("expert_bias")
        chosen = (probs.detach() + bias).topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        if self.training:
            with torch.no_grad():
                load = torch.bincount(chosen.flatten(), minlength=len(self.experts)).float()
                bias += 1e-2 * torch.sign(load.mean() - load)
                self.tokens_seen += flat.shape[0]
        return out.reshape(shape)


class MixBlock(nn.Module):
    """Pre-norm block: a per-token Linear mixer (no attention needed), then the MoE."""

    def __init__(self, dim: int, ff: int, n_experts: int, top_k: int,
                 moe: type[ModuleListMoE] = ModuleListMoE) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.moe = moe(dim, ff, n_experts, top_k)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.moe(self.norm2(x))


class ModuleListLM(nn.Module):
    """``input_ids`` [B, S] -> logits [B, S, V]."""

    def __init__(
        self,
        vocab: int = VOCAB,
        dim: int = HIDDEN,
        n_layers: int = N_LAYERS,
        ff: int = EXPERT_FF,
        n_experts: int = N_EXPERTS,
        top_k: int = TOP_K,
        moe: type[ModuleListMoE] = ModuleListMoE,
        embed_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.embed_dropout = embed_dropout
        self.tok_emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MixBlock(dim, ff, n_experts, top_k, moe)
                                    for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(dim)
        self.lm_out = nn.Linear(dim, vocab)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.tok_emb(input_ids)
        if self.embed_dropout:  # only then does training draw from the global RNG
            x = F.dropout(x, p=self.embed_dropout, training=self.training)
        for block in self.blocks:
            x = block(x)
        return self.lm_out(self.final_norm(x))


def modulelist_moe(seed: int = 0) -> nn.Module:
    """A freshly initialised :class:`ModuleListLM`."""
    torch.manual_seed(seed)
    return ModuleListLM()


def dropout_moe(seed: int = 0) -> nn.Module:
    """:class:`ModuleListLM` with dropout after the embedding: training draws from the
    global RNG, so only a resume from the same RNG state repeats it."""
    torch.manual_seed(seed)
    return ModuleListLM(embed_dropout=0.1)


def bias_balanced_moe(seed: int = 0) -> nn.Module:
    """:class:`ModuleListLM` with :class:`BiasBalancedMoE` layers (state in buffers)."""
    torch.manual_seed(seed)
    return ModuleListLM(moe=BiasBalancedMoE)


# --------------------------------------------------------------------------------------------
# Hand-written model 2: torchtitan-style grouped experts in an nn.ModuleDict
# --------------------------------------------------------------------------------------------


class TokenChoiceTopKRouter(nn.Module):
    """torchtitan-style router: ``gate`` Linear, softmax, top-k.

    Returns ``(top_scores [N, k] float, selected_experts [N, k] int64,
    num_tokens_per_expert [E] int64)`` -- a third output convention next to HF's
    ``(logits, scores, indices)``, for routing telemetry to cope with.
    """

    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        scores = F.softmax(self.gate(x).float(), dim=-1)
        top_scores, selected = scores.topk(self.top_k, dim=-1)
        # bincount rather than torchtitan's histc: exact integer counts, deterministic on CPU.
        counts = torch.bincount(selected.flatten(), minlength=self.n_experts)
        return top_scores, selected, counts


class GroupedExperts(nn.Module):
    """SwiGLU experts stored as three stacked parameters, like torchtitan's ``GroupedExperts``.

    Unlike the ModuleList model, every expert tensor gets a (possibly all-zero) gradient
    because the parameters are shared tensors sliced per expert.
    """

    def __init__(self, dim: int, ff: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, ff, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ff))
        self.w3 = nn.Parameter(torch.empty(n_experts, ff, dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: Tensor, selected: Tensor, scores: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            token, slot = (selected == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            h = x[token]
            h = F.silu(h @ self.w1[e].T) * (h @ self.w3[e].T)
            out.index_add_(0, token, (h @ self.w2[e].T) * scores[token, slot, None].to(x.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, dim: int, ff: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = TokenChoiceTopKRouter(dim, n_experts, top_k)
        self.experts = GroupedExperts(dim, ff, n_experts)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores, selected, _ = self.router(flat)
        return self.experts(flat, selected, scores).reshape(shape)


class Attention(nn.Module):
    """A stand-in for attention: causal running mean of ``wq(x)``, projected by ``wo``.

    Causal mixing via a lower-triangular matmul (not cumsum) keeps it a real sequence model
    while staying deterministic under ``torch.use_deterministic_algorithms(True)``.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        s = x.shape[1]
        mix = torch.tril(torch.ones(s, s, dtype=x.dtype, device=x.device))
        mix = mix / mix.sum(dim=-1, keepdim=True)
        return self.wo(mix @ self.wq(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, ff: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.moe = MoE(dim, ff, n_experts, top_k)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.ffn_norm(x))


class GroupedExpertsLM(nn.Module):
    """``input_ids`` [B, S] -> logits [B, S, V]; layers in a ModuleDict keyed "0", "1", ..."""

    def __init__(
        self,
        vocab: int = VOCAB,
        dim: int = HIDDEN,
        n_layers: int = N_LAYERS,
        ff: int = EXPERT_FF,
        n_experts: int = N_EXPERTS,
        top_k: int = TOP_K,
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(dim, ff, n_experts, top_k) for i in range(n_layers)}
        )
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.tok_embeddings(input_ids)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))


def grouped_experts_moe(seed: int = 0) -> nn.Module:
    """A freshly initialised :class:`GroupedExpertsLM`."""
    torch.manual_seed(seed)
    return GroupedExpertsLM()


# Name -> builder, for ``pytest.mark.parametrize`` over all four layouts.
BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "qwen3_moe": qwen3_moe,
    "mixtral": mixtral,
    "modulelist_moe": modulelist_moe,
    "grouped_experts_moe": grouped_experts_moe,
}


# --------------------------------------------------------------------------------------------
# Forward / loss helpers, LightningModule, data, a Fabric-friendly step
# --------------------------------------------------------------------------------------------


def logits_of(model: nn.Module, input_ids: Tensor) -> Tensor:
    """Logits [B, S, V] from any of the models (also when wrapped by Fabric or LMModule).

    HF models return a ``ModelOutput`` with ``.logits``; the hand-written ones a tensor.
    """
    out = model(input_ids=input_ids)
    return out if isinstance(out, Tensor) else out.logits


def lm_loss(model: nn.Module, input_ids: Tensor) -> Tensor:
    """Next-token cross-entropy: position ``t`` predicts token ``t + 1``."""
    logits = logits_of(model, input_ids)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)
    )


class LMModule(L.LightningModule):
    """A plain user LightningModule around any of the models above.

    It knows nothing about sparse checkpointing; that is the point of the any-model suite.
    ``clip_val`` applies in manual mode only; in automatic mode pass ``gradient_clip_val`` to
    the Trainer as a user would.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-2,
        manual: bool = False,
        clip_val: float | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.manual = manual
        self.clip_val = clip_val
        # Detached per-step losses, so tests can compare trajectories across runs/resumes.
        self.losses: list[Tensor] = []
        if manual:
            self.automatic_optimization = False

    def forward(self, input_ids: Tensor) -> Tensor:
        return logits_of(self.model, input_ids)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = lm_loss(self.model, batch["input_ids"])
        self.losses.append(loss.detach().clone())
        if self.manual:
            opt = self.optimizers()
            assert not isinstance(opt, list)  # exactly one optimizer
            opt.zero_grad()
            self.manual_backward(loss)
            if self.clip_val:
                self.clip_gradients(
                    opt, gradient_clip_val=self.clip_val, gradient_clip_algorithm="norm"
                )
            opt.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


class _TokenDataset(Dataset[dict[str, Tensor]]):
    """Rows of a fixed token tensor as ``{"input_ids": [S]}`` (default collate stacks them)."""

    def __init__(self, tokens: Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.tokens[index]}


def random_token_loader(
    n_batches: int = 12, batch_size: int = 2, seq_len: int = 16, vocab: int = VOCAB, seed: int = 0
) -> DataLoader[dict[str, Tensor]]:
    """``n_batches`` batches of seeded random tokens, ``{"input_ids": [batch_size, seq_len]}``.

    Tokens come from a private generator so building a loader never touches the global RNG,
    and ``shuffle=False`` so batch ``i`` is the same in every run and after a resume.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n_batches * batch_size, seq_len), generator=generator)
    return DataLoader(_TokenDataset(tokens), batch_size=batch_size, shuffle=False)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Tensor],
    backward: Callable[[Tensor], object] | None = None,
) -> Tensor:
    """One plain iteration; returns the detached loss.

    Pass ``backward=fabric.backward`` from a Fabric loop (Fabric requires it for precision and
    strategy hooks); without it ``loss.backward()`` is used.
    """
    loss = lm_loss(model, batch["input_ids"])
    if backward is None:
        loss.backward()
    else:
        backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()
