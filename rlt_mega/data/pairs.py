"""Prompt/answer pairs for SFT, GRPO and evaluation: one prompt format for all three, and a
seeded, resumable record order.

The prompt is the end-of-text token (the separator pretraining puts before every document),
then the question and a newline; the answer follows and ends with end-of-text, which is also
where generation stops. So a model pretrained on ``question\\nanswer`` documents has already
seen exactly this layout.

With data.chat_template (a tokenizer loaded with ``chat_template=True``), the tokenizer's chat
template lays the pair out instead: the prompt is [user: question] with the generation prompt,
the answer what the template appends for [assistant: answer], ending with the token that ends
the turn (data/chat.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional, Sequence

import datasets
import torch

from rlt_mega.data.datasets import DataStats
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.loss import IGNORE


def prompt_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    if tokenizer.use_chat_template:
        return tokenizer.encode(tokenizer.chat_prompt(question))
    return [tokenizer.eos_id] + tokenizer.encode(question + "\n")


TOO_LONG = "prompt longer than model.max_seq_len"


def fitting_prompts(records: list[dict], tokenizer: Tokenizer, max_seq_len: int, stats: DataStats,
                    source: str) -> list[dict]:
    """The records whose prompt leaves room under ``max_seq_len`` for at least one generated
    token; the others are skipped and counted in ``stats`` under ``source`` (like malformed
    lines), at load, so that no batch that draws one fails later."""
    kept = [r for r in records if len(prompt_ids(tokenizer, r["question"])) < max_seq_len]
    if len(kept) < len(records):
        stats.add(source, Counter({f"{TOO_LONG} ({max_seq_len} tokens)": len(records) - len(kept)}))
    return kept


def answer_ids(tokenizer: Tokenizer, answer: str) -> list[int]:
    return tokenizer.encode(answer) + [tokenizer.eos_id]


def pair_ids(tokenizer: Tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of one SFT pair."""
    if tokenizer.use_chat_template:
        return tokenizer.chat_pair(question, answer)
    return prompt_ids(tokenizer, question), answer_ids(tokenizer, answer)


# A written episode of an environment -> its pieces in order, (text, True) for each observation
# (rollout/env/base.py ``Environment.pieces``).
Pieces = Callable[[str], list[tuple[str, bool]]]


def episode_pair_ids(tokenizer: Tokenizer, question: str, answer: str,
                     pieces: Pieces) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, answer ids, the indices of the answer's observation tokens) of an SFT pair
    whose answer is a written episode (``sft.env``). Each piece is tokenized on its own, an
    observation exactly as the environment's rollout appends it, so SFT trains on the token ids a
    rollout of the same transcript holds (a tokenizer may merge across a piece boundary when the
    whole answer is encoded at once); the observations carry no loss, as in GRPO."""
    if not tokenizer.use_chat_template:
        ids, observed = _pieces_ids(tokenizer, pieces(answer))
        return prompt_ids(tokenizer, question), ids + [tokenizer.eos_id], observed
    prompt, rest = tokenizer.chat_texts(question, answer)  # the template's text around the answer is the model's
    at = rest.find(answer)
    if at < 0:
        raise ValueError("the chat template does not hold the answer verbatim: its observations cannot be found")
    ids, observed = _pieces_ids(tokenizer, [(rest[:at], False), *pieces(answer), (rest[at + len(answer):], False)])
    end = tokenizer.turn_end_id
    ids = ids[:ids.index(end) + 1] if end in ids else ids + [tokenizer.eos_id]
    return tokenizer.encode(prompt), ids, [i for i in observed if i < len(ids)]


def _pieces_ids(tokenizer: Tokenizer, parts: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """The pieces tokenized one by one, in order -> (ids, the indices of the observations' ids)."""
    ids: list[int] = []
    observed: list[int] = []
    for text, is_observation in parts:
        piece = tokenizer.encode(text) if text else []
        if is_observation:
            observed += range(len(ids), len(ids) + len(piece))
        ids += piece
    return ids, observed


def write_targets(targets: torch.Tensor, at: int, ids: torch.Tensor, num_prompt: int, observed: Sequence[int]) -> None:
    """A pair's targets into one row of ``targets`` (IGNORE-filled), its first token at position
    ``at``: the target at position t is x_{t+1}, the answer's tokens only, and an observed token
    (an environment's observation, ``tokenize_pairs``) is no target."""
    targets[at + num_prompt - 1:at + len(ids) - 1] = ids[num_prompt:]
    if len(observed):
        targets[at + torch.as_tensor(observed, dtype=torch.long) - 1] = IGNORE


def tokenize_pairs(records: datasets.Dataset, tokenizer: Tokenizer, max_len: int, stats: DataStats,
                   source: str = "pairs", pieces: Optional[Pieces] = None) -> datasets.Dataset:
    """(question, answer) records -> ``ids`` (prompt + answer tokens) and ``num_prompt``; with
    ``pieces`` (answers are written episodes of an environment, ``episode_pair_ids``) also
    ``observed``, the indices into ``ids`` of the observation tokens (their targets carry no loss).

    Pairs longer than max_len + 1 tokens have their answer truncated (the loss then never sees
    its end-of-text); a prompt that leaves no answer token is skipped and counted.
    """
    window = max_len + 1

    def fn(batch: dict) -> dict:
        out = {"ids": [], "num_prompt": [], "observed": []}
        for q, a in zip(batch["question"], batch["answer"]):
            if pieces is None:
                (p, answer), observed = pair_ids(tokenizer, q, a), []
            else:
                p, answer, observed = episode_pair_ids(tokenizer, q, a, pieces)
            ids = (p + answer)[:window]
            out["ids"].append(ids if len(p) < len(ids) else [])
            out["num_prompt"].append(len(p))
            out["observed"].append([len(p) + i for i in observed if len(p) + i < len(ids)])
        if pieces is None:
            del out["observed"]
        return out

    features = datasets.Features({"ids": datasets.Sequence(datasets.Value("int64")),
                                  "num_prompt": datasets.Value("int64")})
    if pieces is not None:
        features["observed"] = datasets.Sequence(datasets.Value("int64"))
    tokenized = records.map(fn, batched=True, remove_columns=records.column_names, features=features)
    too_long = sum(1 for ids in tokenized["ids"] if not ids)
    if too_long:
        stats.add(source, {f"prompt of >= {max_len} tokens (raise data.seq_len)": too_long})
        tokenized = tokenized.filter(lambda ids: bool(ids), input_columns="ids")
    return tokenized


