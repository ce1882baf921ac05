"""The small GPT-style model the demo trains (see :mod:`lightning_datastates.demo`)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (batch, time, dim) -> same shape."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    """A small GPT: token and position embeddings, pre-LN blocks, LM head tied to the token embedding, AdamW."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one storage, two state_dict entries

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, time) -> logits (batch, time, vocab)."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Next-token cross-entropy on a (batch, seq_len + 1) block of token ids."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW, so the optimizer state is twice the parameters, as in LLM training."""
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)
