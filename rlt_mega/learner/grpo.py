"""GRPO advantages and the clipped policy loss (docs/design.md, "GRPO").

Advantage estimators live in a small registry (variants multiply: GRPO, Dr.GRPO, ...).
The loss is the PPO clipped surrogate against the behavior log-probs mu, with separate
lower/upper clip ranges (DAPO's clip-higher) and an optional k3 KL to a frozen reference. It
is the SUM over the batch's completion tokens: the engine divides the step's sum by the
global count of completion tokens (every batch of the optimizer step, every data-parallel
rank; rlt_mega/loss.py), so gradient accumulation and data parallelism do not change the
objective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

AdvantageFn = Callable[[torch.Tensor, float], torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return wrap


@register_advantage("grpo")
def _grpo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """(r - mean) / (std + eps) per group; std with Bessel's correction, as DeepSeekMath's
    GRPO and TRL compute it. A group of equal rewards gets 0 (0 / eps), never NaN."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return (rewards - mean) / (std + eps)


@register_advantage("dr_grpo")
def _dr_grpo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """Dr.GRPO: r - mean, without the std normalisation that reweights easy/hard groups."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo",
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards (num_groups * G,), the G completions of a prompt contiguous -> advantages of
    the same shape (one per completion, shared by its tokens)."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of "
                         f"{sorted(ADVANTAGE_ESTIMATORS)}")
    if group_size < 2:
        raise ValueError(f"group size G={group_size}: group advantages need G >= 2 completions per prompt")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)  # (num_groups, G)
    return ADVANTAGE_ESTIMATORS[estimator](groups, eps).reshape(-1)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: the sum over this batch's completion tokens
    metrics: dict[str, torch.Tensor]  # sums over this minibatch's tokens (reduce, then divide)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi || ref) per token, exp(ref - logp) - (ref - logp) - 1 >= 0.
    The log-ratio is clamped to [-20, 20] and the result to <= 10 as verl's ``low_var_kl``
    does: a token the reference gives (almost) no mass would otherwise be inf."""
    log_ratio = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.expm1(log_ratio) - log_ratio, max=10.0)


def grpo_loss(logp: torch.Tensor, mu: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              eps_low: float = 0.2, eps_high: float = 0.2, ref_logp: Optional[torch.Tensor] = None,
              kl_coef: float = 0.0) -> LossOutput:
    """PPO clipped surrogate (+ kl_coef * k3 KL to the reference), token-level.

    logp (B, N): the policy's log-probs (the hybrid: value = replay, gradient = dense);
    mu (B, N): behavior log-probs; advantages (B,); mask (B, N) completion tokens. The loss
    is the sum over the masked tokens; whoever accumulates the step divides it by the step's
    global token count (the engines do, rlt_mega/loss.py).

    A token with logp = -inf (outside the policy's top-k/top-p set) has ratio 0 as docs/design.md
    says: its surrogate min(0, (1 - eps_low) * A) carries no gradient; it is excluded from
    the KL term (log(0) there) and counted in ``support_miss``.
    """
    if ref_logp is None and kl_coef:
        raise ValueError("kl_coef is set but no reference log-probs were given")
    mask = mask.bool()
    miss = mask & torch.isneginf(logp)
    # Replace -inf (and whatever sits in padding) before any arithmetic, so that neither the
    # value nor the gradient ever sees inf - inf.
    invalid = miss | ~mask
    safe_logp = torch.where(invalid, torch.zeros_like(logp), logp)
    safe_mu = torch.where(invalid, torch.zeros_like(mu), mu)
    ratio = torch.where(miss, torch.zeros_like(safe_logp), torch.exp(safe_logp - safe_mu))  # (B, N)
    adv = advantages[:, None].to(ratio.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if ref_logp is not None and kl_coef:
        kl = torch.where(mask & ~miss, k3_kl(safe_logp, ref_logp), torch.zeros_like(safe_logp))
        per_token = per_token + kl_coef * kl
    else:
        kl = torch.zeros_like(safe_logp)
    # A sum over this batch's tokens: the engine divides by the global count (module docstring).
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum()

    with torch.no_grad():
        r = ratio.detach()
        # Clipped where the min picks the constant clipped branch (zero gradient).
        is_clipped = mask & (((r < 1.0 - eps_low) & (adv < 0)) | ((r > 1.0 + eps_high) & (adv > 0)))
        metrics = {
            "num_tokens": mask.sum().float(),
            "ratio_sum": r[mask].sum(),
            "ratio_min": r[mask].min() if mask.any() else torch.tensor(1.0),
            "ratio_max": r[mask].max() if mask.any() else torch.tensor(1.0),
            "clipped": is_clipped.sum().float(),
            "support_miss": miss.sum().float(),
            "kl_sum": kl.detach()[mask].sum(),
        }
    return LossOutput(loss=loss, metrics=metrics)
