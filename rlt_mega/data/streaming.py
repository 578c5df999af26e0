"""Streaming pretraining data (``data.streaming: true``): documents read as they arrive from a
hub dataset or local files, split over the data-parallel ranks with ``datasets``'
``split_dataset_by_node``, tokenized and packed into windows on the fly, as torchtitan does.

Each rank packs its own documents into one continuous token stream (documents in stream
order, each followed by end-of-text) and cuts windows of seq_len + 1 from it; an exhausted
stream starts its next epoch (``set_epoch``), the stream carrying on across the boundary. The
ranks never wait for one another: they read disjoint documents (whole shards when the shard
count is a multiple of the data-parallel size, else every dp-th document).

Resume is exact. A rank's state is the stream's own ``state_dict`` (the position after the
last document it pulled), the tokens pulled but not yet in a window, and, with
``data.shuffle_buffer``, the buffer's windows and generator. Every rank's state is gathered at
each checkpoint (``gather``), since the trainer saves rank 0's data state, and each rank takes
its own back on resume.

Without ``data.eval``, 2% of the documents (by a CRC32 of their text) are held out: every rank
skips them in training, and the evaluation windows are packed from the first of them.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import datasets
import numpy as np
import torch

from rlt_mega.data.datasets import DataError, DataStats
from rlt_mega.data.sources import texts_of
from rlt_mega.data.tokenizer import Tokenizer

HOLDOUT = 50  # one document in HOLDOUT is held out for evaluation when data.eval is unset
ROWS_PER_PULL = 32  # rows tokenized together (encode_batch); all are kept in the state until packed


def is_heldout(text: str) -> bool:
    return zlib.crc32(text.encode("utf-8")) % HOLDOUT == 0


def _columns(rows: list[dict]) -> dict:
    return {key: [row.get(key) for row in rows] for key in rows[0]}


class StreamingBatches:
    """Endless batches (batch_size, seq_len + 1) packed from this rank's stream of documents."""

    def __init__(self, rows: datasets.IterableDataset, tokenizer: Tokenizer, seq_len: int, batch_size: int,
                 seed: int, text_field: Optional[str] = None, shuffle_buffer: int = 0, holdout: bool = False,
                 rank: int = 0, world: int = 1, stats: Optional[DataStats] = None, name: str = "the stream",
                 gather: Callable[[dict], list] = lambda state: [state]) -> None:
        self.rows, self.tokenizer, self.window, self.batch_size = rows, tokenizer, seq_len + 1, batch_size
        self.text_field, self.shuffle_buffer, self.holdout = text_field, shuffle_buffer, holdout
        self.rank, self.world, self.gather, self.name = rank, world, gather, name
        self.stats = stats if stats is not None else DataStats()
        self.epoch = 0
        self.tokens_this_epoch = 0  # an epoch that yields none would loop for ever
        self.pending = np.zeros(0, dtype=np.int64)  # tokens pulled, not yet in a window
        self.buffer: list[np.ndarray] = []  # the shuffle buffer's windows
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self._iterator = None
        self._loaded_stream: Optional[dict] = None  # the stream position restored, until it moves on

    # ------------------------------------------------------------------ reading
    def _pull(self) -> None:
        """Reads up to ROWS_PER_PULL rows and appends their documents' tokens to ``pending``."""
        if self._iterator is None:
            self._iterator = iter(self.rows)
        rows = []
        while len(rows) < ROWS_PER_PULL:
            try:
                rows.append(next(self._iterator))
            except StopIteration:
                if rows:
                    break
                if self.tokens_this_epoch == 0:
                    raise DataError(f"{self.name}: data-parallel rank {self.rank} of {self.world} got no usable "
                                    "documents in a whole epoch; use a larger source or fewer ranks") from None
                self.epoch, self.tokens_this_epoch = self.epoch + 1, 0
                self.rows.set_epoch(self.epoch)
                self._iterator = iter(self.rows)
        texts, bad = texts_of(_columns(rows), self.text_field)
        if bad:
            self.stats.add(self.name, {reason: bad.count(reason) for reason in set(bad)})
        if self.holdout:
            texts = [t for t in texts if not is_heldout(t)]
        eos = self.tokenizer.eos_id
        tokens = [np.asarray(ids + [eos], dtype=np.int64) for ids in self.tokenizer.encode_batch(texts)]
        if tokens:
            self.pending = np.concatenate([self.pending, *tokens])
            self.tokens_this_epoch += sum(len(t) for t in tokens)

    def _next_window(self) -> np.ndarray:
        while len(self.pending) < self.window:
            self._pull()
        window, self.pending = self.pending[:self.window], self.pending[self.window:]
        return window

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        rows = []
        for _ in range(self.batch_size):
            if not self.shuffle_buffer:
                rows.append(self._next_window())
                continue
            while len(self.buffer) < self.shuffle_buffer:
                self.buffer.append(self._next_window())
            pick = int(torch.randint(self.shuffle_buffer, (1,), generator=self.generator))
            rows.append(self.buffer[pick])
            self.buffer[pick] = self._next_window()
        return torch.from_numpy(np.stack(rows))  # (batch_size, seq_len + 1)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Every data-parallel rank's state (a collective: every rank calls it at the same step)."""
        mine = {"epoch": self.epoch, "tokens_this_epoch": self.tokens_this_epoch,
                "stream": self.rows.state_dict() if self._iterator is not None else self._loaded_stream,
                "pending": torch.from_numpy(self.pending.astype(np.int32)),
                "buffer": torch.from_numpy(np.stack(self.buffer).astype(np.int32)) if self.buffer else None,
                "generator": self.generator.get_state()}
        return {"stream_ranks": self.gather(mine)}

    def load_state_dict(self, state: dict) -> None:
        ranks = state["stream_ranks"]
        if len(ranks) != self.world:
            raise ValueError(f"the checkpoint holds the streams of {len(ranks)} data-parallel ranks, this run has "
                             f"{self.world}: a stream cannot be split again; resume with the same layout")
        mine = ranks[self.rank]
        self.epoch, self.tokens_this_epoch = int(mine["epoch"]), int(mine["tokens_this_epoch"])
        self.pending = mine["pending"].numpy().astype(np.int64)
        self.buffer = list(mine["buffer"].numpy().astype(np.int64)) if mine["buffer"] is not None else []
        self.generator.set_state(mine["generator"])
        self.rows.set_epoch(self.epoch)
        if mine["stream"] is not None:
            self.rows.load_state_dict(mine["stream"])
        self._iterator, self._loaded_stream = None, mine["stream"]


def heldout_windows(rows: datasets.IterableDataset, tokenizer: Tokenizer, seq_len: int, num_windows: int,
                    text_field: Optional[str], name: str) -> torch.Tensor:
    """The evaluation windows (n, seq_len + 1): the held-out documents from the start of the
    whole stream, packed as training packs. The same on every rank."""
    window, eos = seq_len + 1, tokenizer.eos_id
    pending: list[int] = []
    for batch in rows.iter(batch_size=ROWS_PER_PULL):
        texts = [t for t in texts_of(batch, text_field)[0] if is_heldout(t)]
        for ids in tokenizer.encode_batch(texts):
            pending += ids + [eos]
        if len(pending) >= num_windows * window:
            break
    count = min(num_windows, len(pending) // window)
    if count == 0:
        raise DataError(f"{name}: the held-out documents (1 in {HOLDOUT}) hold {len(pending)} tokens, fewer than "
                        f"data.seq_len + 1 = {window}; set data.eval to an evaluation source")
    return torch.tensor(pending[:count * window], dtype=torch.int64).view(count, window)
