"""The GRPO job (docs/design.md, "GRPO"), colocated: every data-parallel replica samples its own
prompts with its learner's layout (one process, or TP x PP, the pipeline's sampler ring) and
learns from them through the engine (local, or DeepSpeed ZeRO over the data-parallel group).
The loop is the one of every job (train/loop.py); this module is the job and its set-up.

One step, as named phases (each timed into the metrics):

    generate    prompts_per_step x group_size completions per replica, each minibatch as
                grad_accum (x pipeline pieces) rollout batches sampled together (in flight in
                the pipeline ring); each is later replayed and learned as its own batch
                (docs/design.md, "Granularity")
    score       rewards, once per replica (a reward function that raises scores 0, counted)
    advantages  group advantages (grpo / dr_grpo)
    reference   frozen-reference log-probs (only with grpo.kl_coef > 0), by replay
    replay      per minibatch: the rollouts' own schedule with the current parameters
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
is max |ratio - 1| on the first minibatch of each step, exactly 0 by the exactness contract.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from rlt_mega.config import Config, ConfigError, given
from rlt_mega.data.datasets import DataStats, pair_of, train_eval_records
from rlt_mega.data.pairs import RecordOrder, prompt_ids
from rlt_mega.data.tokenizer import Tokenizer, load_tokenizer
from rlt_mega.learner.grpo import group_advantages
from rlt_mega.learner.objective import GRPOObjective, grpo_batch
from rlt_mega.log import get_logger
from rlt_mega.metrics import Timers
from rlt_mega.parallel.dims import ParallelDims, micro_batch_plan
from rlt_mega.parallel.engine import Engine, EngineConfig
from rlt_mega.parallel.launch import launch
from rlt_mega.rollout import Comms, Rollout, Sampler
from rlt_mega.rollout.rewards import RewardFn, resolve_reward, score
from rlt_mega.train.builders import build_engine, check_vocab, reference_model
from rlt_mega.train.common import greedy_accuracy, max_new_tokens_for, sampling_params
from rlt_mega.train.grpo_metrics import reduce_step_metrics
from rlt_mega.train.loop import Interval, Trainer
from rlt_mega.train.supervised import phase_timers

log = get_logger(__name__)


@dataclass
class GRPOState:
    updates: int = 0  # optimizer steps
    completions: int = 0  # over every replica
    nonfinite_total: int = 0
    accuracy_before: Optional[float] = None


class GRPOJob:
    """``sampler()`` returns the Sampler of this rank's part of the policy with its current
    parameters (called at each phase that needs them: under ZeRO-3 it refreshes a copy);
    ``reference``, when set, the frozen reference's Sampler in the same layout. ``cfg`` is
    ``grpo_config``'s (train.micro_batch_size derived)."""

    name = "grpo"
    eval_at_start = True  # the held-out accuracy before GRPO

    def __init__(self, cfg: Config, dims: ParallelDims, engine: Engine, sampler: Callable[[], Sampler],
                 tokenizer: Tokenizer, train_records, eval_records, reward_fn: RewardFn, timers: Timers,
                 reference: Optional[Sampler] = None) -> None:
        self.cfg, self.dims, self.engine, self.sampler, self.tokenizer = cfg, dims, engine, sampler, tokenizer
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
        self.objective = GRPOObjective(g.eps_low, g.eps_high, g.kl_coef)

    # ------------------------------------------------------------------ one step
    def _batches(self, items: list, k: int) -> list[list]:
        """Minibatch k of a per-replica row list, as its rollout batches."""
        mb = items[k * self.minibatch_rows:(k + 1) * self.minibatch_rows]
        return [mb[i:i + self.batch_rows] for i in range(0, len(mb), self.batch_rows)]

    def step(self, done: int) -> dict[str, float]:
        g, dtype, dims = self.cfg.grpo, self.cfg.train.dtype, self.dims
        records = [self.train_records[i] for i in self.order.take(g.prompts_per_step, dims.dp_rank, dims.dp)]
        rows = [r for r in records for _ in range(g.group_size)]  # the G completions of a prompt are contiguous
        prompts = [prompt_ids(self.tokenizer, r["question"]) for r in rows]
        seeds = request_seeds(self.cfg.train.seed, done, dims.dp_rank, len(rows))

        with self.timers("generate"):
            t0 = time.perf_counter()
            sampler = self.sampler()
            rollouts: list[list[Rollout]] = []  # [minibatch][batch]
            for k in range(g.minibatches):
                batches = self._batches(prompts, k)
                params = [max_new_tokens_for(sampler.model, b, self.params) for b in batches]
                rollouts.append(sampler.generate(batches, params, self._batches(seeds, k),
                                                 pad_id=self.tokenizer.pad_id, dtype=dtype,
                                                 decode=self.tokenizer.decode))
            t_generate = time.perf_counter() - t0
        flat = [ro for mb in rollouts for ro in mb]
        with self.timers("score"):
            rewards, failures = None, 0
            if dims.is_replica_source:
                texts = [self.tokenizer.decode(ro.completion(b)) for ro in flat for b in range(ro.batch_size)]
                ids = [f"step{done}/dp{dims.dp_rank}/row{i}" for i in range(len(rows))]
                rewards, failures = score(texts, [r["answer"] for r in rows], ids, self.reward_fn)
            rewards, failures = dims.share_in_replica((rewards, failures))
        with self.timers("advantages"):
            advantages = group_advantages(torch.tensor(rewards), g.group_size, g.advantage, g.advantage_eps)
        refs: list[list[Optional[torch.Tensor]]] = [[None] * len(mb) for mb in rollouts]
        if self.reference is not None:
            with self.timers("reference"):
                refs = [self.reference.replay(mb) for mb in rollouts]

        self.objective.records = []
        step_stats = []
        t_learn = 0.0
        for epoch in range(g.epochs):
            for k, mb_rollouts in enumerate(rollouts):
                t0 = time.perf_counter()
                with self.timers("replay"):
                    # Fresh caches under the current parameters (after the previous update).
                    replayed = self.sampler().replay(mb_rollouts)
                adv = self._batches(list(advantages.unbind(0)), k)
                batches = [grpo_batch(ro, rp, torch.stack(a), ref)
                           for ro, rp, a, ref in zip(mb_rollouts, replayed, adv, refs[k])]
                with self.timers("update"):
                    stats = self.engine.train_step(batches, self.objective)
                t_learn += time.perf_counter() - t0
                step_stats.append(stats)
                self.state.updates += 1
                self.state.nonfinite_total += int(stats.skipped)
                if stats.skipped:
                    log.warning("GRPO step %d, update %d: non-finite loss/gradient, skipped", done,
                                self.state.updates)

        scalars = reduce_step_metrics(dims, rewards, failures, flat, self.objective.records,
                                      first_records=batches_per_minibatch(self.cfg), epochs=g.epochs,
                                      t_generate=t_generate, t_learn=t_learn, with_reference=self.reference is not None)
        scalars.update({
            "train/loss": sum(s.loss for s in step_stats) / len(step_stats),
            "train/grad_norm": max(s.grad_norm for s in step_stats),
            "train/lr": step_stats[-1].lr,
            "train/nonfinite_skipped": float(self.state.nonfinite_total),
        })
        self.state.completions += len(rows) * dims.dp
        return scalars

    def log_line(self, scalars: dict[str, float], seconds: float) -> dict[str, float]:
        return scalars

    def postfix(self, scalars: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{scalars['reward/mean']:.3f}", "loss": f"{scalars['train/loss']:.4f}"}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out greedy accuracy on the first grpo.eval_size records, each replica taking
        every dp-th of them (at step 0: the accuracy before GRPO)."""
        n = min(self.cfg.grpo.eval_size, len(self.eval_records))
        if n == 0:
            return {}
        dims = self.dims
        with self.timers("eval"):
            sampler = self.sampler()  # on every rank (a collective under ZeRO-3), records or not
            mine = [self.eval_records[i] for i in range(dims.dp_rank, n, dims.dp)]
            accuracy = 0.0
            if mine:
                accuracy, _ = greedy_accuracy(sampler, self.tokenizer, mine, self.cfg, self.cfg.train.dtype)
            correct, total = dims.sum_over_dp([accuracy * len(mine), float(len(mine))])
            accuracy = correct / total
        if step == 0:
            self.state.accuracy_before = accuracy
        log.info("GRPO step %d: held-out greedy accuracy %.3f (%d problems)", step, accuracy, n)
        return {"eval/accuracy": accuracy}

    def result(self) -> dict:
        return {"eval/accuracy_before": self.state.accuracy_before}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"state": asdict(self.state), "data": self.order.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.state = GRPOState(**state["state"])
        self.order.load_state_dict(state["data"])


# ---------------------------------------------------------------------- what GRPO derives
def request_seeds(seed: int, step: int, dp_rank: int, num: int) -> list[int]:
    """Per-request sampling seeds from (run seed, step, global row): replicas draw independent
    samples, and a resumed run draws the same ones."""
    base = (seed * 1_000_003 + step) * 65_536 + dp_rank * num
    return [base + i for i in range(num)]


def grpo_config(cfg: Config) -> Config:
    """The run's config as GRPO runs it: train.micro_batch_size is a minibatch's rows
    (prompts_per_step x group_size / minibatches) / train.grad_accum. A value the user set
    otherwise is an error that names it, not a silent overwrite."""
    g, accum, M = cfg.grpo, cfg.train.grad_accum, cfg.parallel.micro_batches
    if cfg.data.pack:
        raise ConfigError("data.pack=true packs SFT pairs; a GRPO row is one rollout (prompt and completion): "
                          "remove data.pack")
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
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    check_vocab(cfg, tokenizer)
    try:
        reward_fn = resolve_reward(cfg.grpo.reward)
    except ValueError as exc:
        raise ConfigError(f"grpo.reward: {exc}") from None
    cfg = grpo_config(cfg)
    with launch(cfg, engine_config(cfg)) as dims:
        stats = DataStats()
        train_recs, eval_recs = train_eval_records(cfg.data, pair_of(cfg.sft.prompt_field, cfg.sft.answer_field),
                                                   ["question", "answer"], stats, seed=cfg.train.seed)
        result = build_trainer(cfg, dims, tokenizer, reward_fn, train_recs, eval_recs).run()
        result["data/skipped"] = stats.total
        return result


def build_trainer(cfg: Config, dims: ParallelDims, tokenizer: Tokenizer, reward_fn: RewardFn, train_recs,
                  eval_recs) -> Trainer:
    """The loop with the GRPO job on this rank of ``dims``; ``cfg`` is ``grpo_config``'s.
    train.init_from (e.g. the export of an SFT run), when set, is applied by the builders."""
    engine = build_engine(cfg, dims, engine_config(cfg))
    fast, every, comms = cfg.sampling.fast_decode, cfg.sampling.check_every, Comms.from_dims(dims)
    reference = None
    if cfg.grpo.kl_coef > 0:  # the initial policy in the same layout, frozen
        reference = Sampler(reference_model(cfg, dims, engine), comms, dims.layers, fast_decode=fast,
                            check_every=every)

    def policy() -> Sampler:
        return Sampler(engine.sampling_module(), comms, dims.layers, fast_decode=fast, check_every=every)

    log.info("GRPO: %d train prompts, %d held-out; %d x %d completions per step and replica (%d replicas) in %d "
             "minibatches of %d batches, %d epochs", len(train_recs), len(eval_recs), cfg.grpo.prompts_per_step,
             cfg.grpo.group_size, dims.dp, cfg.grpo.minibatches, batches_per_minibatch(cfg), cfg.grpo.epochs)
    timers = phase_timers()
    job = GRPOJob(cfg, dims, engine, policy, tokenizer, train_recs, eval_recs, reward_fn, timers, reference)
    return Trainer(cfg, dims, engine, job, timers)
