"""Off-policy correction of a stale sample (grpo.is_correction), on exact ratios.

A sample learned s steps after it was drawn has three policies: the behaviour mu (the
sampler's recorded log-probs, version k - s), the proximal policy pi_old (the learner's
parameters at the start of step k, by replay: bit for bit the values the sampler would have
recorded with them) and the current pi_theta. As verl's ``rollout_corr`` (decoupled PPO,
AReaL's proximal policy) does, the clipped or GSPO loss takes its ratio against pi_old, and
the staleness is corrected by a detached per-token weight w of the behaviour ratio
rho = pi_old / mu:

    none          no proximal policy: the ratio is against mu, w = 1 (today's GRPO)
    token_tis     w = min(rho, grpo.is_cap) per token (truncated IS; verl rollout_is="token"
                  with a single threshold; the log-ratio clamped to +-20 first, as verl does)
    token_mask    w = 1 where grpo.is_band_low <= rho <= grpo.is_band_high, else 0 (verl's
                  rejection sampling rollout_rs="token_k1", the band given as 1/high_1/low
                  because verl's k1 is log(mu / pi_old))
    seq_mask      w = 1 for a whole row whose geometric-mean ratio exp(mean_t log rho) lies in
                  the band, else 0 for the row (verl rollout_rs="seq_mean_k1")

Departure from verl's rejection sampling: a rejected token keeps its place in the loss's
normaliser (weight 0), as IcePop's zero weights do in verl, because the step's count is taken on
every rank before the loss and only the loss rank holds pi_old (under pipeline parallelism).

Because mu is the exact behaviour log-prob and pi_old the exact replay, rho measures the policy
change since the sample was drawn and nothing else: at staleness 0, pi_old is mu bit for bit,
rho is exactly 1 and every variant is the identity (the trainer then skips the proximal replay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IS_CORRECTIONS = ("none", "token_tis", "token_mask", "seq_mask")
SAFETY_BOUND = 20.0  # verl's clamp of a log-ratio before exp


@dataclass(frozen=True)
class Correction:
    mode: str = "none"
    cap: float = 2.0  # token_tis
    band_low: float = 0.5  # token_mask, seq_mask
    band_high: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in IS_CORRECTIONS:
            raise ValueError(f"unknown off-policy correction {self.mode!r}; choose one of {list(IS_CORRECTIONS)}")


def is_weights(proximal: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, correction: Correction) -> torch.Tensor:
    """proximal, mu (B, N) log-probs (proximal may be -inf: a token outside the proximal
    policy's top-k/top-p set), mask (B, N) bool -> detached weights (B, N), 0 off the mask.
    A token with proximal = -inf has rho = 0: weight 0 under every variant (token_mask and
    seq_mask reject it; a row holding one has a geometric mean of 0)."""
    mask = mask.bool()
    zeros = torch.zeros_like(mu)
    log_rho = torch.where(mask, proximal - mu, zeros).detach()  # -inf where proximal is
    mode = correction.mode
    if mode == "none":
        return mask.to(mu.dtype)
    if mode == "token_tis":
        w = torch.exp(log_rho.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)).clamp(max=correction.cap)
        w = torch.where(torch.isneginf(log_rho), zeros, w)
        return torch.where(mask, w, zeros)
    lo, hi = torch.log(torch.tensor(correction.band_low, dtype=torch.float64)), \
        torch.log(torch.tensor(correction.band_high, dtype=torch.float64))
    if mode == "token_mask":
        lr = log_rho.double()
        keep = (lr >= lo) & (lr <= hi)
    else:  # seq_mask
        n = mask.sum(dim=1, keepdim=True).clamp(min=1).double()  # (B, 1)
        mean = log_rho.double().sum(dim=1, keepdim=True) / n  # (B, 1): log of the geometric-mean ratio
        keep = ((mean >= lo) & (mean <= hi)).expand_as(mask)
    return (keep & mask).to(mu.dtype)


def ratio_by_version(ratio: torch.Tensor, mask: torch.Tensor, version: torch.Tensor) -> dict[int, dict[str, float]]:
    """ratio (B, N) the loss's ratio, mask (B, N) the tokens that carry loss, version (B, N) the
    policy version that drew each token (partial rollouts switch inside a row) -> per version
    present: the token count and the ratio's sum, min and max (reduce, then divide)."""
    mask = mask.bool()
    out = {}
    for v in torch.unique(version[mask]).tolist():
        r = ratio[mask & (version == v)]
        out[int(v)] = {"n": float(r.numel()), "sum": float(r.sum()), "min": float(r.min()), "max": float(r.max())}
    return out
