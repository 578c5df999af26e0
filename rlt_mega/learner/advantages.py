"""Outcome advantages of a group of G completions of one prompt (docs/design.md, "GRPO").

A registry, as variants multiply: GRPO ((r - mean) / (std + eps)), Dr.GRPO (r - mean) and
RLOO (r minus the mean of the other G - 1 rewards). Each maps rewards (num_groups, G) to
advantages of the same shape; every token of a completion shares its completion's advantage.
"""

from __future__ import annotations

from typing import Callable

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
    GRPO, TRL and verl compute it. A group of equal rewards gets 0 (0 / eps), never NaN."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return (rewards - mean) / (std + eps)


@register_advantage("dr_grpo")
def _dr_grpo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """Dr.GRPO: r - mean, without the std normalisation that reweights easy/hard groups."""
    return rewards - rewards.mean(dim=1, keepdim=True)


@register_advantage("rloo")
def _rloo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r_i - mean_{j != i} r_j, the leave-one-out baseline, which
    does not depend on r_i and so keeps the estimator unbiased. Equal to G / (G - 1) (r - mean)."""
    G = rewards.shape[1]
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (G - 1)
    return rewards - others


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


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(num_groups,) bool: the groups whose rewards are not all equal. A group of equal rewards
    has advantage 0 under every estimator here: it carries no policy gradient (DAPO's
    dynamic sampling drops it)."""
    groups = rewards.float().view(-1, group_size)  # (num_groups, G)
    return (groups != groups[:, :1]).any(dim=1)
