"""A small GPT-style language model (decoder-only transformer), in the shape of nanoGPT.

Small enough to train on two CPU cores in a couple of minutes; big enough (layers, attention,
LayerNorm, a tied embedding) that gradient synchronisation has real work to do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.testing.parallel import ContextParallel


@dataclass
class GPTConfig:
    vocab_size: int = 64
    """Number of distinct tokens (characters for the built-in corpus)."""
    block_size: int = 64
    """Longest sequence the model attends over."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    """Dropout draws random masks per rank: keep 0.0 where runs must match exactly."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.head_dim = cfg.n_embd // cfg.n_head
        # Rows of the fused projection are head-major (head, {q, k, v}, head_dim): a
        # column-parallel split of its rows gives each tensor-parallel rank whole heads, with
        # their queries, keys and values. No bias: the key bias has a gradient of exactly zero
        # (softmax ignores a constant added to every score of a query), so it would only carry
        # rounding noise, which Adam scales up to full-size steps of random sign.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.context_parallel: ContextParallel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        # The heads this rank holds (all of them without tensor parallelism), counted from the
        # projection's width, not with -1: a micro-batch of no sample has no elements to infer
        # it from.
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).unbind(3)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if self.context_parallel is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:  # this rank holds one chunk of each sequence: attend over all earlier chunks
            cp = self.context_parallel
            k, v = cp.gather(k), cp.gather(v)
            mask = cp.causal_mask(t, x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying: one parameter, two uses
        self.context_parallel: ContextParallel | None = None
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's scaled init of residual projections keeps activations from growing.
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, time, vocab) for token ids ``idx`` of shape (batch, time)."""
        t = idx.shape[1]
        start = 0 if self.context_parallel is None else self.context_parallel.start(t)
        if start + t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(start, start + t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy; targets equal to -1 (padding) are ignored."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=-1,
        reduction=reduction,
    )


def enable_context_parallel(model: GPT, cp: ContextParallel) -> None:
    """Make ``model`` take one chunk of each sequence (chunk ``cp.rank`` of ``cp.size``)."""
    model.context_parallel = cp
    for block in model.blocks:
        assert isinstance(block, Block)
        block.attn.context_parallel = cp
