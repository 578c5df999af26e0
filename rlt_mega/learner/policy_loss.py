"""Policy losses, per token, as a registry (variants multiply). Each takes the policy's
log-probs logp (B, N) and the behavior log-probs mu (B, N), with -inf (support misses) and
padding already replaced by 0 in both, ``miss`` (B, N) the support misses, advantages (B,)
and mask (B, N); it returns the per-token loss (B, N), the ratio it used (B, N) and where the
clipping acted (B, N, no gradient there).

- ``clip``: PPO's clipped surrogate with DAPO's asymmetric range [1 - eps_low, 1 + eps_high]
  and, when clip_ratio_c is set, dual-clip (Ye et al. 2020): for A < 0 the loss is bounded
  by -A * clip_ratio_c, so a huge ratio on a bad token cannot take an unbounded step.
- ``gspo``: GSPO (Zheng et al. 2025): one ratio per sequence, exp(mean_t log(pi / mu)), the
  length-normalised sequence likelihood ratio, clipped to its own, much narrower range
  (grpo.gspo_eps_low / gspo_eps_high; the paper uses 3e-4 / 4e-4). Per token it is written
  as verl writes it, s_i * pi_t / sg(pi_t), so that each token's gradient is s_i * A_i *
  grad log pi_t / |y_i| once aggregated with seq_mean_token_mean.

Either way an on-policy ratio is exactly 1: logp == mu bit for bit gives exp(0) = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class ClipRange:
    eps_low: float = 0.2
    eps_high: float = 0.2
    clip_ratio_c: Optional[float] = None  # dual-clip bound (> 1) for negative advantages; None: off


PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ClipRange],
                        tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn
    return wrap


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, clip: ClipRange
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r) A), then the dual clip for A < 0 -> (per-token loss, clipped mask)."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip.eps_low, 1.0 + clip.eps_high)
    loss = torch.maximum(unclipped, clipped)
    r = ratio.detach()
    # Clipped where max picks the constant clipped branch (zero gradient).
    is_clipped = ((r < 1.0 - clip.eps_low) & (adv < 0)) | ((r > 1.0 + clip.eps_high) & (adv > 0))
    if clip.clip_ratio_c is not None:
        bound = -adv * clip.clip_ratio_c  # (B, 1): a constant, no gradient
        dual = (adv < 0) & (loss.detach() > bound)
        loss = torch.where(dual, bound.expand_as(loss), loss)
        is_clipped = is_clipped | dual
    return loss, is_clipped


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    """(B,) one advantage per row, or (B, N) one per token (learner/distill.py) -> broadcastable to (B, N)."""
    return advantages if advantages.dim() == 2 else advantages[:, None]


@register_policy_loss("clip")
def clip_loss(logp, mu, miss, advantages, mask, clip: ClipRange):
    # A support miss has ratio 0: its loss min(0, (1 - eps_low) A) is a constant.
    ratio = torch.where(miss, torch.zeros_like(logp), torch.exp(logp - mu))  # (B, N)
    adv = _per_token(advantages).to(ratio.dtype)
    loss, is_clipped = _clipped_objective(ratio, adv, clip)
    return loss, ratio, is_clipped


@register_policy_loss("gspo")
def gspo_loss(logp, mu, miss, advantages, mask, clip: ClipRange):
    n = mask.sum(dim=1, keepdim=True).clamp(min=1).to(logp.dtype)  # (B, 1)
    log_ratio = torch.where(mask, logp - mu, torch.zeros_like(logp))
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / n  # (B, 1): log of the length-normalised ratio
    # verl clamps the log-ratio at 10 before exp; a sequence with a support miss has ratio 0.
    per_token = logp - logp.detach() + seq_log_ratio.detach()  # value: the sequence's; gradient: the token's
    ratio = torch.exp(torch.clamp(per_token, max=10.0))
    ratio = torch.where(miss.any(dim=1, keepdim=True), torch.zeros_like(ratio), ratio)
    adv = _per_token(advantages).to(ratio.dtype)
    loss, is_clipped = _clipped_objective(ratio, adv, clip)
    return loss, ratio, is_clipped


def policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]
