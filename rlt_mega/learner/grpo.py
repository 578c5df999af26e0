"""The GRPO loss of a batch (docs/design.md, "GRPO"): a policy loss (learner/policy_loss.py:
the clipped surrogate against the behavior log-probs mu, with DAPO's clip-higher and
dual-clip, or GSPO's sequence ratio), an optional KL to a frozen reference
(learner/kl.py: k1, k2, k3) and an optional entropy bonus, aggregated by grpo.loss_agg
(learner/aggregation.py). The loss is a SUM over the batch and ``loss_count`` its share of
the normaliser: the engine divides the step's sum by the step's global count (every batch of
the optimizer step, every data-parallel rank; rlt_mega/loss.py), so gradient accumulation
and data parallelism do not change the objective. Advantages: learner/advantages.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# Re-exported: callers (the trainer, the tests) import the GRPO pieces from here.
from rlt_mega.learner.advantages import ADVANTAGE_ESTIMATORS, group_advantages, register_advantage  # noqa: F401
from rlt_mega.learner.aggregation import loss_sum
from rlt_mega.learner.kl import k3_kl, kl_estimate  # noqa: F401
from rlt_mega.learner.policy_loss import ClipRange, policy_loss


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: the sum over this batch's completion tokens
    metrics: dict[str, torch.Tensor]  # sums over this minibatch's tokens (reduce, then divide)
    ratio: Optional[torch.Tensor] = None  # (B, N) the policy loss's ratio, detached (metrics by token)


def grpo_loss(logp: torch.Tensor, mu: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              eps_low: float = 0.2, eps_high: float = 0.2, ref_logp: Optional[torch.Tensor] = None,
              kl_coef: float = 0.0, *, loss: str = "clip", clip_ratio_c: Optional[float] = None,
              kl_estimator: str = "k3", loss_agg: str = "token_mean", entropy: Optional[torch.Tensor] = None,
              entropy_coef: float = 0.0, is_weights: Optional[torch.Tensor] = None) -> LossOutput:
    """The policy loss (+ kl_coef * KL to the reference - entropy_coef * entropy), aggregated.

    logp (B, N): the policy's log-probs (the hybrid: value = replay, gradient = dense);
    mu (B, N): behavior log-probs; advantages (B,); mask (B, N) the completion tokens that
    carry loss (a row the step leaves out has none); entropy (B, N): the policy's token
    entropy under the rollout's processing (with grad, for the bonus). ``loss`` names the
    policy loss, eps_low / eps_high its clip range (GSPO's own narrow one under "gspo").
    is_weights (B, N), detached: the off-policy correction's weights of the policy loss
    (learner/correction.py; mu is then the proximal policy's log-probs, which may be -inf:
    such a token counts as a support miss).
    The loss is ``aggregation.loss_sum`` of the per-token losses; whoever accumulates the step
    divides it by the step's global ``loss_count`` (the engines do, rlt_mega/loss.py).

    A token with logp = -inf (outside the policy's top-k/top-p set) has ratio 0 as docs/design.md
    says: its surrogate carries no gradient; it is excluded from the KL and entropy terms and
    counted in ``support_miss``.
    """
    if ref_logp is None and kl_coef:
        raise ValueError("kl_coef is set but no reference log-probs were given")
    mask = mask.bool()
    miss = mask & (torch.isneginf(logp) | torch.isneginf(mu))
    # Replace -inf (and whatever sits in padding) before any arithmetic, so that neither the
    # value nor the gradient ever sees inf - inf.
    invalid = miss | ~mask
    safe_logp = torch.where(invalid, torch.zeros_like(logp), logp)
    safe_mu = torch.where(invalid, torch.zeros_like(mu), mu)
    if clip_ratio_c is not None and loss != "clip":
        raise ValueError(f"clip_ratio_c is the dual clip of the 'clip' policy loss, not of {loss!r}")
    clip = ClipRange(eps_low, eps_high, clip_ratio_c)
    per_token, ratio, is_clipped = policy_loss(loss)(safe_logp, safe_mu, miss, advantages, mask, clip)  # (B, N)
    if is_weights is not None:
        per_token = per_token * is_weights  # the policy term only (verl weights pg_losses alone)
    valid = mask & ~miss
    zeros = torch.zeros_like(safe_logp)
    kl = zeros
    if ref_logp is not None and kl_coef:
        kl = torch.where(valid, kl_estimate(safe_logp, torch.where(valid, ref_logp, zeros), kl_estimator), zeros)
        per_token = per_token + kl_coef * kl
    ent = zeros if entropy is None else torch.where(valid, entropy, zeros)
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * ent
    out = loss_sum(per_token, mask, loss_agg)

    r = ratio.detach()
    return LossOutput(loss=out, metrics=_loss_metrics(r, mask, is_clipped, miss, kl, ent), ratio=r)


@torch.no_grad()
def _loss_metrics(r: torch.Tensor, mask: torch.Tensor, is_clipped: torch.Tensor, miss: torch.Tensor,
                  kl: torch.Tensor, ent: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the batch's completion tokens (the caller reduces, then divides)."""
    return {
        "num_tokens": mask.sum().float(),
        "ratio_sum": r[mask].sum(),
        "ratio_min": r[mask].min() if mask.any() else torch.tensor(1.0),
        "ratio_max": r[mask].max() if mask.any() else torch.tensor(1.0),
        "clipped": (is_clipped & mask).sum().float(),
        "support_miss": miss.sum().float(),
        "kl_sum": kl.detach()[mask].sum(),
        "entropy_sum": ent.detach()[mask].sum(),
    }
