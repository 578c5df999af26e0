"""The pretraining data of a run: which path serves it, and the batch source the trainer drives.

=========== ======================================== =========================================
path        config                                   what happens at start-up
=========== ======================================== =========================================
in memory   data.train: a local file, directory,     every rank reads, tokenizes and packs it
            hub name or "generated"                  (the demo, the tests, small local data)
indexed     data.train: PREFIX (rlt-mega preprocess) memory-maps PREFIX.bin; nothing tokenized
blend       data.blend: [w1, PREFIX1, w2, PREFIX2]   the same, several datasets in proportion
streaming   data.streaming: true                     reads documents as they arrive, per rank
=========== ======================================== =========================================

The in-memory and the indexed paths cut the same windows from the same corpus (``windows.py``)
and draw them in the same seeded order (``BatchIterator``), so for one corpus, seed and layout
their batches are equal, and a run can move from one to the other. Every source keeps its
position in ``state_dict``: the trainer's checkpoints hold it, and a resumed run continues
with the samples it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from rlt_mega.config import Config
from rlt_mega.data.blend import BlendedBatches, blending_index
from rlt_mega.data.datasets import (BatchIterator, DataError, DataStats, load_records, pack, text_of,
                                    train_eval_records)
from rlt_mega.data.indexed import IndexedTokens, is_indexed
from rlt_mega.data.streaming import StreamingBatches, heldout_windows
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.data.windows import TokenWindows
from rlt_mega.log import get_logger
from rlt_mega.loss import DOC_STARTS, shift

log = get_logger(__name__)

HELD_OUT = 50  # without data.eval, the last 1/HELD_OUT of an indexed dataset's documents are held out

Windows = Union[BatchIterator, BlendedBatches, StreamingBatches]


def window_batch(windows: torch.Tensor, doc_start_token: Optional[int] = None) -> dict:
    """Packed windows (B, T + 1) -> {'inputs', 'targets'} (B, T); with ``doc_start_token``
    (data.reset_at_document: the end-of-text id) also 'doc_starts' (B, T): a document begins at
    each end-of-text input, the separator the stream puts between documents, so a document's
    last position still predicts its end-of-text and the separator predicts the next
    document's first token from nothing but itself, as a prompt's leading end-of-text does."""
    inputs, targets = shift(windows)
    out = {"inputs": inputs, "targets": targets}
    if doc_start_token is not None:
        out[DOC_STARTS] = inputs == doc_start_token
    return out


class PackedBatches:
    """grad_accum batches of packed windows per step, as {'inputs', 'targets'} (and 'doc_starts'
    with ``doc_start_token``, see window_batch)."""

    def __init__(self, iterator: Windows, grad_accum: int) -> None:
        self.iterator, self.grad_accum = iterator, grad_accum
        self.doc_start_token: Optional[int] = None  # set by pretraining_data under data.reset_at_document

    def next_batches(self) -> list[dict]:
        return [window_batch(next(self.iterator), self.doc_start_token) for _ in range(self.grad_accum)]

    def state_dict(self) -> dict:
        return self.iterator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.iterator.load_state_dict(state)


@dataclass
class PretrainingData:
    batches: PackedBatches
    eval_windows: torch.Tensor  # (num_eval, T + 1), the same on every rank
    stats: DataStats
    path: str  # "in memory", "indexed", "blend" or "streaming"

    def eval_batches(self, micro_batch_size: int) -> list[dict]:
        return [window_batch(self.eval_windows[start:start + micro_batch_size], self.batches.doc_start_token)
                for start in range(0, len(self.eval_windows), micro_batch_size)]


def pretraining_data(cfg: Config, tokenizer: Tokenizer, dims, stats: Optional[DataStats] = None) -> PretrainingData:
    """The batch source and evaluation windows of ``cfg.data`` for this rank. ``dims`` is the
    run's layout (parallel/dims.py's ParallelDims): data-parallel replicas read disjoint
    samples, the tensor- and pipeline-parallel ranks of a replica the same ones. ``stats``
    counts the records skipped (a new one when not given). With data.reset_at_document the
    batches carry each window's documents (window_batch)."""
    if cfg.data.pack:
        raise DataError("data.pack=true packs SFT pairs; pretraining windows are always packed documents: "
                        "remove data.pack (data.reset_at_document=true keeps the documents apart)")
    out = _pretraining_data(cfg, tokenizer, dims, stats)
    if cfg.data.reset_at_document:
        out.batches.doc_start_token = tokenizer.eos_id
        log.info("data: documents reset the recurrent state at each end-of-text (data.reset_at_document)")
    return out


def _pretraining_data(cfg: Config, tokenizer: Tokenizer, dims, stats: Optional[DataStats]) -> PretrainingData:
    data, train = cfg.data, cfg.train
    rank, world = dims.dp_rank, dims.dp
    num_eval = train.eval_batches * train.micro_batch_size
    stats = stats if stats is not None else DataStats()

    def windows_batches(windows: TokenWindows) -> PackedBatches:
        return PackedBatches(BatchIterator(windows, train.micro_batch_size, train.seed, data.shuffle, rank, world),
                             train.grad_accum)

    if data.streaming:
        return _streaming(cfg, tokenizer, rank, world, dims, num_eval, stats)
    if data.blend is not None:
        return _blend(cfg, tokenizer, rank, world, num_eval, stats)
    if is_indexed(data.train):
        tokens = _open(data.train, tokenizer)
        if data.eval is None:
            first_eval = _held_out_start(tokens)
            train_windows = tokens.windows(data.seq_len, 0, first_eval)
            evals = tokens.windows(data.seq_len, first_eval, name=f"{tokens.prefix} (its last "
                                   f"{tokens.num_docs - first_eval} documents, held out)").first(num_eval)
        else:
            train_windows, evals = tokens.windows(data.seq_len), _eval_windows(cfg, tokenizer, num_eval, stats)
        log.info("data: indexed %s, %d documents, %d tokens: %d train windows, %d eval windows of %d tokens",
                 tokens.prefix, tokens.num_docs, tokens.num_tokens, len(train_windows), len(evals), data.seq_len)
        return PretrainingData(windows_batches(train_windows), evals, stats, "indexed")
    train_texts, eval_texts = train_eval_records(data, text_of(data.text_field), ["text"], stats, seed=train.seed)
    train_windows = pack(train_texts, tokenizer, data.seq_len, name=f"{data.train} [train]")
    evals = pack(eval_texts, tokenizer, data.seq_len, name=f"{data.eval or data.train} [eval]").first(num_eval)
    log.info("data: %d train windows, %d eval windows of %d tokens (in memory); %s", len(train_windows), len(evals),
             data.seq_len, stats.summary())
    return PretrainingData(windows_batches(train_windows), evals, stats, "in memory")


# ------------------------------------------------------------------------------ the paths
def _open(prefix: str, tokenizer: Tokenizer) -> IndexedTokens:
    tokens = IndexedTokens(prefix)
    tokens.check_tokenizer(tokenizer)
    return tokens


def _held_out_start(tokens: IndexedTokens) -> int:
    """The first held-out document: the last 1/HELD_OUT of them (at least one) are for evaluation."""
    if tokens.num_docs < 2:
        raise DataError(f"{tokens.prefix} has {tokens.num_docs} document(s), too few to hold out an eval split; "
                        "set data.eval")
    return tokens.num_docs - max(1, tokens.num_docs // HELD_OUT)


def _eval_windows(cfg: Config, tokenizer: Tokenizer, num_eval: int, stats: DataStats) -> torch.Tensor:
    """data.eval's first windows: an indexed dataset, or any source the in-memory path reads."""
    data = cfg.data
    if is_indexed(data.eval):
        return _open(data.eval, tokenizer).windows(data.seq_len).first(num_eval)
    records = load_records(data.eval, "eval", data, text_of(data.text_field), ["text"], stats)
    return pack(records, tokenizer, data.seq_len, name=f"{data.eval} [eval]").first(num_eval)


def _blend(cfg: Config, tokenizer: Tokenizer, rank: int, world: int, num_eval: int,
           stats: DataStats) -> PretrainingData:
    data, train = cfg.data, cfg.train
    weights, prefixes = data.blend[::2], data.blend[1::2]
    members = [_open(prefix, tokenizer) for prefix in prefixes]
    if data.eval is None:
        starts = [_held_out_start(m) for m in members]
        train_windows = [m.windows(data.seq_len, 0, s) for m, s in zip(members, starts)]
        held_out = [m.windows(data.seq_len, s, name=f"{m.prefix} (held out)") for m, s in zip(members, starts)]
        # the eval windows in the blend's proportions: the blending index over the held-out windows
        member_of, draw = blending_index(weights, num_eval)
        evals = torch.stack([held_out[m][d % len(held_out[m])] for m, d in zip(member_of.tolist(), draw.tolist())])
    else:
        train_windows = [m.windows(data.seq_len) for m in members]
        evals = _eval_windows(cfg, tokenizer, num_eval, stats)
    num_samples = train.steps * train.grad_accum * train.micro_batch_size * world
    blended = BlendedBatches(train_windows, weights, train.micro_batch_size, train.seed, data.shuffle, rank, world,
                             num_samples=num_samples)
    share = ", ".join(f"{w / sum(weights):.3f} {m.prefix} ({len(t)} windows)"
                      for w, m, t in zip(weights, members, train_windows))
    log.info("data: blend of %s; %d eval windows of %d tokens", share, len(evals), data.seq_len)
    return PretrainingData(PackedBatches(blended, train.grad_accum), evals, stats, "blend")


def _streaming(cfg: Config, tokenizer: Tokenizer, rank: int, world: int, dims, num_eval: int,
               stats: DataStats) -> PretrainingData:
    from datasets.distributed import split_dataset_by_node

    from rlt_mega.data.sources import stream_rows

    data, train = cfg.data, cfg.train
    if is_indexed(data.train):
        raise DataError(f"data.train={data.train} is an indexed dataset: it is memory-mapped, not streamed; set "
                        "data.streaming=false")
    rows, _ = stream_rows(data.train, data, "train")
    if world > 1 and rows.num_shards % world:
        log.info("data: %s has %d shard(s), not a multiple of the %d data-parallel ranks: each rank reads the whole "
                 "stream and keeps every %d-th document", data.train, rows.num_shards, world, world)
    holdout = data.eval is None
    if holdout:
        evals = heldout_windows(stream_rows(data.train, data, "train")[0], tokenizer, data.seq_len, num_eval,
                                data.text_field, data.train)
    else:
        evals = _eval_windows(cfg, tokenizer, num_eval, stats)
    batches = StreamingBatches(split_dataset_by_node(rows, rank=rank, world_size=world), tokenizer, data.seq_len,
                               train.micro_batch_size, train.seed, data.text_field, data.shuffle_buffer, holdout,
                               rank, world, stats, name=data.train, gather=dims.gather_over_dp)
    log.info("data: streaming %s (%d shard(s)) over %d data-parallel rank(s), shuffle buffer %d; %d eval windows "
             "of %d tokens%s", data.train, rows.num_shards, world, data.shuffle_buffer, len(evals), data.seq_len,
             " (held out: 1 document in 50)" if holdout else "")
    return PretrainingData(PackedBatches(batches, train.grad_accum), evals, stats, "streaming")
