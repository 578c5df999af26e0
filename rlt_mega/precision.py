"""Precision: the names of the dtypes a run computes or stores in, and the context every model
call runs under. One home for what the engines, the sampler and the export share."""

from __future__ import annotations

import contextlib
import math
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


# ---------------------------------------------------------------------- the bf16 copy
# How fp32 master weights become the bf16 copy that the step and the sampler read
# (train.bf16_cast). "nearest": round to nearest even, torch's cast. "stochastic": rounded up
# or down with probabilities that make the copy equal to the master in expectation, so an
# update smaller than half a bf16 step moves the copy as often as it should instead of never.
BF16_CASTS = ("nearest", "stochastic")

_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 22  # elements hashed at a time (bounds the int64 temporaries)


def _signed64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _splitmix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (the key of a cast)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def cast_key(seed: int, step: int) -> int:
    """The key of the stochastic cast that makes the copy of optimizer step ``step`` (the count
    of applied steps, 0 before the first) in a run of ``train.seed`` ``seed``."""
    return _splitmix64(_splitmix64(seed) ^ (step * 0xD1B54A32D192ED03 & _MASK64))


_C1, _C2 = _signed64(0xBF58476D1CE4E5B9), _signed64(0x94D049BB133111EB)


def _hash16(bits: torch.Tensor, key: int) -> torch.Tensor:
    """int64 (n,) in [0, 2^32) -> int64 (n,) uniform in [0, 2^16): splitmix64 of (bits + key).
    Elementwise integer arithmetic (int64 products wrap), identical on every device."""
    z = bits + _signed64(key)
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _C1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _C2
    z = z ^ ((z >> 31) & ((1 << 33) - 1))
    return (z >> 40) & 0xFFFF


def stochastic_bf16(master: torch.Tensor, key: int) -> torch.Tensor:
    """fp32 (any shape) -> bf16 of the same shape, rounded stochastically: the 16 low bits of the
    fp32 pattern decide, against a uniform 16-bit number, whether the magnitude rounds up, so
    P(up) = (low bits) / 2^16 and E[copy] = master exactly. The random number is a hash of
    (the master's own bits, key) rather than a draw from a generator: the copy is a function
    of the master and the step alone, so every rank holding the same weight (tensor- or
    pipeline-replicated weights, data-parallel replicas, any ZeRO partition) makes the same
    copy with no communication, and a resumed run remakes its copy bit for bit. inf stays inf
    (its low bits are 0); the masters of an applied step are finite."""
    if master.dtype != torch.float32:
        raise ValueError(f"the stochastic bf16 cast rounds fp32 masters, got {master.dtype}")
    flat = master.detach().reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.bfloat16, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        bits = flat[start:start + _CHUNK].view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # unsigned pattern
        up = (bits + _hash16(bits, key)) & 0xFFFF0000  # a carry out of the low bits rounds the magnitude up
        up = torch.where(up >= 1 << 31, up - (1 << 32), up).to(torch.int32)
        out[start:start + _CHUNK] = up.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are 0
    return out.view(master.shape)


def bf16_copy(master: torch.Tensor, cast: str, key: int) -> torch.Tensor:
    """The bf16 copy of an fp32 master under train.bf16_cast ``cast`` (``key``: cast_key's)."""
    if cast == "nearest":
        return master.detach().to(torch.bfloat16)
    if cast == "stochastic":
        return stochastic_bf16(master, key)
    raise ValueError(f"train.bf16_cast={cast!r}: expected one of {', '.join(BF16_CASTS)}")


class CopyLag:
    """Sums over one optimizer step's masters and copies (this rank's; reduce them over the
    ranks, then :meth:`metrics`): how many weights the update moved, how many of those kept
    their bf16 copy unchanged (swallowed by the cast), sum (master - copy)^2 after the step
    and sum (update)^2. Add a tensor's (before, after) pair with :meth:`add`."""

    FIELDS = ("moved", "stale", "lag_sq", "update_sq")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.FIELDS, 0.0)

    def add(self, master_before: torch.Tensor, master_after: torch.Tensor, copy_before: torch.Tensor,
            copy_after: torch.Tensor) -> None:
        moved = master_after != master_before
        self.sums["moved"] += float(moved.sum())
        self.sums["stale"] += float((moved & (copy_after == copy_before)).sum())
        self.sums["lag_sq"] += float((master_after.double() - copy_after.double()).square().sum())
        self.sums["update_sq"] += float((master_after.double() - master_before.double()).square().sum())

    def tensor(self, device) -> torch.Tensor:
        return torch.tensor([self.sums[k] for k in self.FIELDS], dtype=torch.float64, device=device)

    @staticmethod
    def metrics(sums: torch.Tensor | list) -> dict[str, float]:
        """precision/stale_fraction: of the weights this step's update moved, the fraction whose
        bf16 copy did not move (the update they received was rounded away); precision/copy_lag:
        ||master - copy|| / ||this step's update|| after the step (how many steps' worth of
        update the copy the sampler reads is behind the masters)."""
        moved, stale, lag_sq, update_sq = (float(x) for x in sums)
        return {"precision/stale_fraction": stale / moved if moved else 0.0,
                "precision/copy_lag": math.sqrt(lag_sq) / math.sqrt(update_sq) if update_sq else 0.0}


def mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """The mean over several optimizer steps' metrics (a GRPO step's updates); {} for none."""
    records = [r for r in records if r]
    if not records:
        return {}
    return {k: sum(r[k] for r in records) / len(records) for k in records[0]}
