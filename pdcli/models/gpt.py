"""A decoder-only transformer language model (GPT-2 layout, pre-LayerNorm, untied head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one qkv projection, SDPA, output projection."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"gpt dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        # unflatten/flatten instead of view(B, T, ...) keeps the graph free of shape values.
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, num_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embedding, `num_layers` blocks, final LayerNorm, Linear LM head."""

    def __init__(
        self, vocab_size: int, max_seq_len: int, dim: int, num_layers: int, num_heads: int, mlp_ratio: int
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(max_seq_len, dim)
        self.blocks = nn.Sequential(*[Block(dim, num_heads, mlp_ratio) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(dim)
        # Not tied to token_embedding: the pipeline puts first and last layer on different stages.
        self.head = nn.Linear(dim, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        return self.head(self.ln_f(self.blocks(x)))


def gpt(
    vocab_size: int = 50257,
    max_seq_len: int = 1024,
    dim: int = 768,
    num_layers: int = 12,
    num_heads: int = 12,
    mlp_ratio: int = 4,
) -> GPT:
    """GPT LM: tokens (batch, seq) -> logits (batch, seq, vocab); defaults are GPT-2 small."""
    return GPT(vocab_size, max_seq_len, dim, num_layers, num_heads, mlp_ratio)
