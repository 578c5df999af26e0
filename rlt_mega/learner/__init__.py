"""Log-probabilities (dense, replay, hybrid) and losses (token cross-entropy, GRPO)."""

from rlt_mega.learner.grpo import ADVANTAGE_ESTIMATORS, LossOutput, group_advantages, grpo_loss, k3_kl
from rlt_mega.learner.logprob import (HybridLogProb, dense_logprobs, hybrid_logprobs, mismatch_metrics,
                                      replay_logprobs)

__all__ = ["ADVANTAGE_ESTIMATORS", "LossOutput", "group_advantages", "grpo_loss", "k3_kl", "HybridLogProb",
           "dense_logprobs", "hybrid_logprobs", "mismatch_metrics", "replay_logprobs"]
