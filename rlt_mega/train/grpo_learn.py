"""GRPO's learner phases (docs/design.md, "GRPO"), each with its input and output:

    score    Generated -> Scored      the frozen reference's replay (grpo.kl_coef > 0; under
                                      grpo.kl_in_reward its KL folded into the rewards), group
                                      advantages (grpo / dr_grpo / rloo)
    correct  Scored -> Proximal       a stale step under grpo.is_correction: every minibatch
                                      replayed with the step's starting parameters, the proximal
                                      policy (learner/correction.py); None otherwise
    learn    Scored, Proximal -> Learned
                                      epochs x minibatches of: replay (the rollouts' own schedule
                                      with the current parameters; the first minibatch's value
                                      is mu bit for bit, ``first_values``), hybrid log-probs
                                      (value = replay, gradient = dense), the clipped surrogate
                                      over the global completion-token count, one optimizer step

The phases hold no state between steps; the job (train/grpo.py) composes them with a source of
samples (sample phase colocated, or a sampler role) and the publication of weights.

The on-policy check (grpo.verify_onpolicy): the first minibatch replayed under the policy
version that sampled it must be torch.equal to mu (the exactness contract), at every step: at a
stale step (grpo.max_staleness > 0) the learner replays it under the sampling version, which it
keeps for that (``PolicyHistory``; two versions under partial rollouts, the replay switching as
the sampler did). ``ratio/onpolicy_max_dev`` is what the check measured (0), and
``ratio/policy_change_max_dev`` the first minibatch's max |ratio - 1| against the current
policy: the policy's change since the samples were drawn (0 at staleness 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from rlt_mega.config import Config
from rlt_mega.learner.distill import Teacher
from rlt_mega.learner.grpo import group_advantages
from rlt_mega.learner.objective import GRPOObjective, GRPOPart, grpo_batch
from rlt_mega.log import get_logger
from rlt_mega.metrics import Timers
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import Engine, StepStats
from rlt_mega.rollout import Rollout, Sampler
from rlt_mega.train.async_grpo import Generated, KeptVersions, PolicyHistory
from rlt_mega.train.grpo_rounds import Round, row_keep, row_kl_sums
from rlt_mega.train.grpo_sample import Policy
from rlt_mega.train.grpo_settings import RowCut, loss_settings

log = get_logger(__name__)

Proximal = list[dict[int, list]]  # [minibatch][round] replays under the step's starting parameters


@dataclass
class Scored:
    """The score phase's output: data step ``item`` learned at a step of lag ``lag``, each
    round's (rows,) advantages."""

    item: Generated
    advantages: list[torch.Tensor]
    lag: int

    @property
    def rounds(self) -> list[Round]:
        return self.item.rounds


@dataclass
class Learned:
    """The learn phase's output: the objective's per-batch records (loss ranks; the first
    ``first_records`` the first minibatch's), the rollout batches learned (every epoch), each
    optimizer step's stats, the seconds spent; ``onpolicy_checked``: the first minibatch was
    replayed under its sampling version and equalled mu (grpo.verify_onpolicy);
    ``first_replayed``: its ratios came from a replay (or the checked mu), not from mu unchecked."""

    records: list[dict]
    first_records: int
    rollouts: list[Rollout] = field(default_factory=list)
    stats: list[StepStats] = field(default_factory=list)
    seconds: float = 0.0
    onpolicy_checked: bool = False
    first_replayed: bool = True


class LearnPhases:
    """``policy``: the engine's current policy; ``reference``: the frozen reference's Sampler in
    the same layout (grpo.kl_coef > 0) or None; ``history``: the kept versions of the check."""

    def __init__(self, cfg: Config, dims: ParallelDims, engine: Engine, policy: Policy,
                 reference: Optional[Sampler], history: PolicyHistory, timers: Timers,
                 teacher: Optional[Teacher] = None) -> None:
        self.cfg, self.dims, self.engine, self.policy = cfg, dims, engine, policy
        self.reference, self.history, self.timers = reference, history, timers
        self.teacher = teacher  # grpo.teacher: scores each learned batch (learner/distill.py)
        self.cut = RowCut.of(cfg)
        self.objective = GRPOObjective(settings=loss_settings(cfg))
        self._warned_unkept = False

    # ------------------------------------------------------------------ score
    def score(self, item: Generated, done: int) -> Scored:
        g = self.cfg.grpo
        if self.reference is not None:
            with self.timers("reference"):
                self._reference(item.rounds)
        with self.timers("advantages"):
            advantages = [group_advantages(rnd.rewards().float(), g.group_size, g.advantage, g.advantage_eps)
                          for rnd in item.rounds]
        return Scored(item, advantages, item.lag(done))

    def _reference(self, rounds: list[Round]) -> None:
        """The frozen reference's replay of every batch the step learns from; under
        grpo.kl_in_reward also each row's KL penalty, shared over the model replica."""
        g, dims = self.cfg.grpo, self.dims
        for rnd in rounds:
            rnd.refs = [self.reference.replay(mb) if self.learns_from(rnd, k) else [None] * len(mb)
                        for k, mb in enumerate(rnd.rollouts)]
            if g.kl_in_reward:
                sums = torch.cat([row_kl_sums(ro, ref if dims.is_loss_rank else None, g.kl_estimator)
                                  for mb, refs in zip(rnd.rollouts, rnd.refs) for ro, ref in zip(mb, refs)])
                # Only the loss rank (the last stage, TP rank 0) has the reference's values.
                sums = dims.all_reduce(sums.to(dims.device), axis="mp").cpu()
                rnd.kl_penalties = g.kl_coef * sums

    def learns_from(self, rnd: Round, k: int) -> bool:
        groups = self.cut.minibatch_rows // self.cfg.grpo.group_size
        return bool(rnd.group_keep[k * groups:(k + 1) * groups].any())

    def _used(self, rounds: list[Round], k: int) -> list[int]:
        """The rounds minibatch k learns from (round 0 if none: the engine steps over a fixed
        number of batches)."""
        return [r for r, rnd in enumerate(rounds) if self.learns_from(rnd, k)] or [0]

    # ------------------------------------------------------------------ correct
    def correct(self, scored: Scored) -> Optional[Proximal]:
        """[minibatch][round] the replays of a stale step's rollouts under the parameters it
        starts with (the proximal policy of learner/correction.py), taken before its first
        update; None at a step of lag 0 or without grpo.is_correction. (None entries on a rank
        without the loss: under pipeline parallelism only the last stage has them.)"""
        if not scored.lag or self.cfg.grpo.is_correction == "none":
            return None
        with self.timers("proximal"):
            policy, rounds = self.policy.sampler(), scored.rounds
            return [{r: policy.replay(rounds[r].rollouts[k]) for r in self._used(rounds, k)}
                    for k in range(self.cfg.grpo.minibatches)]

    # ------------------------------------------------------------------ learn
    def learn(self, scored: Scored, proximal: Optional[Proximal], done: int) -> Learned:
        g = self.cfg.grpo
        self.objective.records = []
        out = Learned(records=self.objective.records, first_records=0)
        for epoch in range(g.epochs):
            for k in range(g.minibatches):
                with self.timers("replay"):
                    t0 = time.perf_counter()
                    used = self._used(scored.rounds, k)
                    if epoch == 0 and k == 0:
                        replays = self.first_values(scored, used, proximal, done, out)
                    else:
                        # Fresh caches under the current parameters (after the previous update); a
                        # round's minibatch is replayed as it was sampled, its batches together.
                        policy = self.policy.sampler()
                        replays = {r: policy.replay(scored.rounds[r].rollouts[k]) for r in used}
                batches = self._minibatch(scored, k, replays, None if proximal is None else proximal[k])
                if self.teacher is not None:
                    with self.timers("teacher"):
                        self.teacher.score(batches)
                with self.timers("update"):
                    out.stats.append(self.engine.train_step(batches, self.objective))
                out.seconds += time.perf_counter() - t0
                if epoch == 0 and k == 0:
                    out.first_records = len(self.objective.records) if self.dims.is_loss_rank else 0
                out.rollouts.extend(p.rollout for b in batches for p in b["parts"])
        return out

    def first_values(self, scored: Scored, used: list[int], proximal: Optional[Proximal], done: int,
                     out: Learned) -> dict[int, list]:
        """The hybrid's values on the step's first minibatch (epoch 0, minibatch 0).

        At lag 0 they are mu itself (grpo.skip_onpolicy_replay): every round of the step was
        sampled before the step's first optimizer step, and the first minibatch is learned
        before it, so the replay would run the rollout's own schedule with the rollout's own
        parameters, torch.equal to mu by the exactness contract (Sampler.replay). That holds on
        every layout: under data parallelism each replica learns its own rollouts; under
        grad_accum (and the pipeline's pieces) the minibatch's batches accumulate into one step,
        taken after all of them; dynamic sampling's rounds all come before it; only minibatches
        k > 0 and epochs > 0 follow an update, and they are replayed. As the replay, the value
        is on the last pipeline stage only (None on the others, which compute no loss).
        At a stale step: the proximal replays (the same parameters), or a replay.

        grpo.verify_onpolicy replays it under its sampling version and fails, on every rank
        together, if that is not torch.equal to mu (``verify``)."""
        g, rounds = self.cfg.grpo, scored.rounds
        if proximal is not None:
            values = {r: proximal[0][r] for r in used}  # the same parameters: the same values
        elif scored.lag == 0 and g.skip_onpolicy_replay:
            last = self.dims.is_last_stage
            values = {r: [ro.mu if last else None for ro in rounds[r].rollouts[0]] for r in used}
            out.first_replayed = g.verify_onpolicy  # unchecked, its ratios are mu - mu: not a measurement
        else:
            policy = self.policy.sampler()
            values = {r: policy.replay(rounds[r].rollouts[0]) for r in used}
        if g.verify_onpolicy:
            out.onpolicy_checked = self.verify(scored, used, done)
        return values

    def verify(self, scored: Scored, used: list[int], done: int) -> bool:
        """The first minibatch replayed under the versions that sampled it, torch.equal to mu on
        every rank, or a RuntimeError naming the step and max |replay - mu| -> False when the
        learner does not hold those versions (a run resumed from a checkpoint written without
        grpo.verify_onpolicy: the check resumes with the next data steps it samples)."""
        item = scored.item
        versions = {v for r in used for ro in scored.rounds[r].rollouts[0] if ro.version is not None
                    for v in ro.version[ro.mask.bool()].unique().tolist()}
        versions = ({item.version} | versions) - {done}  # the live version needs no copy
        if not self.history.holds(versions):
            if not self._warned_unkept:
                log.warning("GRPO step %d: grpo.verify_onpolicy: the policy versions %s that sampled this step are "
                            "not kept (the checkpoint did not hold them); the steps that learn them are not checked",
                            done, sorted(versions - set(self.history.kept)))
                self._warned_unkept = True
            return False
        sampler = self.policy.sampler()
        holder = KeptVersions(sampler.model, self.history.kept, done)
        worst = 0.0
        try:
            for r in used:
                rollouts = scored.rounds[r].rollouts[0]
                for ro, rep in zip(rollouts, sampler.replay(rollouts, load=holder.load)):
                    if rep is not None:
                        worst = max(worst, onpolicy_deviation(rep, ro.mu))
        finally:
            holder.restore()
        # Every rank learns whether one failed, so that none is left waiting in a collective.
        worst = float(self.dims.all_reduce(torch.tensor([worst], dtype=torch.float64, device=self.dims.device),
                                           op="max").item())
        if worst != 0.0:
            raise RuntimeError(
                f"GRPO step {done}: grpo.verify_onpolicy: the replay of the first minibatch under the policy version "
                f"that sampled it ({item.version}) is not torch.equal to mu, max |replay - mu| = {worst:.3e}: the "
                "replay does not repeat the sampler's schedule bit for bit, so the on-policy ratios are not exactly "
                "1 and skipping the replay (grpo.skip_onpolicy_replay) would hide it; report it with the config")
        return True

    def _minibatch(self, scored: Scored, k: int, replays: dict[int, list],
                   proximal: Optional[dict[int, list]]) -> list[dict]:
        """Minibatch k as the engine's batches: batch j holds batch (k, j) of every round that
        kept one of its rows (round 0's, carrying no loss, if none did: the engine steps over a
        fixed number of batches). proximal: minibatch k's replays under the step's starting
        parameters, by round (a stale step under grpo.is_correction), else None."""
        g, cut, rounds = self.cfg.grpo, self.cut, scored.rounds
        batches = []
        for j in range(len(rounds[0].rollouts[k])):
            parts = []
            for r, rnd in enumerate(rounds):
                keep = cut.batches(list(row_keep(rnd, g.group_size, g.mask_truncated).unbind(0)), k)[j]
                if not any(bool(x) for x in keep):
                    continue
                adv = cut.batches(list(scored.advantages[r].unbind(0)), k)[j]
                ref = None if (rnd.refs is None or g.kl_in_reward) else rnd.refs[k][j]
                parts.append(GRPOPart(rnd.rollouts[k][j], replays[r][j], torch.stack(adv), ref, torch.stack(keep),
                                      None if proximal is None else proximal[r][j]))
            if not parts:  # no round kept a row of this batch: round 0's, carrying no loss
                r = min(replays)
                ro = rounds[r].rollouts[k][j]
                parts.append(GRPOPart(ro, replays[r][j], torch.zeros(ro.batch_size), None,
                                      torch.zeros(ro.batch_size, dtype=torch.bool)))
            batches.append(grpo_batch(parts))
        return batches


def onpolicy_deviation(replay: torch.Tensor, mu: torch.Tensor) -> float:
    """max |replay - mu| over (B, N), 0.0 exactly when torch.equal; inf where one side is
    non-finite and the other is not (or both are but differ), so a NaN is never a 0."""
    if torch.equal(replay, mu):
        return 0.0
    replay, mu = replay.double(), mu.to(device=replay.device, dtype=torch.float64)
    same = (replay == mu) | (torch.isnan(replay) & torch.isnan(mu))
    diff = torch.where(same, torch.zeros_like(replay), (replay - mu).abs())
    return float(torch.nan_to_num(diff, nan=float("inf"), posinf=float("inf")).max())
