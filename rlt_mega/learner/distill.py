"""On-policy distillation (grpo.teacher, docs/guide/grpo.md "Distillation"): the student samples,
a frozen teacher scores every sampled token, and the student learns the per-token reverse KL
toward the teacher through the GRPO objective's own policy loss, aggregation and corrections.

The teacher scores in the learner's replay pass: it replays each rollout's recorded schedule
(rollout/sampler.py ``Sampler.replay``: the same calls, tokens forced, the rollout's processing
and dtype) and returns log pi_teacher of every sampled token, in the layout of ``rollout.mu``.
The student's log-probability is mu itself, which the replay of the student equals bit for bit
(docs/design.md): the per-token signal carries no sampler-learner noise.

Per token t of row b (the completion tokens that carry loss; observation tokens an environment
inserted carry none, and a row the step leaves out has none):

    A_distill[b, t] = log pi_teacher(x_t) - log mu(x_t)          = - k1(mu, teacher)
    A[b, t]         = teacher_coef * A_distill[b, t] + (1 - teacher_coef) * A_task[b]

A_distill is minus the single-sample estimate of KL(student || teacher) at the sampled token
(Thinking Machines' on-policy distillation; verl's distillation with ``use_policy_gradient`` and
loss_mode k1 uses the same advantage, -kl_penalty(student, teacher, "kl")); as a policy-gradient
advantage it minimises the sequence-level reverse KL. teacher_coef = 1 is pure distillation,
0 the task reward alone, between them a mix of the two advantages.

A token outside the teacher's support under the rollout's processing (top-k / top-p keep a set)
has log pi_teacher = -inf: its distillation advantage is held at -DISTILL_FLOOR (as verl clamps
its KL estimators' log-ratio at 20), so one such token cannot swamp the step.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

DISTILL_FLOOR = 20.0  # the most negative distillation advantage of a token


def distill_advantages(teacher: torch.Tensor, mu: torch.Tensor, task: torch.Tensor, mask: torch.Tensor,
                       teacher_coef: float) -> torch.Tensor:
    """teacher, mu (B, N) log-probs of the sampled tokens; task (B,) the rows' task advantages;
    mask (B, N) the tokens that carry loss -> (B, N) per-token advantages (0 off the mask),
    detached (an advantage is a constant of the loss)."""
    mask = mask.bool()
    teacher, mu = teacher.detach().to(mu.device), mu.detach()
    gap = torch.where(mask, teacher - mu, torch.zeros_like(mu))  # (B, N); -inf where the teacher misses
    gap = gap.clamp(min=-DISTILL_FLOOR)
    adv = teacher_coef * gap + (1.0 - teacher_coef) * task.detach().to(mu)[:, None]
    return torch.where(mask, adv, torch.zeros_like(adv))


def distill_metrics(teacher: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sums over the loss tokens (reduce, then divide): the reverse-KL estimate log mu - log
    teacher, and the tokens outside the teacher's support."""
    mask = mask.bool()
    teacher = teacher.to(mu.device)
    miss = mask & torch.isneginf(teacher)
    ok = mask & ~miss
    return {"distill_tokens": float(mask.sum()), "distill_kl_sum": float((mu - teacher)[ok].sum()),
            "distill_miss": float(miss.sum())}


class Teacher:
    """A frozen teacher in this rank's layout: ``sampler`` replays rollouts on it (a
    rollout.Sampler over the teacher's stage and shard, built by train/builders.py
    ``teacher_model``). :meth:`score` is a collective of the model replica (every tp and pp
    rank calls it with the same batches, as the student's replay)."""

    def __init__(self, sampler, name: str) -> None:
        self.sampler, self.name = sampler, name

    def score(self, batches: Sequence[dict]) -> None:
        """Attaches the teacher's log-probs (B, N) to every part of every GRPO batch
        (``part.teacher``; None on a rank without the loss), batch by batch, each rollout
        replayed as it was sampled."""
        for batch in batches:
            parts = batch["parts"]
            values: list[Optional[torch.Tensor]] = self.sampler.replay([p.rollout for p in parts])
            for part, value in zip(parts, values):
                part.teacher = value


def distill_step_metrics(dims, records: Sequence[dict]) -> dict[str, float]:
    """The step's distillation metrics from the objective's records (on the ranks that compute
    the loss; a collective over the world, every rank calls it): distill/reverse_kl, the mean
    over the loss tokens of log mu - log teacher (KL(student || teacher) per token, the
    teacher's support misses left out), and distill/teacher_miss_fraction."""
    sums = {"distill_tokens": 0.0, "distill_kl_sum": 0.0, "distill_miss": 0.0}
    for m in records if dims.is_loss_rank else ():
        for k in sums:
            sums[k] += m.get(k, 0.0)
    r = dims.reduce(sums, {}, {})
    tokens = max(r["distill_tokens"], 1.0)
    return {"distill/reverse_kl": r["distill_kl_sum"] / max(r["distill_tokens"] - r["distill_miss"], 1.0),
            "distill/teacher_miss_fraction": r["distill_miss"] / tokens}
