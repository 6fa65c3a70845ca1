"""User data from files: tensors (`.pt`, `.npy`, `.npz`) and binary token streams."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pdcli.data.batch import Batch
from pdcli.data.source import Examples, in_memory
from pdcli.errors import UserError

TENSOR_SUFFIXES = (".pt", ".npy", ".npz")
TOKEN_DTYPES = ("uint16", "int32", "uint32", "int64")
INPUTS_KEY = "inputs"
TARGET_KEY = "target"


def _existing(path: str, key: str) -> Path:
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise UserError(
            f"{key}: file not found: {resolved}",
            hint=f"set {key} to an existing file (relative paths start at the current directory)",
        )
    return resolved


def _as_tensor(value: Any, where: str) -> Tensor:
    tensor = torch.from_numpy(np.asarray(value)) if isinstance(value, np.ndarray) else value
    if not isinstance(tensor, Tensor):
        raise UserError(f"{where}: expected a tensor or array, found {type(value).__name__}")
    if tensor.is_floating_point():
        return tensor.float()  # models are float32; float64 files would not match them
    if tensor.dtype in (torch.int8, torch.int16, torch.int32, torch.uint8):
        return tensor.long()  # class indices / token ids must be int64 for the losses
    return tensor


def _load(path: Path, key: str) -> Any:
    if path.suffix not in TENSOR_SUFFIXES:
        raise UserError(f"{key}: {path} is not one of {', '.join(TENSOR_SUFFIXES)}")
    try:
        if path.suffix == ".pt":
            return torch.load(path, map_location="cpu", weights_only=True)
        loaded = np.load(path, allow_pickle=False)
        return dict(loaded) if path.suffix == ".npz" else loaded
    except Exception as exc:  # any parse failure of a user file is a user problem
        raise UserError(f"{key}: cannot read {path}: {exc}") from exc


def tensor_file(path: str = "", target_path: str | None = None) -> Examples:
    """Tensors from files: `path` holds {inputs, target} (.pt dict, .npz), or inputs + `target_path`."""
    if not path:
        raise UserError("data.kwargs.path: tensor_file needs a path", hint="e.g. data.kwargs.path=train.pt")
    inputs_file = _existing(path, "data.kwargs.path")
    loaded = _load(inputs_file, "data.kwargs.path")
    if target_path is None:
        if not isinstance(loaded, dict) or INPUTS_KEY not in loaded or TARGET_KEY not in loaded:
            raise UserError(
                f"data.kwargs.path: {inputs_file} must hold a dict with keys "
                f"{INPUTS_KEY!r} and {TARGET_KEY!r}",
                hint="or give the inputs in data.kwargs.path and the targets in data.kwargs.target_path",
            )
        raw_inputs, raw_target = loaded[INPUTS_KEY], loaded[TARGET_KEY]
        target_file = inputs_file
    else:
        target_file = _existing(target_path, "data.kwargs.target_path")
        raw_inputs, raw_target = loaded, _load(target_file, "data.kwargs.target_path")
    many = isinstance(raw_inputs, (list, tuple))
    inputs = tuple(_as_tensor(t, "data.kwargs.path") for t in (raw_inputs if many else [raw_inputs]))
    target = _as_tensor(raw_target, "data.kwargs.target_path" if target_path else "data.kwargs.path")
    counts = [int(t.size(0)) if t.dim() else 0 for t in (*inputs, target)]
    if len(set(counts)) != 1 or counts[0] == 0:
        raise UserError(
            f"data.kwargs.path: inputs and target must have the same number of examples "
            f"(dim 0) and at least one; got {counts}"
        )
    shapes = ", ".join(f"{tuple(t.shape[1:])} {t.dtype}" for t in inputs)
    return in_memory(
        inputs=inputs,
        target=target,
        description=f"tensor_file {inputs_file.name}: inputs {shapes}; target "
        f"{tuple(target.shape[1:])} {target.dtype} from {target_file.name}",
    )


def token_file(path: str = "", seq_len: int = 128, dtype: str = "uint16") -> Examples:
    """Windows of seq_len+1 tokens from a flat binary token file (numpy memmap); target = shift by 1."""
    if not path:
        raise UserError("data.kwargs.path: token_file needs a path", hint="e.g. data.kwargs.path=train.bin")
    if dtype not in TOKEN_DTYPES:
        raise UserError(f"data.kwargs.dtype: {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    if seq_len < 1:
        raise UserError(f"data.kwargs.seq_len: must be >= 1, got {seq_len}")
    token_path = _existing(path, "data.kwargs.path")
    itemsize = np.dtype(dtype).itemsize
    size_bytes = token_path.stat().st_size
    if size_bytes % itemsize:
        raise UserError(
            f"data.kwargs.dtype: {token_path} has {size_bytes} bytes, not a multiple of "
            f"{itemsize} ({dtype}); is the dtype right?"
        )
    num_tokens = size_bytes // itemsize
    num_windows = (num_tokens - 1) // seq_len if num_tokens else 0
    if num_windows < 1:
        raise UserError(
            f"data.kwargs.seq_len: {token_path} has {num_tokens} tokens, fewer than "
            f"seq_len + 1 = {seq_len + 1}"
        )
    tokens = np.memmap(token_path, dtype=dtype, mode="r", shape=(num_tokens,))
    offsets = np.arange(seq_len + 1)

    def take(rows: Tensor) -> Batch:
        # Only the rows' windows are read from disk. Window k covers tokens
        # [k*seq_len, (k+1)*seq_len]: neighbours share one token.
        positions = rows.numpy()[:, None] * seq_len + offsets
        windows = torch.from_numpy(tokens[positions].astype(np.int64))
        return Batch(inputs=(windows[:, :-1].contiguous(),), target=windows[:, 1:].contiguous())

    return Examples(
        num_examples=num_windows,
        take=take,
        description=f"token_file {token_path.name}: {num_tokens} {dtype} tokens in windows of {seq_len}",
    )
