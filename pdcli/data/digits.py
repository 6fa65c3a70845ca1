"""scikit-learn's 8x8 handwritten digits (1797 images shipped inside the package; no download)."""

from __future__ import annotations

import numpy as np
import torch

from pdcli.data.source import Examples, in_memory, rng_for

SPLITS = ("train", "test", "all")
SPLIT_SEED = 1797
"""Seed of the fixed train/test split; independent of `data.seed`, so the split never moves."""
MAX_PIXEL = 16.0


def digits(flatten: bool = True, split: str = "train", test_fraction: float = 0.2) -> Examples:
    """8x8 digits scaled to [0, 1]: (N, 64) when flatten, else (N, 1, 8, 8); 10 classes."""
    from sklearn.datasets import load_digits  # imported here: scikit-learn is slow to import

    if split not in SPLITS:
        raise ValueError(f"digits split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"digits test_fraction must be in (0, 1), got {test_fraction}")
    bunch = load_digits()
    images = np.asarray(bunch.data, dtype=np.float32) / MAX_PIXEL
    labels = np.asarray(bunch.target, dtype=np.int64)
    order = rng_for(SPLIT_SEED, 0).permutation(len(labels))
    num_test = int(round(test_fraction * len(labels)))
    if split == "test":
        order = order[:num_test]
    elif split == "train":
        order = order[num_test:]
    inputs = torch.from_numpy(images[order])
    if not flatten:
        inputs = inputs.reshape(-1, 1, 8, 8)
    shape = "64 features" if flatten else "1x8x8 images"
    return in_memory(
        inputs=(inputs,),
        target=torch.from_numpy(labels[order]),
        description=f"digits ({split} split): {shape} in [0, 1], 10 classes",
    )
