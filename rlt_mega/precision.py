"""Precision: the names of the dtypes a run computes or stores in, and the context every model
call runs under. One home for what the engines, the sampler and the export share."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

# What training, sampling and replay compute in (train.dtype).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Half-precision dtypes: computed in fp32 where rounding would accumulate (norms, gradient sums).
LOW_PRECISION = (torch.float16, torch.bfloat16)
# What an export may store (``rlt-mega export --dtype``), with the long names as aliases.
STORAGE_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                  "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def precision(dtype: str, device: torch.device | str):
    """The context model calls run under: nothing for fp32, autocast for bf16 over fp32
    parameters (the head's logits are fp32 either way)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=DTYPES[dtype])


def parse_storage_dtype(dtype: Optional[str | torch.dtype]) -> Optional[torch.dtype]:
    """None / "auto" (keep as stored), a torch dtype, or one of fp32, bf16, fp16."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected auto, fp32, bf16 or fp16")
    return STORAGE_DTYPES[dtype]
