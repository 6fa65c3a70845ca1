"""Synthetic data sets with a learnable signal, so a training loss can fall."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from pdcli.data.batch import Batch
from pdcli.data.source import BATCH_STREAM, FIXED_STREAM, Synthetic, rng_for

BOS_TOKEN = 0
"""synthetic_seq2seq: first token of every decoder input; never a source token."""


def synthetic_images(
    channels: int = 3, image_size: int = 32, num_classes: int = 10, noise_std: float = 1.0
) -> Synthetic:
    """Images (C, H, W) = a fixed random pattern of their class + Gaussian noise; int64 labels."""
    if min(channels, image_size, num_classes) < 1:
        raise ValueError(
            f"synthetic_images needs channels, image_size, num_classes >= 1; "
            f"got {channels}, {image_size}, {num_classes}"
        )
    shape = (channels, image_size, image_size)

    @lru_cache(maxsize=2)
    def patterns(seed: int) -> np.ndarray:
        return rng_for(seed, FIXED_STREAM).standard_normal((num_classes, *shape), dtype=np.float32)

    def draw_labels(seed: int, index: int, batch_size: int, stream: int) -> tuple[np.random.Generator, np.ndarray]:
        """The batch's generator and its labels, drawn first so a target-only batch stops here."""
        rng = rng_for(seed, stream, index)
        return rng, rng.integers(0, num_classes, size=batch_size)

    def make_batch(seed: int, index: int, batch_size: int, stream: int = BATCH_STREAM) -> Batch:
        rng, labels = draw_labels(seed, index, batch_size, stream)
        noise = rng.standard_normal((batch_size, *shape), dtype=np.float32)
        images = patterns(seed)[labels] + np.float32(noise_std) * noise
        return Batch(inputs=(torch.from_numpy(images),), target=torch.from_numpy(labels))

    def make_target(seed: int, index: int, batch_size: int, stream: int = BATCH_STREAM) -> torch.Tensor:
        return torch.from_numpy(draw_labels(seed, index, batch_size, stream)[1])

    return Synthetic(
        make_batch,
        f"synthetic_images: {channels}x{image_size}x{image_size} float32 images, "
        f"{num_classes} classes (class pattern + noise std {noise_std})",
        make_target,
    )


def synthetic_tokens(
    vocab_size: int = 256, seq_len: int = 64, max_step: int = 3, noise_prob: float = 0.05
) -> Synthetic:
    """LM token streams x[t+1] = x[t] + d (mod vocab), d in 1..max_step per sequence, some noise.

    inputs = tokens[:-1], target = tokens[1:], both int64 (batch, seq_len).
    """
    if vocab_size < 2 or seq_len < 1 or not 1 <= max_step < vocab_size or not 0 <= noise_prob <= 1:
        raise ValueError(
            f"synthetic_tokens needs vocab_size >= 2, seq_len >= 1, 1 <= max_step < vocab_size, "
            f"0 <= noise_prob <= 1; got {vocab_size}, {seq_len}, {max_step}, {noise_prob}"
        )

    def make_batch(seed: int, index: int, batch_size: int, stream: int = BATCH_STREAM) -> Batch:
        rng = rng_for(seed, stream, index)
        start = rng.integers(0, vocab_size, size=(batch_size, 1))
        step = rng.integers(1, max_step + 1, size=(batch_size, 1))
        tokens = (start + step * np.arange(seq_len + 1)) % vocab_size
        noisy = rng.random(tokens.shape) < noise_prob
        tokens = np.where(noisy, rng.integers(0, vocab_size, size=tokens.shape), tokens)
        tokens_t = torch.from_numpy(tokens.astype(np.int64))
        return Batch(inputs=(tokens_t[:, :-1].contiguous(),), target=tokens_t[:, 1:].contiguous())

    return Synthetic(
        make_batch,
        f"synthetic_tokens: {seq_len} tokens of vocab {vocab_size}, x[t+1] = x[t] + d "
        f"(d <= {max_step}), noise {noise_prob}",
    )


def synthetic_seq2seq(vocab_size: int = 64, seq_len: int = 16, reverse: bool = True) -> Synthetic:
    """Translate a random source into its reversal (or a copy); token 0 is BOS.

    inputs = (src, tgt_in = [BOS] + tgt[:-1]), target = tgt; all int64 (batch, seq_len).
    """
    if vocab_size < 2 or seq_len < 1:
        raise ValueError(
            f"synthetic_seq2seq needs vocab_size >= 2, seq_len >= 1; got {vocab_size}, {seq_len}"
        )

    def make_batch(seed: int, index: int, batch_size: int, stream: int = BATCH_STREAM) -> Batch:
        rng = rng_for(seed, stream, index)
        src = torch.from_numpy(rng.integers(BOS_TOKEN + 1, vocab_size, size=(batch_size, seq_len)))
        tgt = src.flip(1) if reverse else src.clone()
        bos = torch.full((batch_size, 1), BOS_TOKEN, dtype=torch.int64)
        tgt_in = torch.cat([bos, tgt[:, :-1]], dim=1)
        return Batch(inputs=(src, tgt_in), target=tgt)

    return Synthetic(
        make_batch,
        f"synthetic_seq2seq: {seq_len} tokens of vocab {vocab_size} -> "
        f"{'reversed' if reverse else 'copied'} (BOS={BOS_TOKEN})",
    )
