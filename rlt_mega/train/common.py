"""Pieces shared by SFT, GRPO, ``generate`` and ``eval``: starting weights, sampling
parameters from the config, batched generation of text and greedy GSM8K accuracy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import yaml
from safetensors.torch import load_model

from rlt_mega.checkpoint import CheckpointError, CheckpointManager, verify
from rlt_mega.config import Config, ModelConfig
from rlt_mega.data.pairs import prompt_ids
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.log import get_logger
from rlt_mega.model import RLT
from rlt_mega.rollout import Processing, SamplingParams, generate
from rlt_mega.rollout.rewards import gsm8k_reward, score

log = get_logger(__name__)

# Fields of ModelConfig that do not change what the weights compute.
_NOT_ARCHITECTURE = {"init_from", "max_seq_len", "init_std"}


def resolve_weights(path: str) -> Path:
    """A directory holding model.safetensors: the path itself, or the latest valid
    checkpoint under a checkpoint root."""
    p = Path(path).expanduser()
    if (p / "model.safetensors").is_file():
        if (p / "manifest.json").is_file():
            verify(p)  # a training checkpoint: checksums first
        return p
    if p.is_dir():
        latest = CheckpointManager(p).latest()
        if latest is not None:
            return latest
    raise CheckpointError(f"model.init_from={path}: neither a directory with model.safetensors nor a checkpoint "
                          "root with a valid checkpoint (a distributed checkpoint must be exported first)")


def _saved_model_config(directory: Path) -> Optional[dict]:
    if (directory / "config.yaml").is_file():
        return (yaml.safe_load((directory / "config.yaml").read_text()) or {}).get("model")
    if (directory / "config.json").is_file():
        data = json.loads((directory / "config.json").read_text())
        return data.get("model", data)
    return None


def load_initial_weights(model: RLT, cfg: ModelConfig, device: torch.device) -> Optional[Path]:
    """Loads model.init_from (if set) into ``model``, after checking that the saved model
    config agrees on every architectural field: the memory block C, for one, is part of the
    model but not of any weight's shape, so a shape check alone would not catch it."""
    if cfg.init_from is None:
        return None
    directory = resolve_weights(cfg.init_from)
    saved = _saved_model_config(directory)
    if saved is not None:
        ours = dataclasses.asdict(cfg)
        diff = {k: (saved[k], ours[k]) for k in saved if k in ours and k not in _NOT_ARCHITECTURE
                and saved[k] != ours[k]}
        if diff:
            raise CheckpointError(f"model.init_from={directory}: its model differs from this config in "
                                  + ", ".join(f"model.{k} (saved {a!r}, config {b!r})" for k, (a, b) in diff.items())
                                  + ": use the saved values")
    try:
        load_model(model, str(directory / "model.safetensors"), strict=True, device=str(device))
    except RuntimeError as exc:
        raise CheckpointError(f"model.init_from={directory}: the weights do not fit this model: {exc}") from None
    log.info("initial weights from %s", directory)
    return directory


def sampling_params(cfg: Config, tokenizer: Tokenizer, greedy: bool = False) -> SamplingParams:
    s = cfg.sampling
    processing = Processing(temperature=0.0) if greedy else Processing(s.temperature, s.top_k, s.top_p)
    return SamplingParams(processing, max_new_tokens=s.max_new_tokens, stop_token_ids=(tokenizer.eos_id,),
                          stop_strings=tuple(s.stop_strings))


def max_new_tokens_for(model: RLT, prompts: Sequence[Sequence[int]], params: SamplingParams) -> SamplingParams:
    """Caps max_new_tokens so the longest prompt plus its completion fits model.max_seq_len."""
    room = model.cfg.max_seq_len - max(len(p) for p in prompts)
    if room < 1:
        raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens leaves no room under "
                         f"model.max_seq_len={model.cfg.max_seq_len}: raise model.max_seq_len")
    return dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))


def generate_texts(model: RLT, tokenizer: Tokenizer, questions: Sequence[str], params: SamplingParams,
                   seeds: Sequence[int], batch_size: int, dtype: str = "fp32",
                   on_batch: Optional[Callable[[int], None]] = None) -> list[str]:
    """Completions (decoded, end-of-text stripped) for each question, generated in batches of
    similar prompt length (the batch advances in lockstep, so mixing lengths costs steps)."""
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Optional[str]] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = [prompts[i] for i in idx]
        rollout = generate(model, batch, max_new_tokens_for(model, batch, params), [seeds[i] for i in idx],
                           pad_id=tokenizer.pad_id, dtype=dtype, decode=tokenizer.decode)
        for row, i in enumerate(idx):
            out[i] = tokenizer.decode(rollout.completion(row))
        if on_batch is not None:
            on_batch(len(idx))
    return out  # type: ignore[return-value]


def greedy_accuracy(model: RLT, tokenizer: Tokenizer, records: Sequence[dict], cfg: Config,
                    dtype: str = "fp32") -> tuple[float, list[str]]:
    """Fraction of records whose greedy completion's answer equals the gold ``#### N``."""
    if len(records) == 0:
        raise ValueError("greedy accuracy of an empty set of records")
    questions = [r["question"] for r in records]
    completions = generate_texts(model, tokenizer, questions, sampling_params(cfg, tokenizer, greedy=True),
                                 seeds=[0] * len(questions), batch_size=cfg.sampling.batch_size, dtype=dtype)
    correct, _ = score(completions, [r["answer"] for r in records], list(range(len(records))), gsm8k_reward)
    return sum(correct) / len(correct), completions
