"""scikit-learn's 8x8 handwritten digits (1797 images shipped inside the package; no download)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from pdcli.data.source import Examples, in_memory, rng_for

SPLITS = ("train", "test", "all")
SPLIT_SEED = 1797
"""Seed of the fixed train/test split; independent of `data.seed`, so the split never moves."""
MAX_PIXEL = 16.0
SHIPPED_TABLE = Path("datasets") / "data" / "digits.csv.gz"
"""Where inside the scikit-learn package `load_digits` reads its table (64 pixels, then the label, per row)."""


def digits_table() -> tuple[np.ndarray, np.ndarray]:
    """(the 1797 x 64 pixels, the labels) as `sklearn.datasets.load_digits` gives them, read
    from the table scikit-learn ships without importing scikit-learn, which takes a second or
    two in every process that loads the data (each worker of a run); `load_digits` itself
    where the table is not where it ships."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        table_path = Path(root) / SHIPPED_TABLE
        if table_path.is_file():
            table = np.loadtxt(table_path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.asarray(bunch.data), np.asarray(bunch.target)


def digits(flatten: bool = True, split: str = "train", test_fraction: float = 0.2) -> Examples:
    """8x8 digits scaled to [0, 1]: (N, 64) when flatten, else (N, 1, 8, 8); 10 classes."""
    if split not in SPLITS:
        raise ValueError(f"digits split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"digits test_fraction must be in (0, 1), got {test_fraction}")
    pixels, target = digits_table()
    images = np.asarray(pixels, dtype=np.float32) / MAX_PIXEL
    labels = np.asarray(target, dtype=np.int64)
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
