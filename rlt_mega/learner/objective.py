"""The GRPO loss as a loss of the dense schedule's logits (rlt_mega/loss.py, ``LogitsLoss``), so
that every engine runs it on every layout: on one process, and under tensor, pipeline and
ZeRO parallelism, where the distributed engine computes the logits (a vocab shard under TP,
on the last stage under PP) and hands them over.

A batch (``grpo_batch``) is one rollout batch with what the learner attached to it:

    inputs      (B, T) the dense schedule's tokens (``dense_inputs``)
    rollout     the Rollout (tokens, mu, mask, schedule)
    replay      (B, N) its replay under the current parameters (the hybrid's value); under
                pipeline parallelism only the last stage has it, and only it computes the loss
    advantages  (B,)
    ref         (B, N) the frozen reference's replay, or None

The loss is the SUM over the batch's completion tokens and ``count`` its completion tokens:
the engine divides the step's sum by the global count (every batch of the step, every
data-parallel rank). A batch is never cut: its replay repeats its rollout's calls.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlt_mega.learner.grpo import grpo_loss
from rlt_mega.learner.logprob import dense_inputs, dense_logprobs_from_logits, hybrid_logprobs, mismatch_metrics
from rlt_mega.loss import LogitsLoss, Vocab
from rlt_mega.rollout.sampler import Rollout


def grpo_batch(rollout: Rollout, replay: Optional[torch.Tensor], advantages: torch.Tensor,
               ref: Optional[torch.Tensor] = None) -> dict:
    return {"inputs": dense_inputs(rollout), "rollout": rollout, "replay": replay,
            "advantages": advantages.to(rollout.mu.device), "ref": ref}


class GRPOObjective(LogitsLoss):
    """Hybrid log-probs (value = replay, gradient = dense), the clipped surrogate against mu and
    the optional k3 KL to the reference. ``records`` collects each batch's metric sums in call
    order, on the ranks that compute the loss (all of them without pipeline parallelism, the
    last stage with it); the trainer reduces them over the world."""

    def __init__(self, eps_low: float, eps_high: float, kl_coef: float = 0.0) -> None:
        self.eps_low, self.eps_high, self.kl_coef = eps_low, eps_high, kl_coef
        self.records: list[dict[str, float]] = []

    def count(self, batch: dict) -> float:
        return batch["rollout"].num_completion_tokens()

    def logits_loss(self, logits: torch.Tensor, batch: dict, vocab: Vocab) -> torch.Tensor:
        ro: Rollout = batch["rollout"]
        if batch["replay"] is None:
            raise RuntimeError("the GRPO loss needs the replay of its rollout on the rank that computes it")
        dense = dense_logprobs_from_logits(logits, ro, vocab.gather)  # (B, N)
        logp = hybrid_logprobs(dense, batch["replay"])
        ref = batch["ref"]
        out = grpo_loss(logp, ro.mu, batch["advantages"], ro.mask, eps_low=self.eps_low, eps_high=self.eps_high,
                        ref_logp=ref, kl_coef=self.kl_coef if ref is not None else 0.0)
        record = {k: float(v) for k, v in out.metrics.items()}
        record.update(mismatch_metrics(ro.mu, dense, batch["replay"], ro.mask))
        self.records.append(record)
        return out.loss
