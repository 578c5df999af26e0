"""The GRPO loss as an objective of the dense schedule's logits (parallel.engine.LogitsLoss), so
that every engine runs it on every layout: on one process, and under tensor, pipeline and
ZeRO parallelism, where the distributed engine computes the logits (a vocab shard under TP,
on the last stage under PP) and hands them over.

A micro-batch (``grpo_micro_batch``) is one rollout batch with what the learner attached to it:

    inputs      (B, T) the dense schedule's tokens (``dense_inputs``)
    rollout     the Rollout (tokens, mu, mask, schedule)
    replay      (B, N) its replay under the current parameters (the hybrid's value); under
                pipeline parallelism only the last stage has it, and only it computes the loss
    advantages  (B,)
    ref         (B, N) the frozen reference's replay, or None

The loss is the SUM over the micro-batch's completion tokens; the engine divides by the global
count (every micro-batch of the step, every data-parallel rank: ``count_completion_tokens``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rlt_mega.learner.grpo import grpo_loss
from rlt_mega.learner.logprob import dense_inputs, dense_logprobs_from_logits, hybrid_logprobs, mismatch_metrics
from rlt_mega.parallel.engine import LogitsLoss
from rlt_mega.rollout.sampler import Rollout


def grpo_micro_batch(rollout: Rollout, replay: Optional[torch.Tensor], advantages: torch.Tensor,
                     ref: Optional[torch.Tensor] = None) -> dict:
    return {"inputs": dense_inputs(rollout), "rollout": rollout, "replay": replay,
            "advantages": advantages.to(rollout.mu.device), "ref": ref}


def count_completion_tokens(mb: dict) -> int:
    return mb["rollout"].num_completion_tokens()


class GRPOObjective(LogitsLoss):
    """Hybrid log-probs (value = replay, gradient = dense), the clipped surrogate against mu and
    the optional k3 KL to the reference. ``records`` collects each micro-batch's metric sums in
    call order, on the ranks that compute the loss (all of them without pipeline parallelism,
    the last stage with it); the trainer reduces them over the world."""

    def __init__(self, eps_low: float, eps_high: float, kl_coef: float = 0.0) -> None:
        self.eps_low, self.eps_high, self.kl_coef = eps_low, eps_high, kl_coef
        self.records: list[dict[str, float]] = []

    def logits_loss(self, logits: torch.Tensor, mb: dict, gather_vocab: Callable) -> torch.Tensor:
        ro: Rollout = mb["rollout"]
        if mb["replay"] is None:
            raise RuntimeError("the GRPO loss needs the replay of its rollout on the rank that computes it")
        dense = dense_logprobs_from_logits(logits, ro, gather_vocab)  # (B, N)
        logp = hybrid_logprobs(dense, mb["replay"])
        ref = mb["ref"]
        # num_tokens_global=1: the SUM over this micro-batch's tokens; the engine divides by the
        # global completion-token count (every micro-batch, every data-parallel rank).
        out = grpo_loss(logp, ro.mu, mb["advantages"], ro.mask, num_tokens_global=1.0, eps_low=self.eps_low,
                        eps_high=self.eps_high, ref_logp=ref, kl_coef=self.kl_coef if ref is not None else 0.0)
        record = {k: float(v) for k, v in out.metrics.items()}
        record.update(mismatch_metrics(ro.mu, dense, mb["replay"], ro.mask))
        self.records.append(record)
        return out.loss
