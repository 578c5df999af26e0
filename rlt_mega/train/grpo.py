"""The GRPO driver (DESIGN section 6), colocated: this process samples its own prompts and
learns from them with the same model.

One step, as named phases (each timed into the metrics):

    generate    prompts_per_step x group_size completions, in ``grpo.minibatches`` batches
                (one rollout call per learner minibatch: DESIGN section 3, granularity)
    score       rewards (a reward function that raises scores 0, logged and counted)
    advantages  group advantages (grpo / dr_grpo)
    reference   frozen-reference log-probs (only with grpo.kl_coef > 0), by replay
    replay      per minibatch: the rollout's own schedule with the current parameters
    update      per minibatch: hybrid log-probs (value = replay, gradient = dense), the
                clipped surrogate, one optimizer step; epochs x minibatches in all

Metrics (TensorBoard + metrics.jsonl): reward, accuracy, ratio min/mean/max, clip fraction,
support misses, max/mean |dense - replay|, KL(mu || dense), rollout and learner tokens/s,
phase times, held-out greedy accuracy. ``ratio/onpolicy_max_dev`` is max |ratio - 1| on the
first minibatch of each step, which the exactness contract makes exactly 0.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from rlt_mega.checkpoint import CheckpointManager, rng_state, set_rng_state
from rlt_mega.config import Config, ConfigError, save_config
from rlt_mega.data.datasets import DataStats, pair_of, train_eval_records
from rlt_mega.data.pairs import RecordOrder, prompt_ids
from rlt_mega.data.tokenizer import Tokenizer, load_tokenizer
from rlt_mega.learner.grpo import group_advantages, grpo_loss
from rlt_mega.learner.logprob import dense_logprobs, hybrid_logprobs, mismatch_metrics
from rlt_mega.log import get_logger
from rlt_mega.metrics import Metrics, Timers
from rlt_mega.model import RLT
from rlt_mega.parallel import distributed
from rlt_mega.rollout import Rollout, generate, replay
from rlt_mega.rollout.rewards import RewardFn, resolve_reward, score
from rlt_mega.train.common import greedy_accuracy, max_new_tokens_for, sampling_params
from rlt_mega.train.pretrain import build_local, check_vocab

log = get_logger(__name__)


@dataclass
class GRPOState:
    step: int = 0  # GRPO steps done (each: one rollout batch, epochs x minibatches updates)
    updates: int = 0  # optimizer steps
    completions: int = 0
    nonfinite_total: int = 0
    accuracy_before: Optional[float] = None
    last_checkpoint: Optional[str] = None


def _count(mb: dict) -> int:
    return mb["rollout"].num_completion_tokens()


class GRPOTrainer:
    def __init__(self, cfg: Config, model: RLT, engine, tokenizer: Tokenizer, train_records, eval_records,
                 reward_fn: RewardFn, reference: Optional[RLT] = None) -> None:
        self.cfg, self.model, self.engine, self.tokenizer = cfg, model, engine, tokenizer
        self.train_records, self.eval_records, self.reward_fn = train_records, eval_records, reward_fn
        self.reference = reference
        self.order = RecordOrder(len(train_records), cfg.train.seed, cfg.data.shuffle)
        self.params = sampling_params(cfg, tokenizer)
        self.state = GRPOState()
        self.ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep)
        self.metrics = Metrics(cfg.logging.dir)
        self.timers = Timers(torch.cuda.synchronize if torch.cuda.is_available() else None)
        self._minibatch_metrics: list[dict] = []

    # ------------------------------------------------------------------ one step
    def _seeds(self, num: int) -> list[int]:
        # Per-request seeds from (run seed, step, row): a resumed run draws the same samples.
        base = (self.cfg.train.seed * 1_000_003 + self.state.step) * 65_536
        return [base + i for i in range(num)]

    def train_step(self) -> dict[str, float]:
        g, dtype = self.cfg.grpo, self.cfg.train.dtype
        records = [self.train_records[i] for i in self.order.take(g.prompts_per_step)]
        rows = [r for r in records for _ in range(g.group_size)]  # the G completions of a prompt are contiguous
        prompts = [prompt_ids(self.tokenizer, r["question"]) for r in rows]
        seeds = self._seeds(len(rows))
        size = len(rows) // g.minibatches

        with self.timers("generate"):
            t0 = time.perf_counter()
            rollouts: list[Rollout] = []
            for k in range(g.minibatches):
                batch = prompts[k * size:(k + 1) * size]
                rollouts.append(generate(self.model, batch, max_new_tokens_for(self.model, batch, self.params),
                                         seeds[k * size:(k + 1) * size], pad_id=self.tokenizer.pad_id, dtype=dtype,
                                         decode=self.tokenizer.decode))
            t_generate = time.perf_counter() - t0
        with self.timers("score"):
            texts = [self.tokenizer.decode(ro.completion(b)) for ro in rollouts for b in range(ro.batch_size)]
            ids = [f"step{self.state.step}/row{i}" for i in range(len(rows))]
            rewards, failures = score(texts, [r["answer"] for r in rows], ids, self.reward_fn)
        with self.timers("advantages"):
            advantages = group_advantages(torch.tensor(rewards), g.group_size, g.advantage, g.advantage_eps)
            advantages = advantages.to(rollouts[0].mu.device)
        refs: list[Optional[torch.Tensor]] = [None] * len(rollouts)
        if self.reference is not None:
            with self.timers("reference"):
                refs = [replay(self.reference, ro) for ro in rollouts]

        self._minibatch_metrics = []
        step_stats = []
        t_learn = 0.0
        for epoch in range(g.epochs):
            for k, ro in enumerate(rollouts):
                t0 = time.perf_counter()
                with self.timers("replay"):
                    # Fresh caches under the current parameters (after the previous update).
                    replayed = replay(self.model, ro)
                mb = {"rollout": ro, "replay": replayed, "advantages": advantages[k * size:(k + 1) * size],
                      "ref": refs[k]}
                with self.timers("update"):
                    stats = self.engine.train_step([mb], self._loss, _count)
                t_learn += time.perf_counter() - t0
                step_stats.append(stats)
                self.state.updates += 1
                self.state.nonfinite_total += int(stats.skipped)
                if stats.skipped:
                    log.warning("GRPO step %d, update %d: non-finite loss/gradient, skipped", self.state.step,
                                self.state.updates)

        num_completion = sum(ro.num_completion_tokens() for ro in rollouts)
        num_learner = g.epochs * sum(ro.batch_size * ro.schedule.num_steps for ro in rollouts)
        scalars = {
            "reward/mean": sum(rewards) / len(rewards),
            "reward/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "reward/failures": float(failures),
            "completion/length_mean": num_completion / len(rows),
            "completion/stopped_fraction": sum(f != "length" for ro in rollouts for f in ro.finish_reasons) / len(rows),
            "train/loss": sum(s.loss for s in step_stats) / len(step_stats),
            "train/grad_norm": max(s.grad_norm for s in step_stats),
            "train/lr": step_stats[-1].lr,
            "train/nonfinite_skipped": float(self.state.nonfinite_total),
            # Completions generated per second of the generate phase.
            "perf/rollout_tokens_per_s": num_completion / max(t_generate, 1e-9),
            # Sequence positions (prompt + completion) the learner ran through replay and the
            # dense schedule, per second of the replay + update phases.
            "perf/learner_tokens_per_s": num_learner / max(t_learn, 1e-9),
        }
        scalars.update(self._reduce_minibatch_metrics())
        self.state.completions += len(rows)
        return scalars

    def _loss(self, model: RLT, mb: dict) -> torch.Tensor:
        ro: Rollout = mb["rollout"]
        dense = dense_logprobs(model, ro)
        logp = hybrid_logprobs(dense, mb["replay"])
        g = self.cfg.grpo
        # num_tokens_global=1: this returns the SUM over the minibatch's tokens; the engine
        # divides by the global completion-token count (every micro-batch, every DP rank).
        out = grpo_loss(logp, ro.mu, mb["advantages"], ro.mask, num_tokens_global=1.0, eps_low=g.eps_low,
                        eps_high=g.eps_high, ref_logp=mb["ref"], kl_coef=g.kl_coef if mb["ref"] is not None else 0.0)
        metrics = {k: float(v) for k, v in out.metrics.items()}
        metrics.update(mismatch_metrics(ro.mu, dense, mb["replay"], ro.mask))
        self._minibatch_metrics.append(metrics)
        return out.loss

    def _reduce_minibatch_metrics(self) -> dict[str, float]:
        ms = self._minibatch_metrics
        tokens = sum(m["num_tokens"] for m in ms)
        first = ms[0]  # epoch 0, minibatch 0: on-policy, every ratio must be exactly 1
        out = {
            "ratio/min": min(m["ratio_min"] for m in ms),
            "ratio/mean": sum(m["ratio_sum"] for m in ms) / max(tokens, 1),
            "ratio/max": max(m["ratio_max"] for m in ms),
            "ratio/clip_fraction": sum(m["clipped"] for m in ms) / max(tokens, 1),
            "ratio/onpolicy_max_dev": max(abs(first["ratio_max"] - 1.0), abs(first["ratio_min"] - 1.0)),
            "support/miss_fraction": sum(m["support_miss"] for m in ms) / max(tokens, 1),
            "mismatch/logprob_diff_max": max(m["logprob_diff_max"] for m in ms),
            "mismatch/logprob_diff_mean": sum(m["logprob_diff_mean"] * m["num_tokens"] for m in ms) / max(tokens, 1),
            # On the on-policy minibatch only: later ones were sampled before an update, so their
            # KL(mu || dense) would mix the policy's own drift into the schedule mismatch.
            "mismatch/kl_mu_dense": first["kl_mu_dense"],
            "mismatch/support_miss_dense": sum(m["support_miss_dense"] * m["num_tokens"] for m in ms) / max(tokens, 1),
        }
        if self.reference is not None:
            out["kl/reference"] = sum(m["kl_sum"] for m in ms) / max(tokens, 1)
        return out

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> Optional[float]:
        n = min(self.cfg.grpo.eval_size, len(self.eval_records))
        if n == 0:
            return None
        with self.timers("eval"):
            accuracy, _ = greedy_accuracy(self.model, self.tokenizer, [self.eval_records[i] for i in range(n)],
                                          self.cfg, self.cfg.train.dtype)
        self.metrics.log(self.state.step, {"eval/accuracy": accuracy})
        log.info("GRPO step %d: held-out greedy accuracy %.3f (%d problems)", self.state.step, accuracy, n)
        return accuracy

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        def write(tmp: Path) -> None:
            self.engine.save(tmp)
            torch.save({"state": asdict(self.state), "data": self.order.state_dict()}, tmp / "trainer.pt")
            save_config(self.cfg, tmp / "config.yaml")
            torch.save(rng_state(), tmp / "rng_rank0.pt")

        path = self.ckpt.save(self.state.step, write, meta={"layout": self.engine.layout(), "kind": "grpo"})
        self.state.last_checkpoint = str(path)
        log.info("saved checkpoint %s", path)
        return path

    def resume(self) -> None:
        path = self.ckpt.resolve(self.cfg.train.resume)
        if path is None:
            return
        self.engine.load(path)
        saved = torch.load(path / "trainer.pt", weights_only=False)
        self.state = GRPOState(**saved["state"])
        self.state.last_checkpoint = str(path)
        self.order.load_state_dict(saved["data"])
        if (path / "rng_rank0.pt").is_file():
            set_rng_state(torch.load(path / "rng_rank0.pt", weights_only=False))
        log.info("resumed GRPO from %s at step %d", path, self.state.step)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        cfg = self.cfg
        self.resume()
        Path(cfg.logging.dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, Path(cfg.logging.dir) / "config.yaml")
        if self.state.step == 0:
            self.state.accuracy_before = self.evaluate()
        bar = tqdm(total=cfg.train.steps, initial=self.state.step, disable=not cfg.logging.progress, desc="grpo",
                   dynamic_ncols=True)
        scalars: dict[str, float] = {}
        accuracy = None
        steps_in_window = 0
        while self.state.step < cfg.train.steps:
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
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and not last:
                self.save()
        bar.close()
        if self.state.step > 0 and not (self.state.last_checkpoint or "").endswith(f"{self.state.step:08d}"):
            self.save()
        self.metrics.close()
        return {"step": self.state.step, "eval/accuracy_before": self.state.accuracy_before,
                "eval/accuracy": accuracy, **scalars}


def run(cfg: Config) -> dict:
    if distributed.requested(cfg):
        raise ConfigError("rlt-mega grpo runs in one process for now (parallel.tp = parallel.pp = 1, "
                          "parallel.zero_stage = 0, no launcher): the sampler and replay under tensor/pipeline "
                          "parallelism and the ZeRO update are not wired in yet")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_vocab(cfg, tokenizer)
    if cfg.train.grad_accum != 1:
        log.warning("train.grad_accum=%d is not used by GRPO: each minibatch is one optimizer step "
                    "(set grpo.minibatches)", cfg.train.grad_accum)
    try:
        reward_fn = resolve_reward(cfg.grpo.reward)
    except ValueError as exc:
        raise ConfigError(f"grpo.reward: {exc}") from None
    stats = DataStats()
    train_recs, eval_recs = train_eval_records(cfg.data, pair_of(cfg.sft.prompt_field, cfg.sft.answer_field),
                                               ["question", "answer"], stats, seed=cfg.train.seed)
    # The engine's LR schedule counts optimizer steps: epochs x minibatches per GRPO step.
    updates = cfg.train.steps * cfg.grpo.epochs * cfg.grpo.minibatches
    # train.init_from (e.g. the export of an SFT run), when set, is applied by build_local.
    model, engine, _ = build_local(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=updates)))
    reference = None
    if cfg.grpo.kl_coef > 0:
        reference = copy.deepcopy(model).requires_grad_(False)  # frozen copy of the initial policy
    log.info("GRPO: %d train prompts, %d held-out; %d x %d completions per step in %d minibatches, %d epochs",
             len(train_recs), len(eval_recs), cfg.grpo.prompts_per_step, cfg.grpo.group_size, cfg.grpo.minibatches,
             cfg.grpo.epochs)
    trainer = GRPOTrainer(cfg, model, engine, tokenizer, train_recs, eval_recs, reward_fn, reference)
    result = trainer.run()
    result["data/skipped"] = stats.total
    return result
