"""Token losses. Normalisation is explicit: every loss here is a SUM over tokens, and the
caller divides by the global number of loss tokens (all micro-batches, all data-parallel
ranks), so gradient accumulation and data parallelism do not change the objective."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # target id that carries no loss (padding, prompt tokens in SFT)


def shift(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed window (B, T + 1) -> inputs (B, T), targets (B, T)."""
    return window[:, :-1], window[:, 1:]


def count_tokens(targets: torch.Tensor) -> int:
    return int((targets != IGNORE).sum())


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V) fp32, targets (B, T) -> summed cross-entropy over non-ignored tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
