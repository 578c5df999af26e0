"""Pieces shared by GRPO, ``generate`` and ``eval``: sampling parameters from the config,
batched generation of text and greedy GSM8K accuracy."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from rlt_mega.config import Config
from rlt_mega.data.pairs import prompt_ids
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.model.rlt import RLT
from rlt_mega.rollout import Processing, Sampler, SamplingParams
from rlt_mega.rollout.env import Environments
from rlt_mega.rollout.rewards import gsm8k_reward, score
from rlt_mega.rollout.turns import Episode


def sampling_params(cfg: Config, tokenizer: Tokenizer, greedy: bool = False) -> SamplingParams:
    s = cfg.sampling
    processing = Processing(temperature=0.0) if greedy else Processing(s.temperature, s.top_k, s.top_p)
    return SamplingParams(processing, max_new_tokens=s.max_new_tokens, stop_token_ids=tokenizer.stop_ids,
                          stop_strings=tuple(s.stop_strings))


def max_new_tokens_for(model: RLT, prompts: Sequence[Sequence[int]], params: SamplingParams) -> SamplingParams:
    """Caps max_new_tokens so the longest prompt plus its completion fits model.max_seq_len."""
    room = model.cfg.max_seq_len - max(len(p) for p in prompts)
    if room < 1:
        raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens leaves no room under "
                         f"model.max_seq_len={model.cfg.max_seq_len}: raise model.max_seq_len")
    return dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))


def generate_texts(model: RLT | Sampler, tokenizer: Tokenizer, questions: Sequence[str], params: SamplingParams,
                   seeds: Sequence[int], batch_size: int, dtype: str = "fp32",
                   on_batch: Optional[Callable[[int], None]] = None,
                   episodes: Optional[Sequence[Episode]] = None) -> list[str]:
    """Completions (decoded, end-of-text stripped) for each question, generated in batches of
    similar prompt length (the batch advances in lockstep, so mixing lengths costs steps).
    ``model``: a model on one process, or the Sampler of a model replica (every rank of the
    replica calls with the same questions). episodes: one environment episode per question (its
    observations are part of the completion's text)."""
    sampler = model if isinstance(model, Sampler) else Sampler(model)
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Optional[str]] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = [prompts[i] for i in idx]
        rollout = sampler.generate([batch], max_new_tokens_for(sampler.model, batch, params), [[seeds[i] for i in idx]],
                                   pad_id=tokenizer.pad_id, dtype=dtype, decode=tokenizer.decode,
                                   episodes=None if episodes is None else [[episodes[i] for i in idx]])[0]
        for row, i in enumerate(idx):
            out[i] = tokenizer.decode(rollout.completion(row))
        if on_batch is not None:
            on_batch(len(idx))
    return out  # type: ignore[return-value]


def greedy_accuracy(model: RLT | Sampler, tokenizer: Tokenizer, records: Sequence[dict], cfg: Config,
                    dtype: str = "fp32", envs: Optional[Environments] = None) -> tuple[float, list[str]]:
    """Fraction of records whose greedy completion's answer equals the gold ``#### N`` (with
    ``envs``: with the environment's turns, e.g. the calculator)."""
    if len(records) == 0:
        raise ValueError("greedy accuracy of an empty set of records")
    questions = [r["question"] for r in records]
    params = sampling_params(cfg, tokenizer, greedy=True)
    if envs is not None:
        params = dataclasses.replace(params, stop_token_ids=envs.stop_ids(params.stop_token_ids))
    completions = generate_texts(model, tokenizer, questions, params,
                                 seeds=[0] * len(questions), batch_size=cfg.sampling.batch_size, dtype=dtype,
                                 episodes=None if envs is None else envs.episodes(records))
    correct, _, _ = score(completions, [r["answer"] for r in records], list(range(len(records))), gsm8k_reward)
    return sum(correct) / len(correct), completions


def sampled_scores(model: RLT | Sampler, tokenizer: Tokenizer, records: Sequence[dict], indices: Sequence[int],
                   cfg: Config, dtype: str = "fp32", envs: Optional[Environments] = None) -> dict[str, float]:
    """pass@k, maj@k and mean@n (rlt_mega/rollout/evaluation.py) SUMMED over ``records``: n =
    eval.samples completions each at eval.temperature (sampling.temperature when null), with
    sampling's top-k/top-p. ``indices``: the records' positions in the evaluated set, which seed their
    samples, so that the figures do not depend on how the set is split over replicas."""
    from rlt_mega.config import ConfigError
    from rlt_mega.rollout.evaluation import metric_names, problem_scores
    from rlt_mega.rollout.rewards import extract_answer, gold_answer

    n, ks = cfg.eval.samples, list(cfg.eval.k)
    temperature = cfg.eval.temperature if cfg.eval.temperature is not None else cfg.sampling.temperature
    if temperature <= 0:
        raise ConfigError(f"eval.samples={n} draws samples but the temperature is {temperature}: set eval.temperature "
                          "(e.g. 1.0), or eval.samples=0 for the greedy accuracy only")
    base = sampling_params(cfg, tokenizer)
    params = dataclasses.replace(base, processing=dataclasses.replace(base.processing, temperature=temperature))
    if envs is not None:
        params = dataclasses.replace(params, stop_token_ids=envs.stop_ids(params.stop_token_ids))
    questions = [r["question"] for r in records for _ in range(n)]
    seeds = [cfg.train.seed * 1_000_003 + 2 ** 40 + i * n + j for i in indices for j in range(n)]
    episodes = None if envs is None else envs.episodes([r for r in records for _ in range(n)])
    completions = generate_texts(model, tokenizer, questions, params, seeds=seeds, batch_size=cfg.sampling.batch_size,
                                 dtype=dtype, episodes=episodes)
    totals = dict.fromkeys(metric_names(n, ks), 0.0)
    for p, record in enumerate(records):
        answers = [extract_answer(c) for c in completions[p * n:(p + 1) * n]]
        for name, value in problem_scores(answers, gold_answer(record["answer"]), ks, seed=indices[p]).items():
            totals[name] += value
    return totals
