"""GNMT: LSTM encoder-decoder with attention and residual connections (Wu et al. 2016)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

# As in GNMT, layers from the third on (index 2, counting the first layer) add a residual.
FIRST_RESIDUAL_LAYER = 2


class Attention(nn.Module):
    """Scaled 'general' (Luong) attention: softmax(W q . k / sqrt(h)) v over the source.

    GNMT uses additive attention; the bilinear form has the same role and does not build
    a (batch, tgt, src, hidden) tensor. No mask: the data's sequences have no padding.
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.scale = 1.0 / math.sqrt(hidden)

    def forward(self, queries: Tensor, keys: Tensor) -> Tensor:
        scores = torch.bmm(self.query(queries), keys.transpose(1, 2)) * self.scale
        return torch.bmm(torch.softmax(scores, dim=-1), keys)


class Encoder(nn.Module):
    """Embedding, a bidirectional LSTM layer, then unidirectional layers with residuals."""

    def __init__(self, vocab_size: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.bidirectional = nn.LSTM(hidden, hidden // 2, batch_first=True, bidirectional=True)
        self.layers = nn.ModuleList(
            [nn.LSTM(hidden, hidden, batch_first=True) for _ in range(num_layers - 1)]
        )

    def forward(self, src_tokens: Tensor) -> Tensor:
        x = self.bidirectional(self.embedding(src_tokens))[0]
        for layer_id, lstm in enumerate(self.layers, start=1):
            out = lstm(x)[0]
            x = x + out if layer_id >= FIRST_RESIDUAL_LAYER else out
        return x


class Decoder(nn.Module):
    """Embedding, a first LSTM whose output attends the source, then LSTMs fed [x, context]."""

    def __init__(self, vocab_size: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.first = nn.LSTM(hidden, hidden, batch_first=True)
        self.attention = Attention(hidden)
        self.layers = nn.ModuleList(
            [nn.LSTM(2 * hidden, hidden, batch_first=True) for _ in range(num_layers - 1)]
        )
        self.classifier = nn.Linear(hidden, vocab_size)

    def forward(self, tgt_input_tokens: Tensor, encoded: Tensor) -> Tensor:
        x = self.first(self.embedding(tgt_input_tokens))[0]
        context = self.attention(x, encoded)
        for layer_id, lstm in enumerate(self.layers, start=1):
            out = lstm(torch.cat([x, context], dim=-1))[0]
            x = x + out if layer_id >= FIRST_RESIDUAL_LAYER else out
        return self.classifier(x)


class GNMT(nn.Module):
    """(src_tokens, tgt_input_tokens) -> logits (batch, tgt_len, vocab), teacher forcing."""

    def __init__(self, vocab_size: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.encoder = Encoder(vocab_size, hidden, num_layers)
        self.decoder = Decoder(vocab_size, hidden, num_layers)

    def forward(self, src_tokens: Tensor, tgt_input_tokens: Tensor) -> Tensor:
        return self.decoder(tgt_input_tokens, self.encoder(src_tokens))


def gnmt(vocab_size: int = 32000, hidden: int = 1024, num_layers: int = 4) -> GNMT:
    """GNMT: `num_layers` LSTM layers each in encoder and decoder (4 = GNMT-8), attention."""
    if hidden % 2:
        raise ValueError(f"gnmt hidden must be even (bidirectional first layer), got {hidden}")
    if num_layers < 1:
        raise ValueError(f"gnmt needs num_layers >= 1, got {num_layers}")
    return GNMT(vocab_size, hidden, num_layers)
