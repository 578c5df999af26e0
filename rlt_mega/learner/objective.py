"""The GRPO loss as a loss of the dense schedule's logits (rlt_mega/loss.py, ``LogitsLoss``), so
that every engine runs it on every layout: on one process, and under tensor, pipeline and
ZeRO parallelism, where the distributed engine computes the logits (a vocab shard under TP,
on the last stage under PP) and hands them over.

A batch (``grpo_batch``) is one or more rollout batches (``GRPOPart``) with what the learner
attached to each, their dense inputs stacked row-wise into one dense call:

    inputs      (sum_i B_i, max_i T_i) the parts' dense schedule tokens (``dense_inputs``),
                right-padded (everything is causal: no earlier position changes)
    dense_rows  each row's length, prompt and group (schedule/dense.py DenseRows): the row
                steps the dense decoder runs
    parts       [GRPOPart]: the Rollout (tokens, mu, mask, schedule); its replay (B, N) under
                the current parameters (the hybrid's value; under pipeline parallelism only
                the last stage has it, and only it computes the loss); advantages (B,); the
                frozen reference's replay (B, N) or None; rows (B,) bool, the rows that carry
                loss (dynamic sampling drops whole groups, grpo.mask_truncated cut rows)

One part is the usual batch. Several parts are how dynamic sampling learns from the groups it
kept out of several sampling rounds without cutting a rollout batch (each part's replay
repeats its rollout's calls) and without changing how many batches the engine steps over
(train.grad_accum). The dense pass is the gradient only, so stacking its rows is free.

The loss is a SUM and ``count`` its share of the normaliser (learner/aggregation.py, by
grpo.loss_agg): the engine divides the step's sum by the global count (every batch of the
step, every data-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from rlt_mega.learner.aggregation import loss_count, loss_sum
from rlt_mega.learner.correction import Correction, is_weights, ratio_by_version
from rlt_mega.learner.distill import distill_advantages, distill_metrics, forward_kl_metrics, forward_kl_topk
from rlt_mega.learner.grpo import grpo_loss
from rlt_mega.learner.logprob import completion_values, dense_inputs, dense_rows, hybrid_logprobs, mismatch_metrics
from rlt_mega.loss import DENSE_ROWS, Logits, LogitsLoss, Vocab
from rlt_mega.schedule.dense import stack_rows
from rlt_mega.rollout.sampler import Rollout


@dataclass
class GRPOPart:
    rollout: Rollout
    replay: Optional[torch.Tensor]  # (B, N), or None on a rank without the loss
    advantages: torch.Tensor  # (B,)
    ref: Optional[torch.Tensor] = None  # (B, N)
    rows: Optional[torch.Tensor] = None  # (B,) bool; None: every row carries loss
    # (B, N) the proximal policy's log-probs (a stale sample under grpo.is_correction: the
    # replay with the step's starting parameters); None: the ratio is against mu, no correction
    proximal: Optional[torch.Tensor] = None
    # (B, N) the teacher's log-probs of the sampled tokens (grpo.teacher, learner/distill.py),
    # attached by Teacher.score; None: no distillation
    teacher: Optional[torch.Tensor] = None
    # the teacher's top-k at each sampled position (grpo.teacher_topk): ids (B, N, k), log-probs
    # (B, N, k), from the same replay; None: no forward-KL term
    teacher_topk: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def loss_mask(self) -> torch.Tensor:
        """(B, N) bool: the completion tokens that carry loss."""
        mask = self.rollout.mask.bool()
        return mask if self.rows is None else mask & self.rows.to(mask.device)[:, None]


def grpo_batch(parts: list[GRPOPart], compact: bool = True, share_prompts: bool = True) -> dict:
    """compact / share_prompts: the batch's ``dense_rows`` (schedule/dense.py), which the dense
    decoder follows (both off: the padded schedule, the benchmarks' baseline arm)."""
    if not parts:
        raise ValueError("a GRPO batch needs at least one rollout batch")
    inputs = [dense_inputs(p.rollout) for p in parts]  # each (B_i, T_i)
    longest = max(x.shape[1] for x in inputs)
    stacked = torch.cat([F.pad(x, (0, longest - x.shape[1]), value=0) for x in inputs])  # (sum B_i, T)
    for p in parts:
        p.advantages = p.advantages.to(p.rollout.mu.device)
    batch = {"inputs": stacked, "parts": parts}
    rows = stack_rows([dense_rows(p.rollout, compact, share_prompts) for p in parts])
    if rows is not None:
        batch[DENSE_ROWS] = rows
    return batch


@dataclass(frozen=True)
class LossSettings:
    """What the objective needs of grpo.* (train/grpo.py builds it from the config)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0  # the KL loss term's coefficient (0 when the KL is folded into the reward)
    loss: str = "clip"
    clip_ratio_c: Optional[float] = None
    kl_estimator: str = "k3"
    loss_agg: str = "token_mean"
    loss_agg_length: int = 0
    entropy_coef: float = 0.0
    correction: Correction = Correction()
    teacher_coef: float = 1.0  # grpo.teacher_coef: the distillation advantage's weight (learner/distill.py)
    teacher_topk_coef: float = 1.0  # grpo.teacher_topk_coef: the top-k forward-KL term's weight


class GRPOObjective(LogitsLoss):
    """Hybrid log-probs (value = replay, gradient = dense), the policy loss against mu, the
    optional KL to the reference and entropy bonus. ``records`` collects each part's metric
    sums in call order, on the ranks that compute the loss (all of them without pipeline
    parallelism, the last stage with it); the trainer reduces them over the world."""

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2, kl_coef: float = 0.0,
                 settings: Optional[LossSettings] = None) -> None:
        self.settings = settings or LossSettings(eps_low, eps_high, kl_coef)
        self.records: list[dict[str, float]] = []

    def count(self, batch: dict) -> float:
        s = self.settings
        return sum(loss_count(p.loss_mask(), s.loss_agg, s.loss_agg_length) for p in batch["parts"])

    def logits_loss(self, logits: torch.Tensor | Logits, batch: dict, vocab: Vocab) -> torch.Tensor:
        s, total, offset = self.settings, None, 0
        logits = Logits.of(logits)
        for part in batch["parts"]:
            ro: Rollout = part.rollout
            if part.replay is None:
                raise RuntimeError("the GRPO loss needs the replay of its rollout on the rank that computes it")
            rows = logits.rows(offset, offset + ro.batch_size)  # (B, T, V_local)
            offset += ro.batch_size
            ids = None if part.teacher_topk is None else part.teacher_topk[0]  # (B, N, k)
            dense, entropy, student_topk = completion_values(rows, ro, vocab.gather, ids=ids)  # (B, N) each
            logp = hybrid_logprobs(dense, part.replay)
            kl_coef = s.kl_coef if part.ref is not None else 0.0
            old, weights = ro.mu, None
            if part.proximal is not None:
                old, weights = part.proximal, is_weights(part.proximal, ro.mu, part.loss_mask(), s.correction)
            advantages = part.advantages
            if part.teacher is not None:  # on-policy distillation: per-token advantages
                advantages = distill_advantages(part.teacher, ro.mu, part.advantages, part.loss_mask(), s.teacher_coef)
            out = grpo_loss(logp, old, advantages, part.loss_mask(), s.eps_low, s.eps_high,
                            ref_logp=part.ref, kl_coef=kl_coef, loss=s.loss, clip_ratio_c=s.clip_ratio_c,
                            kl_estimator=s.kl_estimator, loss_agg=s.loss_agg,
                            entropy=entropy if s.entropy_coef else entropy.detach(), entropy_coef=s.entropy_coef,
                            is_weights=weights)
            record = {k: float(v) for k, v in out.metrics.items()}
            if weights is not None:
                record.update(correction_metrics(part.proximal, ro.mu, part.loss_mask(), weights))
            record.update(mismatch_metrics(ro.mu, dense, part.replay, ro.mask))
            loss = out.loss
            if part.teacher is not None:
                record.update(distill_metrics(part.teacher, ro.mu, part.loss_mask()))
            if part.teacher_topk is not None:  # the forward-KL term on the teacher's top-k
                teacher_lp = part.teacher_topk[1]
                fkl = forward_kl_topk(student_topk, teacher_lp, part.loss_mask())
                loss = loss + s.teacher_topk_coef * loss_sum(fkl, part.loss_mask(), s.loss_agg)
                record.update(forward_kl_metrics(fkl, teacher_lp, part.loss_mask()))
            if ro.version is not None:  # the staleness metrics, by each token's own policy version
                record["by_version"] = ratio_by_version(out.ratio, part.loss_mask(), ro.version.to(out.ratio.device))
            self.records.append(record)
            total = loss if total is None else total + loss
        return total


def correction_metrics(proximal: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
                       ) -> dict[str, float]:
    """Sums (reduce, then divide) of the behaviour ratio pi_old / mu and the correction's weights."""
    mask = mask.bool()
    rho = torch.exp(torch.where(mask, proximal - mu, torch.zeros_like(mu)))[mask]
    w = weights[mask]
    return {"rho_sum": float(rho.sum()), "rho_min": float(rho.min()) if rho.numel() else 1.0,
            "rho_max": float(rho.max()) if rho.numel() else 1.0, "is_weight_sum": float(w.sum()),
            "is_rejected": float((w == 0).sum())}
