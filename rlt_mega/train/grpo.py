"""The GRPO driver (DESIGN section 6), colocated: every data-parallel replica samples its own
prompts with its learner's layout (one process, or TP x PP, the pipeline's sampler ring) and
learns from them through the engine (local, or DeepSpeed ZeRO over the data-parallel group).

One step, as named phases (each timed into the metrics):

    generate    prompts_per_step x group_size completions per replica, each minibatch as
                grad_accum (x pipeline pieces) rollout micro-batches sampled together (in flight
                in the pipeline ring); each micro-batch is later replayed and learned as its own
                batch (DESIGN section 3, granularity)
    score       rewards, once per replica (a reward function that raises scores 0, counted)
    advantages  group advantages (grpo / dr_grpo)
    reference   frozen-reference log-probs (only with grpo.kl_coef > 0), by replay
    replay      per minibatch: the rollouts' own schedule with the current parameters
    update      per minibatch: hybrid log-probs (value = replay, gradient = dense), the clipped
                surrogate over the global completion-token count, one optimizer step;
                epochs x minibatches in all

train.grad_accum: a minibatch (one optimizer step) is learned as grad_accum micro-batches,
each its own rollout batch, gradients accumulated (it bounds the dense schedule's activation
memory, rows x positions); under pipeline parallelism parallel.micro_batches of them run in
flight (dims.micro_batch_plan). train.micro_batch_size is derived: the minibatch's rows /
grad_accum.

Metrics (TensorBoard + metrics.jsonl, from rank 0, reduced over every rank): reward, accuracy,
ratio min/mean/max, clip fraction, support misses, max/mean |dense - replay|, KL(mu || dense),
rollout and learner tokens/s, phase times, held-out greedy accuracy. ``ratio/onpolicy_max_dev``
is max |ratio - 1| on the first minibatch of each step, exactly 0 by the exactness contract.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm import tqdm

from rlt_mega.checkpoint import CheckpointManager
from rlt_mega.config import Config, ConfigError, save_config
from rlt_mega.data.datasets import DataStats, pair_of, train_eval_records
from rlt_mega.data.pairs import RecordOrder, prompt_ids
from rlt_mega.data.tokenizer import Tokenizer, load_tokenizer
from rlt_mega.learner.grpo import group_advantages
from rlt_mega.learner.objective import GRPOObjective, count_completion_tokens, grpo_micro_batch
from rlt_mega.log import get_logger
from rlt_mega.metrics import Metrics, Timers
from rlt_mega.parallel import distributed
from rlt_mega.parallel.dims import micro_batch_plan
from rlt_mega.rollout import Comms, Rollout, Sampler
from rlt_mega.rollout.rewards import RewardFn, resolve_reward, score
from rlt_mega.train.common import greedy_accuracy, max_new_tokens_for, sampling_params
from rlt_mega.train.grpo_metrics import reduce_step_metrics
from rlt_mega.train.loop import resume_trainer_checkpoint, save_trainer_checkpoint
from rlt_mega.train.pretrain import build_distributed, build_local, check_vocab, initial_model
from rlt_mega.train.replica import Replica

log = get_logger(__name__)


@dataclass
class GRPOState:
    step: int = 0  # GRPO steps done (each: one rollout batch, epochs x minibatches updates)
    updates: int = 0  # optimizer steps
    completions: int = 0  # over every replica
    nonfinite_total: int = 0
    accuracy_before: Optional[float] = None
    last_checkpoint: Optional[str] = None


class GRPOTrainer:
    """``sampler()`` returns the Sampler of this rank's part of the policy with its current
    parameters (called at each phase that needs them: under ZeRO-3 it refreshes a copy);
    ``reference``, when set, the frozen reference's Sampler in the same layout."""

    def __init__(self, cfg: Config, engine, sampler: Callable[[], Sampler], tokenizer: Tokenizer, train_records,
                 eval_records, reward_fn: RewardFn, reference: Optional[Sampler] = None,
                 replica: Optional[Replica] = None) -> None:
        self.cfg, self.engine, self.sampler, self.tokenizer = cfg, engine, sampler, tokenizer
        self.train_records, self.eval_records, self.reward_fn = train_records, eval_records, reward_fn
        self.reference = reference
        self.replica = replica or Replica()
        self.order = RecordOrder(len(train_records), cfg.train.seed, cfg.data.shuffle)
        self.params = sampling_params(cfg, tokenizer)
        self.state = GRPOState()
        rank = self.replica.rank
        self.ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep, rank=rank, barrier=self.replica.barrier)
        self.metrics = Metrics.for_run(cfg, enabled=rank == 0)
        self.timers = Timers(torch.cuda.synchronize if torch.cuda.is_available() else None)
        g = cfg.grpo
        self.rows_per_step = g.prompts_per_step * g.group_size  # per replica
        self.minibatch_rows = self.rows_per_step // g.minibatches
        self.micro_rows = self.minibatch_rows // num_micro_batches(cfg)
        self.objective = GRPOObjective(g.eps_low, g.eps_high, g.kl_coef)

    # ------------------------------------------------------------------ one step
    def _micro(self, items: list, k: int) -> list[list]:
        """Minibatch k of a per-replica row list, as its rollout micro-batches."""
        mb = items[k * self.minibatch_rows:(k + 1) * self.minibatch_rows]
        return [mb[i:i + self.micro_rows] for i in range(0, len(mb), self.micro_rows)]

    def train_step(self) -> dict[str, float]:
        g, dtype, rep = self.cfg.grpo, self.cfg.train.dtype, self.replica
        records = [self.train_records[i] for i in self.order.take(g.prompts_per_step, rep.dp_rank, rep.dp)]
        rows = [r for r in records for _ in range(g.group_size)]  # the G completions of a prompt are contiguous
        prompts = [prompt_ids(self.tokenizer, r["question"]) for r in rows]
        seeds = request_seeds(self.cfg.train.seed, self.state.step, rep.dp_rank, len(rows))

        with self.timers("generate"):
            t0 = time.perf_counter()
            sampler = self.sampler()
            rollouts: list[list[Rollout]] = []  # [minibatch][micro-batch]
            for k in range(g.minibatches):
                batches = self._micro(prompts, k)
                params = [max_new_tokens_for(sampler.model, b, self.params) for b in batches]
                rollouts.append(sampler.generate(batches, params, self._micro(seeds, k), pad_id=self.tokenizer.pad_id,
                                                 dtype=dtype, decode=self.tokenizer.decode))
            t_generate = time.perf_counter() - t0
        flat = [ro for mb in rollouts for ro in mb]
        with self.timers("score"):
            rewards, failures = None, 0
            if rep.is_replica_source:
                texts = [self.tokenizer.decode(ro.completion(b)) for ro in flat for b in range(ro.batch_size)]
                ids = [f"step{self.state.step}/dp{rep.dp_rank}/row{i}" for i in range(len(rows))]
                rewards, failures = score(texts, [r["answer"] for r in rows], ids, self.reward_fn)
            rewards, failures = rep.share_in_replica((rewards, failures))
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
                adv = self._micro(list(advantages.unbind(0)), k)
                micro_batches = [grpo_micro_batch(ro, rp, torch.stack(a), ref)
                                 for ro, rp, a, ref in zip(mb_rollouts, replayed, adv, refs[k])]
                with self.timers("update"):
                    stats = self.engine.train_step(micro_batches, self.objective, count_completion_tokens)
                t_learn += time.perf_counter() - t0
                step_stats.append(stats)
                self.state.updates += 1
                self.state.nonfinite_total += int(stats.skipped)
                if stats.skipped:
                    log.warning("GRPO step %d, update %d: non-finite loss/gradient, skipped", self.state.step,
                                self.state.updates)

        scalars = reduce_step_metrics(rep, rewards, failures, flat, self.objective.records,
                                      first_records=num_micro_batches(self.cfg), epochs=g.epochs,
                                      t_generate=t_generate, t_learn=t_learn, with_reference=self.reference is not None)
        scalars.update({
            "train/loss": sum(s.loss for s in step_stats) / len(step_stats),
            "train/grad_norm": max(s.grad_norm for s in step_stats),
            "train/lr": step_stats[-1].lr,
            "train/nonfinite_skipped": float(self.state.nonfinite_total),
        })
        self.state.completions += len(rows) * rep.dp
        return scalars

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> Optional[float]:
        """Held-out greedy accuracy on the first grpo.eval_size records, each replica taking
        every dp-th of them."""
        n = min(self.cfg.grpo.eval_size, len(self.eval_records))
        if n == 0:
            return None
        rep = self.replica
        with self.timers("eval"):
            sampler = self.sampler()  # on every rank (a collective under ZeRO-3), records or not
            mine = [self.eval_records[i] for i in range(rep.dp_rank, n, rep.dp)]
            accuracy = 0.0
            if mine:
                accuracy, _ = greedy_accuracy(sampler, self.tokenizer, mine, self.cfg, self.cfg.train.dtype)
            correct, total = rep.sum_over_dp([accuracy * len(mine), float(len(mine))])
            accuracy = correct / total
        self.metrics.log(self.state.step, {"eval/accuracy": accuracy})
        log.info("GRPO step %d: held-out greedy accuracy %.3f (%d problems)", self.state.step, accuracy, n)
        return accuracy

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        return save_trainer_checkpoint(self.ckpt, self.engine, self.cfg, self.replica.rank, self.state,
                                       self.order.state_dict(), kind="grpo")

    def resume(self) -> None:
        def restore(saved: dict) -> None:
            self.state = GRPOState(**saved["state"])
            self.order.load_state_dict(saved["data"])

        path = resume_trainer_checkpoint(self.ckpt, self.engine, self.cfg, self.replica.rank, restore)
        if path is not None:
            self.state.last_checkpoint = str(path)
            log.info("resumed GRPO from %s at step %d", path, self.state.step)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        cfg = self.cfg
        self.resume()
        if self.replica.rank == 0:
            Path(cfg.logging.dir).mkdir(parents=True, exist_ok=True)
            save_config(cfg, Path(cfg.logging.dir) / "config.yaml")
        if self.state.step == 0:
            self.state.accuracy_before = self.evaluate()
        bar = tqdm(total=cfg.train.steps, initial=self.state.step,
                   disable=not (cfg.logging.progress and self.replica.rank == 0), desc="grpo", dynamic_ncols=True)
        scalars: dict[str, float] = {}
        accuracy = None
        steps_in_window = 0
        end = cfg.train.steps if cfg.train.stop_after is None else min(cfg.train.steps,
                                                                       self.state.step + cfg.train.stop_after)
        try:
            while self.state.step < end:
                scalars = self.train_step()
                self.state.step += 1
                steps_in_window += 1
                bar.update(1)
                step = self.state.step
                if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                    times = {k: v / steps_in_window for k, v in self.timers.pop().items()}  # seconds per step
                    self.metrics.log(step, {**scalars, **times})
                    steps_in_window = 0
                    bar.set_postfix(reward=f"{scalars['reward/mean']:.3f}", loss=f"{scalars['train/loss']:.4f}")
                last = step == cfg.train.steps
                if (cfg.grpo.eval_every and step % cfg.grpo.eval_every == 0) or last:
                    accuracy = self.evaluate()
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < end:
                    self.save()
            if self.state.step > 0 and not (self.state.last_checkpoint or "").endswith(f"{self.state.step:08d}"):
                self.save()
        finally:
            bar.close()
            self.metrics.close()
        return {"step": self.state.step, "eval/accuracy_before": self.state.accuracy_before,
                "eval/accuracy": accuracy, **scalars}


# ---------------------------------------------------------------------- set-up
def request_seeds(seed: int, step: int, dp_rank: int, num: int) -> list[int]:
    """Per-request sampling seeds from (run seed, step, global row): replicas draw independent
    samples, and a resumed run draws the same ones."""
    base = (seed * 1_000_003 + step) * 65_536 + dp_rank * num
    return [base + i for i in range(num)]


def num_micro_batches(cfg: Config) -> int:
    """Rollout micro-batches per minibatch: grad_accum, each cut into pieces when the pipeline
    keeps more micro-batches in flight than grad_accum (dims.micro_batch_plan)."""
    pieces, _ = micro_batch_plan(cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.parallel.micro_batches)
    return cfg.train.grad_accum * pieces


def engine_config(cfg: Config) -> Config:
    """The config the engine and the layout are built from: train.steps counts optimizer steps
    (epochs x minibatches per GRPO step, for the learning-rate schedule) and
    train.micro_batch_size is a minibatch's rows / grad_accum."""
    g, accum, M = cfg.grpo, cfg.train.grad_accum, cfg.parallel.micro_batches
    rows = g.prompts_per_step * g.group_size // g.minibatches
    if rows % accum:
        raise ConfigError(f"train.grad_accum={accum} does not divide a GRPO minibatch of {rows} rows "
                          f"(grpo.prompts_per_step x grpo.group_size / grpo.minibatches): choose among "
                          f"{[a for a in range(1, rows + 1) if rows % a == 0]}")
    micro = rows // accum
    if M > accum and (M % accum or micro % (M // accum)):
        raise ConfigError(f"parallel.micro_batches={M} rollout micro-batches in flight cannot be formed from a "
                          f"GRPO minibatch of {rows} rows in train.grad_accum={accum} micro-batches: with M > "
                          "grad_accum, M must be a multiple of grad_accum dividing the minibatch's rows; or set "
                          f"train.grad_accum={M}")
    if M <= accum and accum % M:
        raise ConfigError(f"train.grad_accum={accum} is not a multiple of parallel.micro_batches={M}: a GRPO "
                          f"minibatch's micro-batches run in rounds of {M}")
    updates = cfg.train.steps * g.epochs * g.minibatches
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=updates, micro_batch_size=micro))


def run(cfg: Config) -> dict:
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    check_vocab(cfg, tokenizer)
    try:
        reward_fn = resolve_reward(cfg.grpo.reward)
    except ValueError as exc:
        raise ConfigError(f"grpo.reward: {exc}") from None
    built = engine_config(cfg)
    with distributed.launch(built) as dims:  # None: one process, the local engine
        return _run(cfg, built, dims, tokenizer, reward_fn)


def _run(cfg: Config, built: Config, dims, tokenizer: Tokenizer, reward_fn: RewardFn) -> dict:
    stats = DataStats()
    train_recs, eval_recs = train_eval_records(cfg.data, pair_of(cfg.sft.prompt_field, cfg.sft.answer_field),
                                               ["question", "answer"], stats, seed=cfg.train.seed)
    trainer = build_trainer(cfg, built, dims, tokenizer, reward_fn, train_recs, eval_recs)
    result = trainer.run()
    result["data/skipped"] = stats.total
    return result


def build_trainer(cfg: Config, built: Config, dims, tokenizer: Tokenizer, reward_fn: RewardFn, train_recs,
                  eval_recs) -> GRPOTrainer:
    """The trainer on one process (dims None) or on this rank of a layout; ``built`` is
    ``engine_config(cfg)``. train.init_from (e.g. the export of an SFT run), when set, is
    applied by the builders."""
    reference = None
    fast = cfg.sampling.fast_decode
    if dims is None:
        model, engine, _ = build_local(built)
        sampler = Sampler(model, fast_decode=fast)
        if cfg.grpo.kl_coef > 0:  # the initial policy, frozen
            reference = Sampler(copy.deepcopy(model).requires_grad_(False), fast_decode=fast)

        def policy() -> Sampler:
            return sampler
    else:
        _, engine = build_distributed(built, dims)
        comms = Comms.from_dims(dims)
        if cfg.grpo.kl_coef > 0:  # the initial policy in the same layout, frozen
            reference = Sampler(distributed.build_frozen(built, dims, initial_model(built, dims)), comms, dims.layers,
                                fast_decode=fast)

        def policy() -> Sampler:
            return Sampler(engine.sampling_module(), comms, dims.layers, fast_decode=fast)
    replica = Replica(dims)
    log.info("GRPO: %d train prompts, %d held-out; %d x %d completions per step and replica (%d replicas) in %d "
             "minibatches of %d micro-batches, %d epochs", len(train_recs), len(eval_recs), cfg.grpo.prompts_per_step,
             cfg.grpo.group_size, replica.dp, cfg.grpo.minibatches, num_micro_batches(built), cfg.grpo.epochs)
    # The trainer's config: the user's (train.steps in GRPO steps) with the derived micro-batch size.
    trainer_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                     micro_batch_size=built.train.micro_batch_size))
    return GRPOTrainer(trainer_cfg, engine, policy, tokenizer, train_recs, eval_recs, reward_fn, reference, replica)
