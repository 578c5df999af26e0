"""What a GRPO step learns from: one sampling round, or DAPO's dynamic sampling over several
(grpo.dynamic_sampling), with the rewards shaped and the rows that carry loss marked.

A round is prompts_per_step prompts x group_size completions per replica, sampled as the
step's minibatches of rollout batches (train/grpo.py). Dynamic sampling keeps, per replica,
the first prompts_per_step groups whose rewards are not all equal (a group of equal rewards
has advantage 0: no gradient) over rounds of fresh prompts, at most grpo.max_sampling_rounds
(all of them reserved by the step, train/grpo_sample.py); every replica samples as many rounds
as the one that needs most (one all-reduce per round). The learner then sees, for batch j of
minibatch k, the batch (k, j) of every round that kept a row (learner/objective.py,
``GRPOPart``): a rollout batch is never cut, its dropped rows carry no loss.

Rewards: the task reward (grpo.reward), plus DAPO's soft overlong penalty
(rollout/shaping.py), minus kl_coef * sum_t KL(mu_t || ref_t) under grpo.kl_in_reward
(added by the trainer once the reference has replayed the kept batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from rlt_mega.learner.advantages import informative_groups
from rlt_mega.learner.kl import kl_estimate
from rlt_mega.rollout import Rollout


@dataclass
class Round:
    """One sampling round of a replica. rows: the records, one per completion (the G of a
    prompt contiguous); rollouts [minibatch][batch]; scores: task rewards; penalties: the
    overlong penalties; group_keep (num_groups,) bool: the groups the step learns from."""

    rows: list[dict]
    rollouts: list[list[Rollout]]
    scores: list[float]
    penalties: list[float]
    failures: int
    nonfinite: int  # rewards that were NaN or infinite (scored 0, counted in failures too)
    group_keep: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    kl_penalties: Optional[torch.Tensor] = None  # (rows,) kl_coef * sum_t KL, under kl_in_reward
    refs: Optional[list[list[Optional[torch.Tensor]]]] = None  # [minibatch][batch] reference replays

    @property
    def flat(self) -> list[Rollout]:
        return [ro for mb in self.rollouts for ro in mb]

    def rewards(self) -> torch.Tensor:
        """(rows,) what the advantages see: score + overlong penalty (- the KL penalty)."""
        r = torch.tensor(self.scores, dtype=torch.float64) + torch.tensor(self.penalties, dtype=torch.float64)
        if self.kl_penalties is not None:
            r = r - self.kl_penalties.to(torch.float64)
        return r

    def shaped_without_kl(self) -> torch.Tensor:
        return torch.tensor(self.scores, dtype=torch.float64) + torch.tensor(self.penalties, dtype=torch.float64)


def keep_informative(rnd: Round, group_size: int, needed: int) -> int:
    """Marks the first ``needed`` informative groups of the round as kept -> how many."""
    informative = informative_groups(rnd.shaped_without_kl(), group_size)  # (num_groups,)
    keep = informative & (torch.cumsum(informative.long(), 0) <= needed)
    rnd.group_keep = keep
    return int(keep.sum())


def keep_all(rnd: Round, group_size: int) -> None:
    rnd.group_keep = torch.ones(len(rnd.rows) // group_size, dtype=torch.bool)


def row_keep(rnd: Round, group_size: int, mask_truncated: bool) -> torch.Tensor:
    """(rows,) bool: the rows that carry loss, in the round's row order."""
    keep = rnd.group_keep.repeat_interleave(group_size)
    if mask_truncated:
        finished = torch.tensor([f != "length" for ro in rnd.flat for f in ro.finish_reasons])
        keep = keep & finished
    return keep


def row_kl_sums(rollout: Rollout, ref: Optional[torch.Tensor], estimator: str) -> torch.Tensor:
    """(B,) sum over each completion's tokens of the KL estimate between the behavior policy
    mu and the reference, on a rank that has the reference's replay (zeros elsewhere)."""
    if ref is None:
        return torch.zeros(rollout.batch_size, dtype=torch.float64)
    mask = rollout.mask.bool() & torch.isfinite(ref) & torch.isfinite(rollout.mu)
    zeros = torch.zeros_like(rollout.mu)
    kl = kl_estimate(torch.where(mask, rollout.mu, zeros), torch.where(mask, ref, zeros), estimator)
    return torch.where(mask, kl, zeros).sum(dim=1).to(torch.float64).cpu()
