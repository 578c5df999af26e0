"""Supervised fine-tuning: prompt/answer pairs (GSM8K format: ``question``, ``answer``, from
generated problems, a local jsonl or a hub dataset), cross-entropy on the answer tokens only,
the dense schedule; the job and the loop of pretraining (train/supervised.py), on one process
or on any tensor/pipeline/ZeRO layout (launched as pretraining is)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rlt_mega.config import Config, ConfigError
from rlt_mega.data.datasets import DataStats, RecordOrder, pair_of, train_eval_records
from rlt_mega.data.packing import PackedPairs
from rlt_mega.data.pairs import Pieces, tokenize_pairs, write_targets
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.log import get_logger
from rlt_mega.loss import IGNORE
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.train import supervised

log = get_logger(__name__)


def sft_batch(rows: dict, pad_id: int, length: Optional[int] = None) -> dict:
    """rows: {'ids': [list], 'num_prompt': [int]}, and with sft.env 'observed' ([list]: the
    environment's observation tokens, data/pairs.py) -> {'inputs', 'targets'} (B, T),
    right-padded to the longest row (or to ``length``); targets are IGNORE on the prompt, the
    observations and the padding (loss on the model's answer tokens only)."""
    ids, num_prompt = rows["ids"], rows["num_prompt"]
    observed = rows.get("observed", [[]] * len(ids))
    T = length if length is not None else max(len(x) for x in ids) - 1
    inputs = torch.full((len(ids), T), pad_id, dtype=torch.long)
    targets = torch.full((len(ids), T), IGNORE, dtype=torch.long)
    for b, (x, p, obs) in enumerate(zip(ids, num_prompt, observed)):
        x = torch.as_tensor(x, dtype=torch.long)
        inputs[b, :len(x) - 1] = x[:-1]
        write_targets(targets[b], 0, x, p, obs)
    return {"inputs": inputs, "targets": targets}


class SFTBatches:
    """grad_accum batches per step (supervised.BatchSource) of ``batch_size`` records each, drawn
    by a seeded, resumable RecordOrder: ``batch_of(indices)`` builds one (a record is a pair, or
    with data.pack a packed row of pairs)."""

    def __init__(self, num_records: int, batch_of: Callable[[list[int]], dict], batch_size: int, grad_accum: int,
                 seed: int, shuffle: bool = True, rank: int = 0, world: int = 1) -> None:
        self.batch_of, self.batch_size, self.grad_accum = batch_of, batch_size, grad_accum
        self.rank, self.world = rank, world
        self.order = RecordOrder(num_records, seed, shuffle)

    def next_batches(self) -> list[dict]:
        return [self.batch_of(self.order.take(self.batch_size, self.rank, self.world))
                for _ in range(self.grad_accum)]

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)


def run(cfg: Config) -> dict:
    return supervised.run(cfg, pair_data)


def pair_data(cfg: Config, dims: ParallelDims, tokenizer: Tokenizer, stats: DataStats):
    """This data-parallel rank's prompt/answer pairs and the held-out ones (supervised.DataFn)."""
    extract = pair_of(cfg.sft.prompt_field, cfg.sft.answer_field)
    train_recs, eval_recs = train_eval_records(cfg.data, extract, ["question", "answer"], stats, seed=cfg.train.seed)
    pieces = episode_pieces(cfg.sft.env)
    train = tokenize_pairs(train_recs, tokenizer, cfg.data.seq_len, stats, f"{cfg.data.train} [train]", pieces)
    evald = tokenize_pairs(eval_recs, tokenizer, cfg.data.seq_len, stats, "eval", pieces)
    log.info("data: %d train pairs, %d eval pairs (answers truncated to data.seq_len=%d); %s", len(train),
             len(evald), cfg.data.seq_len, stats.summary())
    if cfg.data.pack:
        return _packed(cfg, dims, tokenizer, train, evald)
    # Data-parallel replicas read disjoint rows; the TP and PP ranks of a replica read the same.
    # The pipeline ring keeps micro-batches of one length in flight: pad to data.seq_len there.
    length = cfg.data.seq_len if dims.pp > 1 else None
    pad_id = tokenizer.pad_id
    batches = SFTBatches(len(train), lambda idx: sft_batch(train[idx], pad_id, length), cfg.train.micro_batch_size,
                         cfg.train.grad_accum, cfg.train.seed, cfg.data.shuffle, rank=dims.dp_rank, world=dims.dp)
    # The loss is pretraining's token cross-entropy: the prompt's targets are IGNORE, so only
    # answers count. train.init_from, when set, is applied by the builders.
    size = cfg.train.micro_batch_size
    num_eval = min(len(evald), cfg.train.eval_batches * size)

    def eval_batches() -> list[dict]:
        return [sft_batch(evald[start:start + size], pad_id, length) for start in range(0, num_eval, size)]

    return batches, eval_batches


def episode_pieces(spec: str) -> Optional[Pieces]:
    """sft.env: the environment whose written episodes the answers are -> its ``pieces``
    (None: plain answers)."""
    if not spec:
        return None
    from rlt_mega.rollout.env import Environment, resolve_env

    try:
        env = resolve_env(spec)
    except ValueError as exc:
        raise ConfigError(f"sft.env: {exc}") from None
    if type(env).pieces is Environment.pieces:
        raise ConfigError(f"sft.env={spec!r}: {type(env).__name__} does not find its observations in a written "
                          "answer (it does not implement Environment.pieces); leave sft.env empty to train on whole "
                          "answers")
    return env.pieces


def _packed(cfg: Config, dims: ParallelDims, tokenizer: Tokenizer, train, evald):
    """data.pack: the pairs best-fit into rows of data.seq_len positions (data/packing.py); with
    data.reset_at_document each pair is its own document. The eval pairs are packed the same
    way, in their order, and the first train.eval_batches batches of rows evaluated."""
    data, size = cfg.data, cfg.train.micro_batch_size
    rows = PackedPairs(train, data.seq_len, tokenizer.pad_id, data.reset_at_document, cfg.train.seed, data.shuffle)
    eval_rows = PackedPairs(evald, data.seq_len, tokenizer.pad_id, data.reset_at_document, cfg.train.seed,
                            shuffle=False)
    log.info("data: packed %d train pairs into %d rows of %d positions (%.1f%% filled), %d eval rows%s", len(train),
             len(rows), data.seq_len, 100 * rows.fill, len(eval_rows),
             ", documents reset the state" if data.reset_at_document
             else ", pairs attend across (no data.reset_at_document)")
    batches = SFTBatches(len(rows), rows.batch, size, cfg.train.grad_accum, cfg.train.seed, data.shuffle,
                         rank=dims.dp_rank, world=dims.dp)
    num_eval = min(len(eval_rows), cfg.train.eval_batches * size)

    def eval_batches() -> list[dict]:
        return [eval_rows.batch(list(range(start, min(start + size, num_eval)))) for start in range(0, num_eval, size)]

    return batches, eval_batches
