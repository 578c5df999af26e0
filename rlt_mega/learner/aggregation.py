"""How a step's per-token losses become one number (grpo.loss_agg), as verl's ``agg_loss``
names the modes. Each mode is a SUM over a batch's tokens (``loss_sum``) and a COUNT
(``loss_count``); the engine divides the step's summed sums by the step's summed counts over
every batch and every data-parallel rank (rlt_mega/loss.py), so that neither grad_accum nor
the data-parallel layout changes the loss:

    token_mean              sum_{b,t} l / sum_b n_b                      (DAPO; the default)
    seq_mean_token_mean     sum_b (sum_t l / n_b) / num_seqs             (GRPO paper, GSPO)
    seq_mean_token_sum      sum_{b,t} l / num_seqs
    seq_mean_token_sum_norm sum_{b,t} l / (num_seqs * L)                 (Dr.GRPO, L = grpo.loss_agg_length)

n_b: the completion tokens of row b that carry loss; num_seqs: the rows with at least one
(a row the step leaves out, e.g. a truncated completion under grpo.mask_truncated, has none).
verl normalises its sequence means per micro-batch (or with a global batch size it is told);
here the sequence count is the step's own, which is what makes every layout agree.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def _check(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {list(LOSS_AGG_MODES)}")


def loss_sum(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """per_token (B, N), mask (B, N) bool -> the batch's 0-dim share of the step's numerator."""
    _check(mode)
    masked = torch.where(mask, per_token, torch.zeros_like(per_token))
    if mode == "seq_mean_token_mean":
        n = mask.sum(dim=1)  # (B,)
        per_seq = masked.sum(dim=1) / n.clamp(min=1).to(masked.dtype)  # a row without tokens adds 0
        return per_seq.sum()
    return masked.sum()


def loss_count(mask: torch.Tensor, mode: str, length: int = 0) -> float:
    """mask (B, N) bool -> the batch's share of the step's denominator."""
    _check(mode)
    if mode == "token_mean":
        return float(mask.sum())
    num_seqs = float((mask.sum(dim=1) > 0).sum())
    if mode == "seq_mean_token_sum_norm":
        if length < 1:
            raise ValueError("loss aggregation 'seq_mean_token_sum_norm' needs a constant length >= 1 "
                             "(grpo.loss_agg_length)")
        return num_seqs * length
    return num_seqs
