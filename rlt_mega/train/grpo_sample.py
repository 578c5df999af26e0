"""GRPO's sample phase (docs/design.md, "GRPO"): data step j's prompts x completions, generated
and rewarded -> ``Generated`` (train/async_grpo.py), the input of the learner's phases
(train/grpo_learn.py). It runs wherever sampling runs: on the job's own ranks (colocated,
``ColocatedSource``) or on a sampler role's (``run_sampler``); either way data step j draws the
same prompts, seeds and order. ``Policy`` is the model it samples with.

A round is prompts_per_step prompts x group_size completions per replica, generated as the
step's minibatches of rollout batches, each minibatch's batches in flight together
(docs/design.md, "Granularity"), then rewarded once per replica (a reward function that raises
scores 0, counted). Dynamic sampling draws rounds until prompts_per_step informative groups are
kept (train/grpo_rounds.py): rewards are part of sampling because they decide the rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from rlt_mega.config import Config
from rlt_mega.data.datasets import RecordOrder
from rlt_mega.data.pairs import prompt_ids
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.log import get_logger
from rlt_mega.metrics import Timers
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import Engine
from rlt_mega.rollout import Comms, Rollout, Sampler, SamplingParams
from rlt_mega.rollout.env import Environments
from rlt_mega.rollout.rewards import RewardFn, score
from rlt_mega.rollout.shaping import overlong_penalties
from rlt_mega.schedule.rows import RowSwitches
from rlt_mega.train.async_grpo import DataStepVersions, Generated, VersionPlan
from rlt_mega.train.common import max_new_tokens_for
from rlt_mega.train.grpo_rounds import Round, keep_all, keep_informative
from rlt_mega.train.grpo_settings import RowCut, request_seeds

log = get_logger(__name__)


@dataclass
class Policy:
    """The engine's current policy as something to sample and replay with: ``module()`` is its
    sampling module (under ZeRO-3 a gathered copy, refreshed: a collective on every rank),
    ``sampler()`` a Sampler on it."""

    engine: Engine
    comms: Comms
    dims: ParallelDims
    check_every: int
    rows: RowSwitches

    def module(self) -> nn.Module:
        return self.engine.sampling_module()

    def sampler(self, module: Optional[nn.Module] = None) -> Sampler:
        """A Sampler on ``module`` (default: the current parameters)."""
        return Sampler(module if module is not None else self.module(), self.comms, self.dims.layers,
                       check_every=self.check_every, rows=self.rows)


class SamplePhase:
    """Data steps of ``records`` in ``order`` (its state advances with each data step sampled or
    skipped); ``params`` the sampling parameters, ``envs`` grpo.env's environments (or None).

    ``shares``: the data-parallel ranks of the learner whose rows this rank samples, of ``dp``:
    colocated, its own replica's; on a sampler role every rank of the learner's (sampled one
    after the other, each exactly as that replica would colocated: its prompts, seeds, batches).
    A data step reserves its prompts before sampling: max_sampling_rounds global batches of
    prompts_per_step x dp under dynamic sampling (a round that is not needed leaves its batch
    unused), one without; so the data each step sees is a function of the step, never of how
    many rounds another step needed nor of which sampler ran it."""

    def __init__(self, cfg: Config, dims: ParallelDims, tokenizer: Tokenizer, records, order: RecordOrder,
                 reward_fn: RewardFn, params: SamplingParams, envs: Optional[Environments], timers: Timers,
                 shares: Optional[list[int]] = None, dp: Optional[int] = None) -> None:
        self.cfg, self.dims, self.tokenizer, self.records, self.order = cfg, dims, tokenizer, records, order
        self.reward_fn, self.params, self.envs, self.timers = reward_fn, params, envs, timers
        self.shares, self.dp = shares if shares is not None else [dims.dp_rank], dp or dims.dp
        g = cfg.grpo
        self.cut = RowCut.of(cfg)
        self.plan = VersionPlan(g.max_staleness, g.partial_rollouts, cfg.model.memory_block)

    def sample(self, sampler: Sampler, data_step: int, holder) -> list[Generated]:
        """Data step ``data_step``'s samples, one per share; ``holder`` makes the sampling
        module's parameters each policy version its calls need (``KeptVersions`` colocated,
        ``ReceivedVersions`` on a sampler role), restored afterwards."""
        versions = {d: DataStepVersions(data_step, self.plan, holder) for d in self.shares}
        try:
            rounds, sampling, seconds = self._rounds(sampler, data_step, versions)
        finally:
            holder.restore()
        order = self.order.state_dict()
        return [Generated(data_step, versions[d].start, rounds[d], sampling[d], t_generate=seconds, order=order)
                for d in self.shares]

    def skip(self, data_step: int) -> None:
        """Another sampler's data step (grpo.sampler_replicas > 1): its prompts are reserved."""
        self._reserve()

    def _reserve(self) -> list[list[int]]:
        """The data step's prompts: [round] the global batch's record indices (share d's are
        every dp-th from d, as ``RecordOrder.take`` strides them)."""
        g = self.cfg.grpo
        return [self.order.take(g.prompts_per_step * self.dp) for _ in range(self._reserved_rounds())]

    def _reserved_rounds(self) -> int:
        g = self.cfg.grpo
        return g.max_sampling_rounds if g.dynamic_sampling else 1

    def _rounds(self, sampler: Sampler, done: int, versions: dict[int, DataStepVersions]):
        """The step's rounds (one, or dynamic sampling's) for each share, their kept groups
        marked -> ({share: rounds}, {share: dynamic sampling's counts}, seconds generating)."""
        g, dims = self.cfg.grpo, self.dims
        rounds: dict[int, list[Round]] = {d: [] for d in self.shares}
        kept, seconds = dict.fromkeys(self.shares, 0), 0.0
        for round_, batch in enumerate(self._reserve()):
            for d in self.shares:
                rows = [self.records[i] for i in batch[d::self.dp] for _ in range(g.group_size)]
                rollouts, t = self._generate(sampler, rows, done, round_, d, versions[d])
                rnd = self._reward(rows, rollouts, done, round_, d)
                rounds[d].append(rnd)
                seconds += t
                if g.dynamic_sampling:
                    kept[d] += keep_informative(rnd, g.group_size, g.prompts_per_step - kept[d])
                else:
                    keep_all(rnd, g.group_size)
                    kept[d] = g.prompts_per_step
            # Every share samples as many rounds as the neediest (the same rounds on every rank).
            short = torch.tensor([float(min(kept.values()) < g.prompts_per_step)], device=dims.device)
            if not g.dynamic_sampling or not dims.all_reduce(short, op="max", axis="dp").item():
                break
        return rounds, {d: self._counts(done, len(rounds[d]), kept[d]) for d in self.shares}, seconds

    def _counts(self, done: int, num_rounds: int, kept: int) -> dict[str, float]:
        g = self.cfg.grpo
        if kept < g.prompts_per_step:
            log.warning("GRPO step %d: dynamic sampling kept %d informative groups of the %d wanted in %d rounds "
                        "(grpo.max_sampling_rounds); the step learns from those", done, kept, g.prompts_per_step,
                        num_rounds)
        drawn = num_rounds * g.prompts_per_step
        return {"sampling/prompts_drawn": float(drawn), "sampling/groups_dropped": float(drawn - kept),
                "sampling/groups_kept": float(kept), "sampling/rounds": float(num_rounds)}

    def _generate(self, sampler: Sampler, rows: list[dict], done: int, round_: int, share: int,
                  versions: DataStepVersions) -> tuple[list[list[Rollout]], float]:
        """The rows' completions -> ([minibatch][batch] rollouts, seconds)."""
        g, cut = self.cfg.grpo, self.cut
        prompts = [prompt_ids(self.tokenizer, r["question"]) for r in rows]
        seeds = request_seeds(self.cfg.train.seed, done, share, len(rows), round_, self.dp, g.group_size)
        episodes = None if self.envs is None else self.envs.episodes(rows)  # one per row, from its record
        with self.timers("generate"):
            t0 = time.perf_counter()
            rollouts = []
            for k in range(g.minibatches):
                batches = cut.batches(prompts, k)
                params = [max_new_tokens_for(sampler.model, b, self.params) for b in batches]
                rollouts.append(sampler.generate(batches, params, cut.batches(seeds, k), pad_id=self.tokenizer.pad_id,
                                                 dtype=self.cfg.train.dtype, decode=self.tokenizer.decode,
                                                 episodes=None if episodes is None else cut.batches(episodes, k),
                                                 **versions.call()))
            return rollouts, time.perf_counter() - t0

    def _reward(self, rows: list[dict], rollouts: list[list[Rollout]], done: int, round_: int, share: int) -> Round:
        """Rewards, on the replica's source rank, shared over the replica; overlong penalties."""
        dims, g = self.dims, self.cfg.grpo
        flat = [ro for mb in rollouts for ro in mb]
        with self.timers("score"):
            scores, failures, nonfinite = None, 0, 0
            if dims.is_replica_source:
                texts = [self.tokenizer.decode(ro.completion(b)) for ro in flat for b in range(ro.batch_size)]
                ids = [f"step{done}/round{round_}/dp{share}/row{i}" for i in range(len(rows))]
                scores, failures, nonfinite = score(texts, [r["answer"] for r in rows], ids, self.reward_fn)
            scores, failures, nonfinite = dims.share_in_replica((scores, failures, nonfinite))
            lengths = [n for ro in flat for n in ro.completion_lens]
            penalties = overlong_penalties(lengths, self.cfg.sampling.max_new_tokens, g.overlong_buffer,
                                           g.overlong_penalty)
        return Round(rows, rollouts, scores, penalties, failures, nonfinite)
