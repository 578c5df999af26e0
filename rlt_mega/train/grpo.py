"""The GRPO job (docs/design.md, "GRPO"), colocated: every data-parallel replica samples its own
prompts with its learner's layout (one process, or TP x PP, the pipeline's sampler ring) and
learns from them through the engine (local, or DeepSpeed ZeRO over the data-parallel group).
The loop is the one of every job (train/loop.py); this module is the job and its set-up.

One step, as named phases (each timed into the metrics), after the staleness pipeline
(train/async_grpo.py, grpo.max_staleness) has sampled what the step needs (colocated) or
received it (a sampler role, grpo.sampler_replicas) and handed it the data step to learn:

    generate    prompts_per_step x group_size completions per replica, each minibatch as
                grad_accum (x pipeline pieces) rollout batches sampled together (in flight in
                the pipeline ring); each is later replayed and learned as its own batch
                (docs/design.md, "Granularity")
    score       rewards, once per replica (a reward function that raises scores 0, counted)
    advantages  group advantages (grpo / dr_grpo)
    reference   frozen-reference log-probs (only with grpo.kl_coef > 0), by replay
    proximal    a stale step under grpo.is_correction: every minibatch replayed with the step's
                starting parameters, the proximal policy (learner/correction.py)
    replay      per minibatch: the rollouts' own schedule with the current parameters (skipped on
                the first minibatch, whose value is mu bit for bit: grpo.skip_onpolicy_replay,
                grpo.verify_onpolicy, ``GRPOJob._onpolicy_values``)
    update      per minibatch: hybrid log-probs (value = replay, gradient = dense), the clipped
                surrogate over the global completion-token count, one optimizer step;
                epochs x minibatches in all

train.grad_accum: a minibatch (one optimizer step) is learned as grad_accum batches, each
its own rollout batch, gradients accumulated (it bounds the dense schedule's activation
memory, rows x positions); under pipeline parallelism parallel.micro_batches of them run in
flight (dims.micro_batch_plan). What GRPO derives is derived in one place, ``grpo_config`` and
``engine_config`` below: train.micro_batch_size (a minibatch's rows / grad_accum; a different
value set by the user is an error) and the engine's optimizer steps (train.steps counts GRPO
steps, each epochs x minibatches optimizer steps).

Metrics (TensorBoard + metrics.jsonl, from rank 0, reduced over every rank): reward, accuracy,
ratio min/mean/max, clip fraction, support misses, max/mean |dense - replay|, KL(mu || dense),
rollout and learner tokens/s, phase times, held-out greedy accuracy. ``ratio/onpolicy_max_dev``
is max |ratio - 1| on the first minibatch of each step, exactly 0 by the exactness contract;
it is logged only when that replay ran (grpo.skip_onpolicy_replay=false or grpo.verify_onpolicy):
skipped, the ratio would be mu - mu, 0 by construction, which reads as a check that passed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlt_mega.config import Config, ConfigError, given
from rlt_mega.data.datasets import PROMPT_COLUMNS, DataStats, prompt_record, train_eval_records
from rlt_mega.data.pairs import RecordOrder, fitting_prompts, prompt_ids
from rlt_mega.data.tokenizer import Tokenizer, load_tokenizer
from rlt_mega.learner.correction import Correction
from rlt_mega.learner.distill import Teacher, distill_step_metrics
from rlt_mega.learner.grpo import group_advantages
from rlt_mega.learner.objective import GRPOObjective, GRPOPart, LossSettings, grpo_batch
from rlt_mega.log import get_logger
from rlt_mega.metrics import Timers
from rlt_mega.checkpoint import CheckpointManager
from rlt_mega.determinism import configure as configure_determinism
from rlt_mega.parallel.dims import ParallelDims, init_distributed, micro_batch_plan
from rlt_mega.parallel.roles import RoleChannel
from rlt_mega.parallel.engine import Engine, EngineConfig
from rlt_mega.precision import mean_metrics
from rlt_mega.parallel.launch import launch
from rlt_mega.rollout import Comms, Rollout, Sampler
from rlt_mega.schedule.rows import RowSwitches
from rlt_mega.rollout.env import EnvLimits, Environments, resolve_env
from rlt_mega.rollout.rewards import RewardFn, resolve_reward, score
from rlt_mega.rollout.shaping import overlong_penalties
from rlt_mega.train.async_grpo import (ColocatedSource, DataStepVersions, Generated, KeptVersions, RemoteSource,
                                      StalenessPipeline, flat_parameters, queue_types, run_sampler)
from rlt_mega.train.builders import build_engine, build_teacher, check_vocab, reference_model
from rlt_mega.rollout.evaluation import metric_names
from rlt_mega.train.common import greedy_accuracy, max_new_tokens_for, sampled_scores, sampling_params
from rlt_mega.train.grpo_metrics import reduce_step_metrics
from rlt_mega.train.grpo_rounds import Round, keep_all, keep_informative, row_keep, row_kl_sums
from rlt_mega.train.loop import Interval, StepFailed, StopAfter, Trainer
from rlt_mega.train.supervised import phase_timers

log = get_logger(__name__)


@dataclass
class GRPOState:
    updates: int = 0  # optimizer steps
    completions: int = 0  # over every replica
    nonfinite_total: int = 0
    accuracy_before: Optional[float] = None
    nonfinite_reward_in_a_row: int = 0  # steps whose reward function returned NaN or an infinity


class GRPOJob:
    """``sampler()`` returns the Sampler of this rank's part of the policy with its current
    parameters (called at each phase that needs them: under ZeRO-3 it refreshes a copy);
    ``reference``, when set, the frozen reference's Sampler in the same layout. ``cfg`` is
    ``grpo_config``'s (train.micro_batch_size derived)."""

    name = "grpo"
    eval_at_start = True  # the held-out accuracy before GRPO

    def __init__(self, cfg: Config, dims: ParallelDims, engine: Engine, sampler: Callable[[], Sampler],
                 tokenizer: Tokenizer, train_records, eval_records, reward_fn: RewardFn, timers: Timers,
                 reference: Optional[Sampler] = None, teacher: Optional[Teacher] = None) -> None:
        self.cfg, self.dims, self.engine, self.sampler, self.tokenizer = cfg, dims, engine, sampler, tokenizer
        self.teacher = teacher  # grpo.teacher: scores each learned batch (learner/distill.py)
        self.train_records, self.eval_records, self.reward_fn = train_records, eval_records, reward_fn
        self.timers, self.reference = timers, reference
        self.order = RecordOrder(len(train_records), cfg.train.seed, cfg.data.shuffle)
        self.params = sampling_params(cfg, tokenizer)
        self.state = GRPOState()
        g = cfg.grpo
        self.eval_every = Interval(g.eval_every, at_end=True)  # 0: the first and the last step only
        self.rows_per_step = g.prompts_per_step * g.group_size  # per replica
        self.minibatch_rows = self.rows_per_step // g.minibatches
        self.batch_rows = self.minibatch_rows // batches_per_minibatch(cfg)
        self.objective = GRPOObjective(settings=loss_settings(cfg))
        self.pipeline = StalenessPipeline(g.max_staleness, (dims.dp, dims.tp, dims.pp, dims.rank), g.partial_rollouts)
        # Where samples come from: this job's own ranks, or a sampler role (set by run_roles).
        self.source: ColocatedSource | RemoteSource = ColocatedSource(lambda data_step, done: self.sample_step(
            data_step, KeptVersions(self.engine.sampling_module(), *self._kept)))
        # Partial rollouts: this rank's parameters of version steps_done - 1 (flat), which the next
        # step's rollouts start under (train/async_grpo.py); in the rank's checkpoint.
        self.previous: Optional[torch.Tensor] = None
        self._kept: tuple[dict, int] = ({}, 0)
        self._versions: Optional[DataStepVersions] = None
        self.steps_done = 0  # steps done (what a save's queue continues from)
        self._t_generate = 0.0
        self.envs = environments(cfg, tokenizer)
        if self.envs is not None:
            stops = self.envs.stop_ids(self.params.stop_token_ids)  # a turn end that hands over does not stop
            self.params = dataclasses.replace(self.params, stop_token_ids=stops)

    # ------------------------------------------------------------------ one step
    def _batches(self, items: list, k: int) -> list[list]:
        """Minibatch k of a per-replica row list, as its rollout batches."""
        mb = items[k * self.minibatch_rows:(k + 1) * self.minibatch_rows]
        return [mb[i:i + self.batch_rows] for i in range(0, len(mb), self.batch_rows)]

    def _sample_round(self, sampler: Sampler, done: int, round_: int) -> Round:
        """prompts_per_step fresh prompts x group_size completions, generated and scored."""
        g, dims = self.cfg.grpo, self.dims
        records = [self.train_records[i] for i in self.order.take(g.prompts_per_step, dims.dp_rank, dims.dp)]
        rows = [r for r in records for _ in range(g.group_size)]  # the G completions of a prompt are contiguous
        prompts = [prompt_ids(self.tokenizer, r["question"]) for r in rows]
        seeds = request_seeds(self.cfg.train.seed, done, dims.dp_rank, len(rows), round_)
        episodes = None if self.envs is None else self.envs.episodes(rows)  # one per row, from its record
        with self.timers("generate"):
            t0 = time.perf_counter()
            rollouts: list[list[Rollout]] = []  # [minibatch][batch]
            for k in range(g.minibatches):
                batches = self._batches(prompts, k)
                params = [max_new_tokens_for(sampler.model, b, self.params) for b in batches]
                rollouts.append(sampler.generate(batches, params, self._batches(seeds, k),
                                                 pad_id=self.tokenizer.pad_id, dtype=self.cfg.train.dtype,
                                                 decode=self.tokenizer.decode,
                                                 episodes=None if episodes is None else self._batches(episodes, k),
                                                 **self._versions.call()))
            self._t_generate += time.perf_counter() - t0
        flat = [ro for mb in rollouts for ro in mb]
        with self.timers("score"):
            scores, failures, nonfinite = None, 0, 0
            if dims.is_replica_source:
                texts = [self.tokenizer.decode(ro.completion(b)) for ro in flat for b in range(ro.batch_size)]
                ids = [f"step{done}/round{round_}/dp{dims.dp_rank}/row{i}" for i in range(len(rows))]
                scores, failures, nonfinite = score(texts, [r["answer"] for r in rows], ids, self.reward_fn)
            scores, failures, nonfinite = dims.share_in_replica((scores, failures, nonfinite))
            lengths = [n for ro in flat for n in ro.completion_lens]
            penalties = overlong_penalties(lengths, self.cfg.sampling.max_new_tokens, g.overlong_buffer,
                                           g.overlong_penalty)
        return Round(rows, rollouts, scores, penalties, failures, nonfinite)

    def sample_step(self, data_step: int, versions) -> Generated:
        """Data step ``data_step``'s samples; ``versions`` makes the sampling module's parameters
        each policy version its calls need (train/async_grpo.py: ``KeptVersions`` colocated,
        ``ReceivedVersions`` on a sampler role)."""
        g = self.cfg.grpo
        self._versions = DataStepVersions(data_step, g.max_staleness, g.partial_rollouts, self.cfg.model.memory_block,
                                          versions)
        self._t_generate = 0.0
        try:
            rounds, sampling = self._sample(data_step)
        finally:
            versions.restore()
        return Generated(data_step, self._versions.start, rounds, sampling, t_generate=self._t_generate,
                         order=self.order.state_dict())

    def skip_step(self, data_step: int) -> None:
        """Another sampler's data step (grpo.sampler_replicas > 1): the data order advances as
        sampling it would (one round: dynamic sampling is refused with several samplers)."""
        self.order.take(self.cfg.grpo.prompts_per_step, self.dims.dp_rank, self.dims.dp)

    def _sample(self, done: int) -> tuple[list[Round], dict[str, float]]:
        """The step's rounds (one, or dynamic sampling's), their kept groups marked."""
        g, dims = self.cfg.grpo, self.dims
        sampler = self.sampler()
        rounds: list[Round] = []
        kept = 0
        for round_ in range(g.max_sampling_rounds if g.dynamic_sampling else 1):
            rnd = self._sample_round(sampler, done, round_)
            rounds.append(rnd)
            if not g.dynamic_sampling:
                keep_all(rnd, g.group_size)
                kept = g.prompts_per_step
                break
            kept += keep_informative(rnd, g.group_size, g.prompts_per_step - kept)
            # Every replica samples as many rounds as the neediest (its data order stays the same).
            short = torch.tensor([float(kept < g.prompts_per_step)], device=dims.device)
            if not dims.all_reduce(short, op="max", axis="dp").item():
                break
        if kept < g.prompts_per_step:
            log.warning("GRPO step %d: dynamic sampling kept %d informative groups of the %d wanted in %d rounds "
                        "(grpo.max_sampling_rounds); the step learns from those", done, kept, g.prompts_per_step,
                        len(rounds))
        drawn = len(rounds) * g.prompts_per_step
        return rounds, {"sampling/prompts_drawn": float(drawn), "sampling/groups_dropped": float(drawn - kept),
                        "sampling/groups_kept": float(kept), "sampling/rounds": float(len(rounds))}

    def _reference(self, rounds: list[Round]) -> None:
        """The frozen reference's replay of every batch the step learns from; under
        grpo.kl_in_reward also each row's KL penalty, shared over the model replica."""
        g, dims = self.cfg.grpo, self.dims
        for rnd in rounds:
            rnd.refs = [self.reference.replay(mb) if self._learns_from(rnd, k) else [None] * len(mb)
                        for k, mb in enumerate(rnd.rollouts)]
            if g.kl_in_reward:
                sums = torch.cat([row_kl_sums(ro, ref if dims.is_loss_rank else None, g.kl_estimator)
                                  for mb, refs in zip(rnd.rollouts, rnd.refs) for ro, ref in zip(mb, refs)])
                # Only the loss rank (the last stage, TP rank 0) has the reference's values.
                sums = dims.all_reduce(sums.to(dims.device), axis="mp").cpu()
                rnd.kl_penalties = g.kl_coef * sums

    def _learns_from(self, rnd: Round, k: int) -> bool:
        g = self.cfg.grpo
        groups = self.minibatch_rows // g.group_size
        return bool(rnd.group_keep[k * groups:(k + 1) * groups].any())

    def _minibatch(self, rounds: list[Round], k: int, advantages: list[torch.Tensor],
                   replays: dict[int, list], proximal: Optional[dict[int, list]] = None) -> list[dict]:
        """Minibatch k as the engine's batches: batch j holds batch (k, j) of every round that
        kept one of its rows (round 0's, carrying no loss, if none did: the engine steps over a
        fixed number of batches). proximal: minibatch k's replays under the step's starting
        parameters, by round (a stale step under grpo.is_correction), else None."""
        g = self.cfg.grpo
        batches = []
        for j in range(len(rounds[0].rollouts[k])):
            parts = []
            for r, rnd in enumerate(rounds):
                keep = self._batches(list(row_keep(rnd, g.group_size, g.mask_truncated).unbind(0)), k)[j]
                if not any(bool(x) for x in keep):
                    continue
                adv = self._batches(list(advantages[r].unbind(0)), k)[j]
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

    def _proximal(self, rounds: list[Round]) -> list[dict[int, list]]:
        """[minibatch][round] the replays of a stale step's rollouts under the parameters it
        starts with (the proximal policy of learner/correction.py), taken before its first update;
        None on a rank without the loss (under pipeline parallelism only the last stage has them)."""
        policy = self.sampler()
        out = []
        for k in range(self.cfg.grpo.minibatches):
            used = [r for r, rnd in enumerate(rounds) if self._learns_from(rnd, k)] or [0]
            out.append({r: policy.replay(rounds[r].rollouts[k]) for r in used})
        return out

    def _onpolicy_values(self, rounds: list[Round], used: list[int], done: int) -> dict[int, list]:
        """The hybrid's values on the step's first minibatch (epoch 0, minibatch 0): mu itself.

        Why it is exact: every round of the step was sampled before the step's first optimizer
        step, and the first minibatch is learned before it, so the replay would run the
        rollout's own schedule with the rollout's own parameters, torch.equal to mu by the
        exactness contract (Sampler.replay). That holds on every layout: under data
        parallelism each replica learns its own rollouts; under grad_accum (and the pipeline's
        pieces) the minibatch's batches accumulate into one step, taken after all of them;
        dynamic sampling's rounds all come before it; only minibatches k > 0 and epochs > 0
        follow an update, and they are replayed. As the replay, the value is on the last
        pipeline stage only (None on the others, which compute no loss).

        grpo.verify_onpolicy replays all the same and fails, on every rank together, if the
        replay is not torch.equal to mu."""
        last = self.dims.is_last_stage
        values = {r: [ro.mu if last else None for ro in rounds[r].rollouts[0]] for r in used}
        if self.cfg.grpo.verify_onpolicy:
            policy = self.sampler()
            worst = 0.0
            for r in used:
                for ro, rep in zip(rounds[r].rollouts[0], policy.replay(rounds[r].rollouts[0])):
                    if rep is not None:
                        worst = max(worst, onpolicy_deviation(rep, ro.mu))
            # Every rank learns whether one failed, so that none is left waiting in a collective.
            worst = float(self.dims.all_reduce(torch.tensor([worst], dtype=torch.float64, device=self.dims.device),
                                               op="max").item())
            if worst != 0.0:
                raise RuntimeError(
                    f"GRPO step {done}: grpo.verify_onpolicy: the replay of the first minibatch (the rollout's own "
                    f"parameters) is not torch.equal to mu, max |replay - mu| = {worst:.3e}: the replay does not "
                    "repeat the sampler's schedule bit for bit, so the on-policy ratios are not exactly 1 and "
                    "skipping the replay (grpo.skip_onpolicy_replay) would hide it; report it with the config")
        return values

    def step(self, done: int) -> dict[str, float]:
        g, dims = self.cfg.grpo, self.dims
        t_step = time.perf_counter()
        # The staleness pipeline (train/async_grpo.py): colocated, sample with version ``done``
        # every data step up to done + max_staleness not yet queued; with a sampler role, receive
        # data step ``done``. Then learn data step ``done``.
        current = None
        if g.partial_rollouts:  # versions done - 1 and done: the partial rollouts sampled now switch between them
            current = flat_parameters(self.engine.sampling_module())
            self._kept = ({v: x for v, x in ((done - 1, self.previous), (done, current)) if x is not None}, done)
        else:
            self._kept = ({}, done)
        t_fill = self.source.fill(self.pipeline, done)
        self.previous, self._kept = current, ({}, done)
        generated = self.pipeline.pop(done)
        rounds, sampling, lag = generated.rounds, generated.sampling, generated.lag(done)
        if self.reference is not None:
            with self.timers("reference"):
                self._reference(rounds)
        with self.timers("advantages"):
            advantages = [group_advantages(rnd.rewards().float(), g.group_size, g.advantage, g.advantage_eps)
                          for rnd in rounds]

        proximal = None
        if lag and g.is_correction != "none":
            with self.timers("proximal"):  # every minibatch under the step's starting parameters
                proximal = self._proximal(rounds)

        self.objective.records = []
        step_stats = []
        t_learn = 0.0
        first_records = 0
        learned: list[Rollout] = []
        for epoch in range(g.epochs):
            for k in range(g.minibatches):
                t0 = time.perf_counter()
                with self.timers("replay"):
                    used = [r for r, rnd in enumerate(rounds) if self._learns_from(rnd, k)] or [0]
                    if epoch == 0 and k == 0 and proximal is not None:
                        replays = {r: proximal[k][r] for r in used}  # the same parameters: the same values
                    elif epoch == 0 and k == 0 and g.skip_onpolicy_replay and lag == 0:
                        replays = self._onpolicy_values(rounds, used, done)
                    else:
                        # Fresh caches under the current parameters (after the previous update); a
                        # round's minibatch is replayed as it was sampled, its batches together.
                        policy = self.sampler()
                        replays = {r: policy.replay(rounds[r].rollouts[k]) for r in used}
                batches = self._minibatch(rounds, k, advantages, replays,
                                          None if proximal is None else proximal[k])
                if self.teacher is not None:
                    with self.timers("teacher"):
                        self.teacher.score(batches)
                with self.timers("update"):
                    stats = self.engine.train_step(batches, self.objective)
                t_learn += time.perf_counter() - t0
                if epoch == 0 and k == 0:
                    first_records = len(self.objective.records) if dims.is_loss_rank else 0
                learned.extend(p.rollout for b in batches for p in b["parts"])
                step_stats.append(stats)
                self.state.updates += 1
                self.state.nonfinite_total += int(stats.skipped)
                if stats.skipped:
                    log.warning("GRPO step %d, update %d: non-finite loss/gradient, skipped", done,
                                self.state.updates)

        scores = [x for rnd in rounds for x in rnd.scores]
        flat = [ro for rnd in rounds for ro in rnd.flat]
        src = 1.0 if dims.is_replica_source else 0.0
        per_row = {}  # replica sums, reported per sampled row
        if g.overlong_buffer:
            per_row["reward/overlong_penalty"] = src * sum(x for rnd in rounds for x in rnd.penalties)
        if g.kl_in_reward:
            per_row["kl/reward_penalty"] = src * sum(float(rnd.kl_penalties.sum()) for rnd in rounds)
        totals = {k: src * v for k, v in sampling.items()} if g.dynamic_sampling else {}  # over every replica
        totals["reward/nonfinite"] = src * sum(rnd.nonfinite for rnd in rounds)
        scalars = reduce_step_metrics(dims, scores, sum(rnd.failures for rnd in rounds), flat, self.objective.records,
                                      first_records=first_records, epochs=1,
                                      t_learn=t_learn, with_reference=self.reference is not None and not g.kl_in_reward,
                                      learned=learned, per_row=per_row, totals=totals, t_generate=generated.t_generate,
                                      with_correction=proximal is not None,
                                      lags={v: done - v for v in (generated.version, self._target(done))})
        self.steps_done = done + 1
        sync = self.source.after_step(self.steps_done, list(self.engine.sampling_module().parameters()))
        seconds = time.perf_counter() - t_step
        scalars.update({"async/learner_idle_fraction": t_fill / max(seconds, 1e-9),
                        "async/sampler_idle_fraction": self.source.sampler_idle_fraction(generated, seconds, t_fill),
                        "async/weight_sync_s": sync})
        if proximal is None and lag == 0 and g.skip_onpolicy_replay and not g.verify_onpolicy:
            # the on-policy minibatch was not replayed: its ratios are mu - mu = 0 by construction,
            # not a measurement; logged only when the replay ran (and was compared with mu)
            del scalars["ratio/onpolicy_max_dev"]
        scalars.update({
            "train/loss": sum(s.loss for s in step_stats) / len(step_stats),
            "train/grad_norm": max(s.grad_norm for s in step_stats),
            "train/lr": step_stats[-1].lr,
            "train/nonfinite_skipped": float(self.state.nonfinite_total),
            **mean_metrics([s.precision for s in step_stats]),  # bf16: the copy's lag (precision.py)
        })
        if self.teacher is not None:
            scalars.update(distill_step_metrics(dims, self.objective.records))
        self.state.completions += sum(len(rnd.rows) for rnd in rounds) * dims.dp
        self._check_rewards(scalars, done + 1)
        if self.envs is not None and (stop := self.envs.over_limit(scalars["env/faults"])):
            raise StepFailed(*stop, scalars)
        return scalars

    def _target(self, data_step: int) -> int:
        """The newest policy version data step ``data_step``'s tokens may come from."""
        return self._data_step_versions(data_step).target

    def _data_step_versions(self, data_step: int) -> DataStepVersions:
        g = self.cfg.grpo
        return DataStepVersions(data_step, g.max_staleness, g.partial_rollouts, self.cfg.model.memory_block, None)

    def _check_rewards(self, scalars: dict[str, float], step: int) -> None:
        """Counts the steps in a row whose reward function returned NaN or an infinity (the same
        figure on every rank: reduced over replicas); too many stop the run naming the function."""
        limit = self.cfg.grpo.max_nonfinite_reward_steps
        bad = scalars["reward/nonfinite"] > 0
        self.state.nonfinite_reward_in_a_row = self.state.nonfinite_reward_in_a_row + 1 if bad else 0
        if limit and self.state.nonfinite_reward_in_a_row >= limit:
            raise StepFailed(f"the reward function grpo.reward={self.cfg.grpo.reward} returned NaN or an infinity in "
                             f"{self.state.nonfinite_reward_in_a_row} steps in a row up to step {step} "
                             f"(grpo.max_nonfinite_reward_steps={limit}; {scalars['reward/nonfinite']:.0f} this step)",
                             "Fix the reward function (its warnings name the prompts), or raise "
                             "grpo.max_nonfinite_reward_steps (0: never stop).", scalars)

    def log_line(self, scalars: dict[str, float], seconds: float) -> dict[str, float]:
        return scalars

    def postfix(self, scalars: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{scalars['reward/mean']:.3f}", "loss": f"{scalars['train/loss']:.4f}"}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out greedy accuracy on the first grpo.eval_size records, each replica taking
        every dp-th of them (at step 0: the accuracy before GRPO); with eval.samples = n > 0
        also pass@k, maj@k and mean@n of n samples per problem (rlt_mega/rollout/evaluation.py)."""
        n = min(self.cfg.grpo.eval_size, len(self.eval_records))
        if n == 0:
            return {}
        dims = self.dims
        with self.timers("eval"):
            sampler = self.sampler()  # on every rank (a collective under ZeRO-3), records or not
            indices = list(range(dims.dp_rank, n, dims.dp))
            mine = [self.eval_records[i] for i in indices]
            accuracy, sampled = 0.0, {}
            if mine:
                accuracy, _ = greedy_accuracy(sampler, self.tokenizer, mine, self.cfg, self.cfg.train.dtype, self.envs)
            if self.cfg.eval.samples:
                names = metric_names(self.cfg.eval.samples, self.cfg.eval.k)
                sums = (sampled_scores(sampler, self.tokenizer, mine, indices, self.cfg, self.cfg.train.dtype,
                                       self.envs)
                        if mine else dict.fromkeys(names, 0.0))
                sampled = dict(zip(names, dims.sum_over_dp([sums[k] for k in names])))
            correct, total = dims.sum_over_dp([accuracy * len(mine), float(len(mine))])
            accuracy = correct / total
        if step == 0:
            self.state.accuracy_before = accuracy
        out = {"eval/accuracy": accuracy, **{k: v / total for k, v in sampled.items()}}
        shown = "".join(f", {k.removeprefix('eval/')} {v:.3f}" for k, v in out.items() if k != "eval/accuracy")
        log.info("GRPO step %d: held-out greedy accuracy %.3f%s (%d problems)", step, accuracy, shown, n)
        return out

    def result(self) -> dict:
        return {"eval/accuracy_before": self.state.accuracy_before}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The data order as the colocated run's at this point: after the last data step queued
        (with a sampler role, the steps the queue owes are received first, their order with them)."""
        self.source.complete(self.pipeline, self.steps_done)
        return {"state": asdict(self.state), "data": self.order.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.state = GRPOState(**state["state"])
        self.order.load_state_dict(state["data"])

    @property
    def rank_state_types(self) -> tuple:
        return queue_types()

    def rank_state_dict(self) -> dict:
        """This rank's own state: the staleness queue (train/async_grpo.py), complete (with a
        sampler role, the data steps it still owes are received first, so that the checkpoint
        resumes as the colocated run's would)."""
        self.source.complete(self.pipeline, self.steps_done)
        return {"pipeline": self.pipeline.state_dict(), "previous": self.previous}

    def load_rank_state_dict(self, state: Optional[dict], step: int) -> None:
        self.pipeline.load_state_dict(None if state is None else state["pipeline"], step)
        self.steps_done = step
        self.previous = None if state is None else state.get("previous")
        if self.cfg.grpo.partial_rollouts and step > 0 and self.previous is None:
            raise ConfigError(f"the checkpoint at step {step} holds no parameters of policy version {step - 1}, which "
                              f"grpo.partial_rollouts={self.cfg.grpo.partial_rollouts} starts the next rollouts under "
                              "(it was written without partial rollouts, or job_rank<r>.pt is missing): resume with "
                              "grpo.partial_rollouts=0 or start afresh")


# ---------------------------------------------------------------------- what GRPO derives
def onpolicy_deviation(replay: torch.Tensor, mu: torch.Tensor) -> float:
    """max |replay - mu| over (B, N), 0.0 exactly when torch.equal; inf where one side is
    non-finite and the other is not (or both are but differ), so a NaN is never a 0."""
    if torch.equal(replay, mu):
        return 0.0
    replay, mu = replay.double(), mu.to(device=replay.device, dtype=torch.float64)
    same = (replay == mu) | (torch.isnan(replay) & torch.isnan(mu))
    diff = torch.where(same, torch.zeros_like(replay), (replay - mu).abs())
    return float(torch.nan_to_num(diff, nan=float("inf"), posinf=float("inf")).max())


def request_seeds(seed: int, step: int, dp_rank: int, num: int, round_: int = 0) -> list[int]:
    """Per-request sampling seeds from (run seed, step, sampling round, global row): replicas
    and dynamic sampling's rounds draw independent samples, and a resumed run draws the same ones."""
    base = (seed * 1_000_003 + step) * 65_536 + dp_rank * num + round_ * 2 ** 40
    return [base + i for i in range(num)]


def loss_settings(cfg: Config) -> LossSettings:
    """The objective's settings from grpo.*: GSPO's own clip range under policy_loss=gspo, the
    KL as a loss term unless it is folded into the reward, Dr.GRPO's constant length
    defaulting to the budget of new tokens."""
    g = cfg.grpo
    gspo = g.policy_loss == "gspo"
    return LossSettings(eps_low=g.gspo_eps_low if gspo else g.eps_low, eps_high=g.gspo_eps_high if gspo else g.eps_high,
                        kl_coef=0.0 if g.kl_in_reward else g.kl_coef, loss=g.policy_loss, clip_ratio_c=g.clip_ratio_c,
                        kl_estimator=g.kl_estimator, loss_agg=g.loss_agg,
                        loss_agg_length=g.loss_agg_length or cfg.sampling.max_new_tokens, entropy_coef=g.entropy_coef,
                        correction=Correction(g.is_correction, g.is_cap, g.is_band_low, g.is_band_high),
                        teacher_coef=g.teacher_coef)


def grpo_config(cfg: Config) -> Config:
    """The run's config as GRPO runs it: train.micro_batch_size is a minibatch's rows
    (prompts_per_step x group_size / minibatches) / train.grad_accum. A value the user set
    otherwise is an error that names it, not a silent overwrite."""
    g, accum, M = cfg.grpo, cfg.train.grad_accum, cfg.parallel.micro_batches
    if cfg.data.pack:
        raise ConfigError("data.pack=true packs SFT pairs; a GRPO row is one rollout (prompt and completion): "
                          "remove data.pack")
    _check_env_schedule(cfg)
    rows = g.prompts_per_step * g.group_size // g.minibatches
    if rows % accum:
        raise ConfigError(f"train.grad_accum={accum} does not divide a GRPO minibatch of {rows} rows "
                          f"(grpo.prompts_per_step x grpo.group_size / grpo.minibatches): choose among "
                          f"{[a for a in range(1, rows + 1) if rows % a == 0]}")
    micro = rows // accum
    if "train.micro_batch_size" in given(cfg) and cfg.train.micro_batch_size != micro:
        raise ConfigError(f"train.micro_batch_size={cfg.train.micro_batch_size}: GRPO derives it, a minibatch's "
                          f"{rows} rows (grpo.prompts_per_step x grpo.group_size / grpo.minibatches) / "
                          f"train.grad_accum={accum} = {micro}; remove the setting (or set it to {micro}), or "
                          "change train.grad_accum")
    try:
        micro_batch_plan(micro, accum, M)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (under GRPO train.micro_batch_size is derived: a minibatch's {rows} rows / "
                          f"train.grad_accum={accum} = {micro})") from None
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=micro))


def _check_env_schedule(cfg: Config) -> None:
    if cfg.grpo.env and cfg.sampling.check_every != 1:
        raise ConfigError(f"grpo.env={cfg.grpo.env!r} needs sampling.check_every: 1 (got {cfg.sampling.check_every}): "
                          "an observation goes in at the check right after its trigger")


def environments(cfg: Config, tokenizer: Tokenizer) -> Optional[Environments]:
    """grpo.env's environment with the run's limits (None: no environment); observations are
    tokenized once, with the run's tokenizer (no BOS)."""
    g = cfg.grpo
    if not g.env:
        return None
    _check_env_schedule(cfg)
    try:
        env = resolve_env(g.env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    limits = EnvLimits(g.max_turns, g.max_turn_tokens, g.max_episode_tokens, g.env_time_limit, g.max_env_errors)
    if tokenizer.use_chat_template:  # turns laid out by the template; its turn end hands over
        return Environments(env, tokenizer.encode, limits, tokenizer.chat_turn, tokenizer.turn_end_id)
    return Environments(env, tokenizer.encode, limits)


def engine_config(cfg: Config) -> EngineConfig:
    """What the engine and the layout are built for, from ``grpo_config(cfg)``: the
    learning-rate schedule spans train.steps x epochs x minibatches optimizer steps (train.steps
    counts GRPO steps), a batch is train.micro_batch_size rows."""
    g = cfg.grpo
    updates = cfg.train.steps * g.epochs * g.minibatches
    return dataclasses.replace(EngineConfig.from_train(cfg.train), total_steps=updates)


def batches_per_minibatch(cfg: Config) -> int:
    """Rollout batches per minibatch: grad_accum, each cut into pieces when the pipeline keeps
    more micro-batches in flight than grad_accum (dims.micro_batch_plan)."""
    pieces, _ = micro_batch_plan(cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.parallel.micro_batches)
    return cfg.train.grad_accum * pieces


# ---------------------------------------------------------------------- set-up
def run(cfg: Config) -> dict:
    from rlt_mega.model.baselines import require_rlt

    require_rlt(cfg.model, "GRPO")
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    check_vocab(cfg, tokenizer)
    try:
        reward_fn = resolve_reward(cfg.grpo.reward)
    except ValueError as exc:
        raise ConfigError(f"grpo.reward: {exc}") from None
    cfg = grpo_config(cfg)
    if cfg.grpo.sampler_replicas:
        stats = DataStats()
        train_recs, eval_recs = train_eval_records(cfg.data, prompt_record(cfg.sft.prompt_field, cfg.sft.answer_field),
                                                   PROMPT_COLUMNS, stats, seed=cfg.train.seed)
        result = run_roles(cfg, tokenizer, reward_fn, train_recs, eval_recs)
        result["data/skipped"] = stats.total
        return result
    with launch(cfg, engine_config(cfg)) as dims:
        stats = DataStats()
        train_recs, eval_recs = train_eval_records(cfg.data, prompt_record(cfg.sft.prompt_field, cfg.sft.answer_field),
                                                   PROMPT_COLUMNS, stats, seed=cfg.train.seed)
        train_recs, eval_recs = (fitting_prompts(recs, tokenizer, cfg.model.max_seq_len, stats, f"{name} prompts")
                                 for recs, name in ((train_recs, "train"), (eval_recs, "eval")))
        if len(train_recs) == 0:
            raise ConfigError(f"no GRPO training prompt fits model.max_seq_len={cfg.model.max_seq_len} "
                              f"({stats.summary()}): raise model.max_seq_len")
        if stats.total:
            log.warning("data: %s", stats.summary())
        result = build_trainer(cfg, dims, tokenizer, reward_fn, train_recs, eval_recs).run()
        result["data/skipped"] = stats.total
        return result


def build_trainer(cfg: Config, dims: ParallelDims, tokenizer: Tokenizer, reward_fn: RewardFn, train_recs,
                  eval_recs) -> Trainer:
    """The loop with the GRPO job on this rank of ``dims``; ``cfg`` is ``grpo_config``'s.
    train.init_from (e.g. the export of an SFT run), when set, is applied by the builders."""
    job = build_job(cfg, dims, tokenizer, reward_fn, train_recs, eval_recs)
    return Trainer(cfg, dims, job.engine, job, job.timers)


def build_job(cfg: Config, dims: ParallelDims, tokenizer: Tokenizer, reward_fn: RewardFn, train_recs,
              eval_recs) -> GRPOJob:
    engine = build_engine(cfg, dims, engine_config(cfg))
    every, comms = cfg.sampling.check_every, Comms.from_dims(dims)
    rows = RowSwitches(slots=cfg.sampling.slots)
    reference = None
    if cfg.grpo.kl_coef > 0:  # the initial policy in the same layout, frozen
        reference = Sampler(reference_model(cfg, dims, engine), comms, dims.layers, check_every=every, rows=rows)

    teacher = build_teacher(cfg, dims, tokenizer, engine, comms, rows) if cfg.grpo.teacher else None

    def policy() -> Sampler:
        return Sampler(engine.sampling_module(), comms, dims.layers, check_every=every, rows=rows)

    log.info("GRPO: %d train prompts, %d held-out; %d x %d completions per step and replica (%d replicas) in %d "
             "minibatches of %d batches, %d epochs", len(train_recs), len(eval_recs), cfg.grpo.prompts_per_step,
             cfg.grpo.group_size, dims.dp, cfg.grpo.minibatches, batches_per_minibatch(cfg), cfg.grpo.epochs)
    timers = phase_timers()
    return GRPOJob(cfg, dims, engine, policy, tokenizer, train_recs, eval_recs, reward_fn, timers, reference, teacher)


def run_roles(cfg: Config, tokenizer: Tokenizer, reward_fn: RewardFn, train_recs, eval_recs) -> dict:
    """GRPO with sampler roles (grpo.sampler_replicas = R, docs/design.md "Bounded staleness"):
    1 + R model replicas of tp x pp ranks each, the learner's the first (launcher ranks 0 .. n - 1,
    n = tp x pp), each a torch.distributed world of its own (parallel/roles.py) with the same
    layout, built from the same config, so a sampler's shapes are the learner's. The learner's
    ranks run the loop, the others sample (data step j on replica 1 + j mod R;
    train/async_grpo.py, ``run_sampler``). A checkpoint holds the learner's queue complete, so
    it resumes exactly, colocated or with the roles. ``cfg`` is ``grpo_config``'s."""
    p, g = cfg.parallel, cfg.grpo
    world, n = int(os.environ.get("WORLD_SIZE", "1")), p.tp * p.pp
    if world != (1 + g.sampler_replicas) * n:
        raise ConfigError(f"grpo.sampler_replicas={g.sampler_replicas} with parallel.tp={p.tp}, pp={p.pp} runs on "
                          f"{(1 + g.sampler_replicas) * n} processes (1 + {g.sampler_replicas} model replicas of "
                          f"tp x pp = {n}: the learner's, the samplers'), but the launcher started {world}: launch "
                          f"{(1 + g.sampler_replicas) * n} (torchrun --nproc-per-node {(1 + g.sampler_replicas) * n})")
    if (p.dp or 1) != 1 or p.zero_stage == 3:
        raise ConfigError(f"grpo.sampler_replicas: every replica (the learner's, each sampler's) is one data-parallel "
                          f"replica of the tp x pp layout, and a sampler holds its parameters whole; parallel.dp="
                          f"{p.dp}, zero_stage={p.zero_stage} asks for more: set parallel.dp=null (or 1) and "
                          "zero_stage <= 2, or grpo.sampler_replicas=0")
    configure_determinism(cfg.train.deterministic)
    _, device = init_distributed(p.backend, cfg.train.device, deterministic=cfg.train.deterministic,
                                 replica_size=n)
    dims = None
    try:
        channel = RoleChannel(g.sampler_replicas, device)
        if n == 1 and p.zero_stage == 0:
            dims = ParallelDims.single(cfg.model, device)
        else:
            dims = ParallelDims.build(p, cfg.model, cfg.train.device, engine_config(cfg), cfg.train.deterministic)
        if channel.is_learner:
            trainer = build_trainer(cfg, dims, tokenizer, reward_fn, train_recs, eval_recs)
            job = trainer.job
            job.source = RemoteSource(
                channel, g.max_staleness, lambda j: job._data_step_versions(j).start,
                lambda done: StopAfter(cfg.train.stop_after).end(done, cfg.train.steps),
                lambda: (job.order.state_dict(), list(job.engine.sampling_module().parameters()), job.previous),
                lambda it: job.order.load_state_dict(it.order))
            if CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep).resolve(cfg.train.resume) is None:
                job.source.begin(job.pipeline, 0)  # the samplers start while the learner evaluates
            result = trainer.run()
            job.source.close(job.pipeline, job.steps_done)
        else:
            run_sampler(build_job(cfg, dims, tokenizer, reward_fn, train_recs, eval_recs), channel)
            result = {"role": "sampler"}
        dist.barrier()  # on success only: after a failure the launcher stops the other ranks
        return result
    finally:
        if dims is not None:
            dims.destroy()
        dist.destroy_process_group()
