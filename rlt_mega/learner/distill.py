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

Top-k forward KL (grpo.teacher_topk = k > 0, weight grpo.teacher_topk_coef): the teacher's replay
also keeps, at each sampled token's position, its k most probable tokens V_k and their log-probs;
the student's dense pass takes its own log-probs of those tokens (with grad), and the loss gains

    teacher_topk_coef * agg_t F[b, t],   F[b, t] = sum_{v in V_k} p_T(v) (log p_T(v) - log p_S(v))

aggregated as the policy loss (grpo.loss_agg) over the same tokens. p_T is the teacher's own
probability, NOT renormalised over V_k (verl 0.9.1's forward_kl_topk, ``kl_divergence``): F is the
cross-entropy of the student on the teacher's top-k mass minus that mass's entropy term, its
gradient -sum p_T grad log p_S. Both sides are under the rollout's processing (temperature, top-k,
top-p), as mu is. A teacher entry outside its own kept set (p_T = 0) adds nothing; a student
log-prob is held at >= -DISTILL_FLOOR (verl clamps at log_prob_min_clamp), so a token outside the
student's kept set adds a bounded term and no gradient.
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


def forward_kl_topk(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """student, teacher (B, N, k) log-probs of the teacher's top-k tokens at each sampled position
    (the student's with grad); mask (B, N) -> F (B, N) = sum_k p_T (log p_T - log p_S), 0 off the
    mask (module docstring: not renormalised; a teacher entry of p_T = 0 adds nothing; the
    student's log-prob held at >= -DISTILL_FLOOR)."""
    teacher = teacher.detach().to(student)
    valid = mask.bool()[..., None] & torch.isfinite(teacher)
    t = torch.where(valid, teacher, torch.zeros_like(teacher))
    s = torch.where(valid, student.clamp(min=-DISTILL_FLOOR), torch.zeros_like(student))
    return torch.where(valid, t.exp() * (t - s), torch.zeros_like(s)).sum(dim=-1)


def forward_kl_metrics(per_token: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sums over the loss tokens (reduce, then divide): the forward-KL term F and the teacher's
    probability mass inside its top-k."""
    mask = mask.bool()
    teacher = teacher.to(per_token.device)
    mass = torch.where(torch.isfinite(teacher), teacher.exp(), torch.zeros_like(teacher)).sum(dim=-1)
    return {"distill_fkl_sum": float(per_token.detach()[mask].sum()), "distill_topk_mass_sum": float(mass[mask].sum())}


class Teacher:
    """A frozen teacher in this rank's layout: ``sampler`` replays rollouts on it (a
    rollout.Sampler over the teacher's stage and shard, built by train/builders.py
    ``teacher_model``). :meth:`score` is a collective of the model replica (every tp and pp
    rank calls it with the same batches, as the student's replay)."""

    def __init__(self, sampler, name: str, topk: int = 0) -> None:
        self.sampler, self.name, self.topk = sampler, name, topk

    def score(self, batches: Sequence[dict]) -> None:
        """Attaches the teacher's log-probs (B, N) to every part of every GRPO batch
        (``part.teacher``; None on a rank without the loss), batch by batch, each rollout
        replayed as it was sampled; with topk > 0 also its top-k (``part.teacher_topk``: ids
        (B, N, k), log-probs (B, N, k)) from the same replay."""
        for batch in batches:
            parts = batch["parts"]
            rollouts = [p.rollout for p in parts]
            if not self.topk:
                values: list[Optional[torch.Tensor]] = self.sampler.replay(rollouts)
                for part, value in zip(parts, values):
                    part.teacher = value
                continue
            for part, scored in zip(parts, self.sampler.replay_topk(rollouts, self.topk)):
                part.teacher, part.teacher_topk = (None, None) if scored is None else (scored[0], scored[1:])


def distill_step_metrics(dims, records: Sequence[dict]) -> dict[str, float]:
    """The step's distillation metrics from the objective's records (on the ranks that compute
    the loss; a collective over the world, every rank calls it): distill/reverse_kl, the mean
    over the loss tokens of log mu - log teacher (KL(student || teacher) per token, the
    teacher's support misses left out), and distill/teacher_miss_fraction."""
    sums = {"distill_tokens": 0.0, "distill_kl_sum": 0.0, "distill_miss": 0.0, "distill_fkl_sum": 0.0,
            "distill_topk_mass_sum": 0.0}
    for m in records if dims.is_loss_rank else ():
        for k in sums:
            sums[k] += m.get(k, 0.0)
    r = dims.reduce(sums, {}, {})
    tokens = max(r["distill_tokens"], 1.0)
    out = {"distill/reverse_kl": r["distill_kl_sum"] / max(r["distill_tokens"] - r["distill_miss"], 1.0),
           "distill/teacher_miss_fraction": r["distill_miss"] / tokens}
    if r["distill_topk_mass_sum"]:  # grpo.teacher_topk: the forward-KL term and the top-k's mass
        out.update({"distill/forward_kl_topk": r["distill_fkl_sum"] / tokens,
                    "distill/teacher_topk_mass": r["distill_topk_mass_sum"] / tokens})
    return out
