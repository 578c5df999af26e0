"""What GRPO derives from the run's config, in one place: the config as GRPO runs it
(``grpo_config``: train.micro_batch_size derived), the engine's shape (``engine_config``), the
rollout batches of a minibatch, the objective's settings, the per-request sampling seeds and
the environments (grpo.env)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from rlt_mega.config import Config, ConfigError, given
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.learner.correction import Correction
from rlt_mega.learner.objective import LossSettings
from rlt_mega.parallel.dims import micro_batch_plan
from rlt_mega.parallel.engine import EngineConfig
from rlt_mega.rollout.env import EnvLimits, Environments, resolve_env


def request_seeds(seed: int, step: int, share: int, num: int, round_: int = 0, dp: int = 1,
                  group_size: int = 1) -> list[int]:
    """Per-request sampling seeds from (run seed, step, sampling round, global row): replicas
    and dynamic sampling's rounds draw independent samples, a resumed run draws the same ones,
    and a row draws the same seed on every layout (so a queue of samples moves to another
    data-parallel size, train/async_grpo.py ``resplit``). Share ``share`` of ``dp`` holds every
    dp-th prompt of the step's global batch from ``share`` (``RecordOrder.take``), ``group_size``
    rows each: its row i is the global batch's row (share + dp * (i // group_size)) * group_size
    + i % group_size."""
    if not 0 <= share < dp:
        raise ValueError(f"request_seeds: share {share} of dp={dp}")
    base = (seed * 1_000_003 + step) * 65_536 + round_ * 2 ** 40
    return [base + (share + dp * (i // group_size)) * group_size + i % group_size for i in range(num)]


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
                        teacher_coef=g.teacher_coef, teacher_topk_coef=g.teacher_topk_coef)


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


@dataclass(frozen=True)
class RowCut:
    """A replica's rows of a step (prompts_per_step x group_size, a prompt's completions
    contiguous) cut into grpo.minibatches minibatches of ``batches_per_minibatch`` rollout
    batches each."""

    minibatch_rows: int
    batch_rows: int

    @classmethod
    def of(cls, cfg: Config) -> "RowCut":
        """From ``grpo_config(cfg)``."""
        g = cfg.grpo
        minibatch = g.prompts_per_step * g.group_size // g.minibatches
        return cls(minibatch, minibatch // batches_per_minibatch(cfg))

    def batches(self, items: list, k: int) -> list[list]:
        """Minibatch k of a per-replica row list, as its rollout batches."""
        mb = items[k * self.minibatch_rows:(k + 1) * self.minibatch_rows]
        return [mb[i:i + self.batch_rows] for i in range(0, len(mb), self.batch_rows)]
