"""The GRPO job (docs/design.md, "GRPO"): a step composed of named phases, each with explicit
inputs and outputs, and the drivers that compose them.

    sample   data step j -> Generated       train/grpo_sample.py (generate, reward; dynamic
                                             sampling's rounds)
    score    Generated -> Scored             train/grpo_learn.py (reference, advantages)
    correct  Scored -> Proximal or None      train/grpo_learn.py (a stale step under
                                             grpo.is_correction)
    learn    Scored, Proximal -> Learned     train/grpo_learn.py (replay, update; epochs x
                                             minibatches optimizer steps)
    publish  the new version -> samplers     the source's ``publish`` (a sampler role's weights)

A source of samples is the driver of the sampling side (train/async_grpo.py): colocated
(``ColocatedSource``: every data-parallel replica samples its own prompts with its learner's
layout, the staleness pipeline deciding which data steps a step samples; grpo.max_staleness = 0
is synchronous GRPO through the same code) or the roles (``RemoteSource``: data steps arrive
from sampler replicas, grpo.sampler_replicas, whose own driver is ``run_sampler``). The job's
``step`` is the learner's driver: fill the queue from the source, then score, correct, learn
and publish its head. The loop is the one of every job (train/loop.py).

train.grad_accum: a minibatch (one optimizer step) is learned as grad_accum batches, each
its own rollout batch, gradients accumulated (it bounds the dense schedule's activation
memory, rows x positions); under pipeline parallelism parallel.micro_batches of them run in
flight (dims.micro_batch_plan). What GRPO derives is derived in one place
(train/grpo_settings.py): train.micro_batch_size (a minibatch's rows / grad_accum; a different
value set by the user is an error) and the engine's optimizer steps (train.steps counts GRPO
steps, each epochs x minibatches optimizer steps).

Metrics (TensorBoard + metrics.jsonl, from rank 0, reduced over every rank, train/grpo_metrics.py):
reward, accuracy, ratio min/mean/max, clip fraction, support misses, max/mean |dense - replay|,
KL(mu || dense), rollout and learner tokens/s, phase times, held-out greedy accuracy.
``ratio/onpolicy_max_dev`` is max |ratio - 1| on the first minibatch against the policy version
that sampled it, exactly 0 by the exactness contract (measured by grpo.verify_onpolicy's replay
under that version at every step, or by the first minibatch's replay at a step of lag 0);
``ratio/policy_change_max_dev`` the same against the current policy: how far the policy moved
since the samples were drawn (0 at lag 0). Neither is logged where nothing was replayed (the
ratio would be mu - mu, 0 by construction, which reads as a check that passed).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch.distributed as dist

from rlt_mega.config import Config, ConfigError
from rlt_mega.data.datasets import PROMPT_COLUMNS, DataStats, RecordOrder, prompt_record, train_eval_records
from rlt_mega.data.pairs import fitting_prompts
from rlt_mega.data.tokenizer import Tokenizer, load_tokenizer
from rlt_mega.learner.distill import distill_step_metrics
from rlt_mega.log import get_logger
from rlt_mega.metrics import Timers
from rlt_mega.checkpoint import CheckpointError, CheckpointManager
from rlt_mega.determinism import configure as configure_determinism
from rlt_mega.parallel.dims import ParallelDims, init_distributed, launcher_store, replica_of
from rlt_mega.parallel.roles import RoleChannel
from rlt_mega.parallel.launch import launch
from rlt_mega.precision import mean_metrics
from rlt_mega.rollout import Comms
from rlt_mega.schedule.rows import RowSwitches
from rlt_mega.rollout.rewards import RewardFn, resolve_reward
from rlt_mega.train.async_grpo import (ColocatedSource, PolicyHistory, RemoteSource, ShareCut, StalenessPipeline,
                                      queue_types, run_sampler)
from rlt_mega.train.builders import build_engine, build_teacher, check_vocab, reference_model
from rlt_mega.rollout.evaluation import metric_names
from rlt_mega.train.common import greedy_accuracy, sampled_scores, sampling_params
from rlt_mega.train.grpo_learn import Learned, LearnPhases
from rlt_mega.train.grpo_metrics import step_metrics
from rlt_mega.train.grpo_sample import Policy, SamplePhase
# (loss_settings, request_seeds: imported from here by the tests' scenarios)
from rlt_mega.train.grpo_settings import (batches_per_minibatch, engine_config, environments, grpo_config,  # noqa: F401
                                          loss_settings, request_seeds)
from rlt_mega.train.loop import Interval, SavedReplica, StepFailed, StopAfter, Trainer
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
    """The learner's driver: each ``step`` takes data step ``done`` from ``source`` (sampled
    here, or received) and runs the learner's phases (``phases``) on it. ``sampling``: the sample
    phase on this rank (the colocated source's, a sampler role's, the data order's owner);
    ``policy``: the engine's current policy; ``history``: the policy versions kept beside it.
    ``cfg`` is ``grpo_config``'s (train.micro_batch_size derived)."""

    name = "grpo"
    eval_at_start = True  # the held-out accuracy before GRPO

    def __init__(self, cfg: Config, dims: ParallelDims, policy: Policy, sampling: SamplePhase, phases: LearnPhases,
                 source: ColocatedSource | RemoteSource, history: PolicyHistory, eval_records, timers: Timers) -> None:
        self.cfg, self.dims, self.policy, self.engine = cfg, dims, policy, policy.engine
        self.sampling, self.phases, self.source, self.history = sampling, phases, source, history
        self.order, self.eval_records, self.timers = sampling.order, eval_records, timers
        self.state = GRPOState()
        g = cfg.grpo
        self.eval_every = Interval(g.eval_every, at_end=True)  # 0: the first and the last step only
        self.pipeline = StalenessPipeline(g.max_staleness, (dims.dp, dims.tp, dims.pp, dims.rank), g.partial_rollouts)
        self.steps_done = 0  # steps done (what a save's queue continues from)

    # ------------------------------------------------------------------ one step
    def step(self, done: int) -> dict[str, float]:
        """Sample (or receive) -> score -> correct -> learn -> publish, on data step ``done``."""
        t_step = time.perf_counter()
        self.history.begin_step(done, self.policy.module())
        t_fill = self.source.fill(self.pipeline, done)  # colocated: data steps up to done + s; roles: received
        item = self.pipeline.pop(done)
        scored = self.phases.score(item, done)
        proximal = self.phases.correct(scored)
        learned = self.phases.learn(scored, proximal, done)
        self._count_updates(learned, done)
        plan = self.sampling.plan
        scalars = step_metrics(self.dims, self.cfg.grpo, item, learned,
                               lags={v: done - v for v in (item.version, plan.target(done))},
                               with_reference=self.phases.reference is not None and not self.cfg.grpo.kl_in_reward,
                               with_correction=proximal is not None)
        self.steps_done = done + 1
        sync = self.source.publish(self.steps_done)
        seconds = time.perf_counter() - t_step
        scalars.update({"async/learner_idle_fraction": t_fill / max(seconds, 1e-9),
                        "async/sampler_idle_fraction": self.source.sampler_idle_fraction(item, seconds, t_fill),
                        "async/weight_sync_s": sync, **self.source.pool_metrics(item)})
        scalars.update(self._train_scalars(learned))
        if self.phases.teacher is not None:
            scalars.update(distill_step_metrics(self.dims, learned.records))
        self.state.completions += sum(len(rnd.rows) for rnd in item.rounds) * self.dims.dp
        self._check_rewards(scalars, done + 1)
        envs = self.sampling.envs
        if envs is not None and (stop := envs.over_limit(scalars["env/faults"])):
            raise StepFailed(*stop, scalars)
        return scalars

    def _count_updates(self, learned: Learned, done: int) -> None:
        for stats in learned.stats:
            self.state.updates += 1
            self.state.nonfinite_total += int(stats.skipped)
            if stats.skipped:
                log.warning("GRPO step %d, update %d: non-finite loss/gradient, skipped", done, self.state.updates)

    def _train_scalars(self, learned: Learned) -> dict[str, float]:
        stats = learned.stats
        return {"train/loss": sum(s.loss for s in stats) / len(stats),
                "train/grad_norm": max(s.grad_norm for s in stats),
                "train/lr": stats[-1].lr,
                "train/nonfinite_skipped": float(self.state.nonfinite_total),
                **mean_metrics([s.precision for s in stats])}  # bf16: the copy's lag (precision.py)

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
            sampler = self.policy.sampler()  # on every rank (a collective under ZeRO-3), records or not
            indices = list(range(dims.dp_rank, n, dims.dp))
            mine = [self.eval_records[i] for i in indices]
            accuracy, sampled = 0.0, {}
            if mine:
                accuracy, _ = greedy_accuracy(sampler, self.sampling.tokenizer, mine, self.cfg, self.cfg.train.dtype,
                                              self.sampling.envs)
            if self.cfg.eval.samples:
                names = metric_names(self.cfg.eval.samples, self.cfg.eval.k)
                sums = (sampled_scores(sampler, self.sampling.tokenizer, mine, indices, self.cfg, self.cfg.train.dtype,
                                       self.sampling.envs)
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
        return {"pipeline": self.pipeline.state_dict(), **self.history.state_dict(self.steps_done)}

    def load_rank_state_dict(self, state: Optional[dict], step: int) -> None:
        self.pipeline.load_state_dict(None if state is None else state["pipeline"], step)
        self._load_history(state, step)

    def load_moved_rank_state(self, replicas: list[Optional[dict]], own: Optional[dict] | SavedReplica,
                              step: int) -> None:
        """On another layout: every saved replica's queue re-split into this replica's share
        (train/async_grpo.py ``resplit``); the kept policy versions from ``own``, the saved rank at
        this rank's place in the model, or where the saved layout cuts the model otherwise
        (another tp, pp or stage split) re-cut from every place of one saved replica by the TP
        plan the layout-free state uses (parallel/reshard.py ``recut_flat``). Refused: the
        on-policy check of queued samples on another tp (their mu summed in another order)."""
        g, cut = self.cfg.grpo, self.phases.cut
        self.pipeline.load_moved([None if s is None else s["pipeline"] for s in replicas], step,
                                 ShareCut(self.dims.dp, self.dims.dp_rank, cut.minibatch_rows, cut.batch_rows,
                                          g.group_size))
        if isinstance(own, SavedReplica):
            tp = int(own.layout.get("tp", 1) or 1)
            if g.verify_onpolicy and self.pipeline.queue and tp != self.dims.tp:
                raise ConfigError(
                    f"the checkpoint at step {step} queues samples drawn on tp={tp}, which grpo.verify_onpolicy "
                    f"replays bit for bit against their mu: on tp={self.dims.tp} the replay sums in another order "
                    f"and cannot equal it: resume with grpo.verify_onpolicy=false (the kept policy versions move) "
                    f"or with parallel.tp={tp}")
            own = self._recut_history(own, step) if g.verify_onpolicy or g.partial_rollouts else None
        kept = None if own is None else {"previous": own.get("previous"), "versions": own.get("versions")}
        self._load_history(kept, step)

    def _recut_history(self, saved: SavedReplica, step: int) -> dict:
        """The kept versions of every place of one saved replica, each made whole and cut for this
        rank's place (one version and one parameter at a time)."""
        from rlt_mega.parallel.reshard import recut_flat

        tp, pp = (int(saved.layout.get(k, 1) or 1) for k in ("tp", "pp"))
        states = {}
        for p in range(pp):
            for t in range(tp):
                history = PolicyHistory(self.history.plan, self.history.verify)
                history.load_state_dict(saved.read(p, t), step)
                states[(p, t)] = history.kept
        held = {frozenset(v) for v in states.values()}
        if len(held) != 1:
            raise CheckpointError(f"the checkpoint at step {step} keeps policy versions "
                                  f"{sorted(sorted(v) for v in held)} on the ranks of one replica: a job_rank<r>.pt "
                                  "is missing or from another save")
        module = self.policy.module()
        named = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
        device = next(module.parameters()).device
        versions = {v: recut_flat(self.cfg.model, saved.layout, {k: s[v] for k, s in states.items()}, named,
                                  self.dims.tp, self.dims.tp_rank).to(device)
                    for v in sorted(held.pop())}
        return {"previous": versions.get(step - 1), "versions": versions}

    def _load_history(self, state: Optional[dict], step: int) -> None:
        self.steps_done = step
        self.history.load_state_dict(state, step)
        if self.cfg.grpo.partial_rollouts and step > 0 and step - 1 not in self.history.kept:
            raise ConfigError(f"the checkpoint at step {step} holds no parameters of policy version {step - 1}, which "
                              f"grpo.partial_rollouts={self.cfg.grpo.partial_rollouts} starts the next rollouts under "
                              "(it was written without partial rollouts, or job_rank<r>.pt is missing): resume with "
                              "grpo.partial_rollouts=0 or start afresh")


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
                  eval_recs, channel: Optional[RoleChannel] = None) -> Trainer:
    """The loop with the GRPO job on this rank of ``dims``; ``cfg`` is ``grpo_config``'s.
    train.init_from (e.g. the export of an SFT run), when set, is applied by the builders.
    ``channel``: the learner's end of the roles (samples arrive from sampler replicas)."""
    job = build_job(cfg, dims, tokenizer, reward_fn, train_recs, eval_recs, channel)
    return Trainer(cfg, dims, job.engine, job, job.timers)


def build_job(cfg: Config, dims: ParallelDims, tokenizer: Tokenizer, reward_fn: RewardFn, train_recs,
              eval_recs, channel: Optional[RoleChannel] = None, shares: Optional[list[int]] = None) -> GRPOJob:
    """The job's pieces, each handed its collaborators: the policy, the sample phase (and the
    data order it advances), the learner's phases, the kept versions and the source of samples
    (colocated, or ``channel``'s samplers). ``shares``: on a sampler role, the learner's
    data-parallel ranks it samples for (default: this replica's own rank)."""
    g = cfg.grpo
    engine = build_engine(cfg, dims, engine_config(cfg))
    comms, rows = Comms.from_dims(dims), RowSwitches(slots=cfg.sampling.slots)
    policy = Policy(engine, comms, dims, cfg.sampling.check_every, rows)
    reference = None
    if g.kl_coef > 0:  # the initial policy in the same layout, frozen
        reference = policy.sampler(reference_model(cfg, dims, engine))
    timers = phase_timers()
    envs, params = environments(cfg, tokenizer), sampling_params(cfg, tokenizer)
    if envs is not None:  # a turn end that hands over does not stop
        params = dataclasses.replace(params, stop_token_ids=envs.stop_ids(params.stop_token_ids))
    order = RecordOrder(len(train_recs), cfg.train.seed, cfg.data.shuffle)
    sampling = SamplePhase(cfg, dims, tokenizer, train_recs, order, reward_fn, params, envs, timers, shares,
                           None if shares is None else len(shares))
    history = PolicyHistory(sampling.plan, g.verify_onpolicy)
    teacher = build_teacher(cfg, dims, tokenizer, engine, comms, rows) if g.teacher else None
    phases = LearnPhases(cfg, dims, engine, policy, reference, history, timers, teacher)
    if channel is None:
        source = ColocatedSource(sampling, policy, history)
    else:
        source = RemoteSource(channel, sampling.plan, order, policy, history, StopAfter(cfg.train.stop_after),
                              cfg.train.steps)
    log.info("GRPO: %d train prompts, %d held-out; %d x %d completions per step and replica (%d replicas) in %d "
             "minibatches of %d batches, %d epochs", len(train_recs), len(eval_recs), g.prompts_per_step,
             g.group_size, dims.dp, g.minibatches, batches_per_minibatch(cfg), g.epochs)
    return GRPOJob(cfg, dims, policy, sampling, phases, source, history, eval_recs, timers)


def run_roles(cfg: Config, tokenizer: Tokenizer, reward_fn: RewardFn, train_recs, eval_recs) -> dict:
    """GRPO with sampler roles (grpo.sampler_replicas = R, docs/design.md "Bounded staleness"):
    the learner's replica of tp x pp x dp ranks (launcher ranks 0 .. n dp - 1, n = tp x pp, any
    ZeRO stage), then R sampler replicas of tp x pp ranks each, each replica a torch.distributed
    world of its own (parallel/roles.py), built from the same config (a sampler's data-parallel
    size 1), so a sampler's shapes are the learner's. The learner's ranks run the loop, the others
    sample (data step j on sampler 1 + j mod R, every learner data-parallel rank's share of it;
    train/async_grpo.py, ``run_sampler``). A checkpoint holds the learner's queue complete, so it
    resumes exactly, colocated or with the roles. ``cfg`` is ``grpo_config``'s."""
    p, g = cfg.parallel, cfg.grpo
    n, dp = p.tp * p.pp, p.dp or 1
    if os.environ.get("RLT_ROLES_JOIN"):
        return run_joined(cfg, tokenizer, reward_fn, train_recs, eval_recs, os.environ["RLT_ROLES_JOIN"])
    check_roles_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    configure_determinism(cfg.train.deterministic)
    _, device = init_distributed(p.backend, cfg.train.device, deterministic=cfg.train.deterministic,
                                 replica_size=[n * dp] + [n] * in_launch(cfg))
    replica = replica_of(launcher_store()[1], [n * dp] + [n] * in_launch(cfg))[0]
    dims = None
    try:
        mine = cfg if replica == 0 else sampler_config(cfg)
        if n * dp == 1 and p.zero_stage == 0:
            dims = ParallelDims.single(cfg.model, device)
        else:
            dims = ParallelDims.build(mine.parallel, cfg.model, cfg.train.device, engine_config(mine),
                                      cfg.train.deterministic)
        role = dims.dp_rank if replica == 0 else dp + replica - 1  # sampler replica r = replica - 1
        channel = RoleChannel(in_launch(cfg), dp, dims.pp_rank * dims.tp + dims.tp_rank, role, device,
                              positions=n, timeout_s=g.sampler_timeout_s,
                              joining=g.sampler_replicas if g.samplers_join else 0, bucket_mb=g.publish_bucket_mb)
        if channel.is_learner:
            if launcher_store()[1] == 0:
                log.info("GRPO roles: %d sampler replica(s) in this launch; more join with RLT_ROLES_JOIN=%s:%s",
                         in_launch(cfg), os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", ""))
            trainer = build_trainer(cfg, dims, tokenizer, reward_fn, train_recs, eval_recs, channel)
            job = trainer.job
            if CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep).resolve(cfg.train.resume) is None:
                job.source.begin(job.pipeline, 0)  # the samplers start while the learner evaluates
            result = trainer.run()
            job.source.close(job.pipeline, job.steps_done)
        else:
            job = build_job(mine, dims, tokenizer, reward_fn, train_recs, eval_recs, shares=list(range(dp)))
            run_sampler(job.sampling, job.policy, channel)
            result = {"role": "sampler"}
        dist.barrier()  # on success only: after a failure the launcher stops the other ranks
        return result
    finally:
        if dims is not None:
            dims.destroy()
        dist.destroy_process_group()


def run_joined(cfg: Config, tokenizer: Tokenizer, reward_fn: RewardFn, train_recs, eval_recs, address: str) -> dict:
    """A sampler replica that joins a running job's pool (``RLT_ROLES_JOIN=host:port``: the
    learner's launcher store, MASTER_ADDR:MASTER_PORT of its job): its own launch of tp x pp
    processes, the same config; it takes the next replica number, the learner admits it at its
    next publication, and it claims the data steps whose versions it receives from then on."""
    from rlt_mega.parallel import roles

    p, g = cfg.parallel, cfg.grpo
    n, dp = p.tp * p.pp, p.dp or 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != n:
        raise ConfigError(f"RLT_ROLES_JOIN={address}: a sampler replica that joins runs on parallel.tp x pp = {n} "
                          f"processes, but the launcher started {world}: launch {n}")
    configure_determinism(cfg.train.deterministic)
    _, device = init_distributed(p.backend, cfg.train.device, deterministic=cfg.train.deterministic)
    roles.join(address, g.sampler_timeout_s)
    dims = None
    try:
        mine = sampler_config(cfg)
        if n == 1 and mine.parallel.zero_stage == 0:
            dims = ParallelDims.single(cfg.model, device)
        else:
            dims = ParallelDims.build(mine.parallel, cfg.model, cfg.train.device, engine_config(mine),
                                      cfg.train.deterministic)
        job = build_job(mine, dims, tokenizer, reward_fn, train_recs, eval_recs, shares=list(range(dp)))
        # Its number, once it is ready: the learner admits it at its next publication.
        box = [roles.RoleStore().count("joined", 1) if dist.get_rank() == 0 else None]
        if n > 1:
            dist.broadcast_object_list(box, src=0)
        replica = in_launch(cfg) + box[0] - 1
        channel = RoleChannel(in_launch(cfg), dp, dims.pp_rank * dims.tp + dims.tp_rank, dp + replica, device,
                              positions=n, timeout_s=g.sampler_timeout_s, bucket_mb=g.publish_bucket_mb)
        run_sampler(job.sampling, job.policy, channel)
        return {"role": "sampler", "replica": replica}
    finally:
        if dims is not None:
            dims.destroy()
        dist.destroy_process_group()


def in_launch(cfg: Config) -> int:
    """The sampler replicas in the learner's launch (none under grpo.samplers_join: they join)."""
    return 0 if cfg.grpo.samplers_join else cfg.grpo.sampler_replicas


def sampler_config(cfg: Config) -> Config:
    """A sampler replica's config: the learner's, with one data-parallel rank (it samples every
    learner rank's share) and its parameters whole (ZeRO-3's partitions would be refreshed over
    the received weights: stage 1 instead, the same parameter dtype)."""
    p = cfg.parallel
    zero = 1 if p.zero_stage == 3 else p.zero_stage
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=1, zero_stage=zero))


def check_roles_layout(cfg: Config, world: int) -> None:
    """The launcher's world must be the learner's tp x pp x dp ranks and R replicas of tp x pp."""
    p, g = cfg.parallel, cfg.grpo
    n, dp = p.tp * p.pp, p.dp or 1
    if g.samplers_join and world != n * dp:
        raise ConfigError(f"grpo.samplers_join with parallel.tp={p.tp}, pp={p.pp}, dp={dp}: the job is the learner's "
                          f"tp x pp x dp = {n * dp} processes (the samplers join it with RLT_ROLES_JOIN), but the "
                          f"launcher started {world}: launch {n * dp}")
    want = n * dp + in_launch(cfg) * n
    if world != want:
        raise ConfigError(f"grpo.sampler_replicas={g.sampler_replicas} with parallel.tp={p.tp}, pp={p.pp}, dp={dp} "
                          f"runs on {want} processes (the learner's tp x pp x dp = {n * dp}, then "
                          f"{g.sampler_replicas} sampler replicas of tp x pp = {n}), but the launcher started {world}: "
                          f"launch {want} (nodes x processes per node; one node: torchrun --nproc-per-node {want})")
