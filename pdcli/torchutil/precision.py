"""`train.precision` as torch runs it: autocast to bf16 or fp16, nothing for fp32."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The context a forward runs in at `precision` on `device_type` (`cpu`, `cuda`)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[precision])
