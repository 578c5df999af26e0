"""Per-token estimators of KL(pi || ref) from log-probs of tokens sampled from pi (Schulman,
"Approximating KL divergence", 2020), under verl's names in brackets:

    k1 = log(pi / ref)                       unbiased, can be negative          ["kl"]
    k2 = (log(pi / ref))^2 / 2               biased, >= 0, low variance         ["mse"]
    k3 = ref/pi - 1 - log(ref/pi)            unbiased, >= 0, low variance       ["low_var_kl"]

As a loss term (grpo.kl_coef, the gradient through pi's log-probs) or folded into the reward
(grpo.kl_in_reward: r - kl_coef * sum_t k(mu_t, ref_t), no gradient).
"""

from __future__ import annotations

from typing import Callable

import torch

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KLFn] = {}


def register_kl(name: str) -> Callable[[KLFn], KLFn]:
    def wrap(fn: KLFn) -> KLFn:
        if name in KL_ESTIMATORS:
            raise ValueError(f"KL estimator {name!r} is already registered")
        KL_ESTIMATORS[name] = fn
        return fn
    return wrap


@register_kl("k1")
def k1_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@register_kl("k2")
def k2_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).square()


@register_kl("k3")
def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(ref - logp) - (ref - logp) - 1 >= 0. The log-ratio is clamped to [-20, 20] and the
    result to <= 10 as verl's ``low_var_kl`` does: a token the reference gives (almost) no
    mass would otherwise be inf."""
    log_ratio = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.expm1(log_ratio) - log_ratio, max=10.0)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """(B, N) per-token KL estimate; the caller masks padding and support misses."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logp, ref_logp)
