"""Packed SFT (``data.pack: true``): several prompt/answer pairs in one row of data.seq_len
positions instead of one pair a row padded to the longest.

A pair of n tokens (prompt + answer) is a document of n - 1 positions: inputs ids[:-1],
targets ids[1:] with the prompt's targets IGNORE (sft_batch's layout, the answer tokens
alone carry loss). Rows are filled best-fit (each pair, in a seeded shuffled order, goes to
the open row it fills most tightly), once at start-up: the rows are then fixed records that
the seeded, resumable ``RecordOrder`` draws and reshuffles each epoch, as unpacked pairs are.

With ``data.reset_at_document: true`` the batch carries ``doc_starts`` (model/documents.py)
and each pair is computed as if alone in its row: the loss of a packed batch is the sum of
its pairs' losses one per row, over the same token count. Without it the pairs are merely
concatenated (each prompt opens with end-of-text, the separator of pretraining's packing).
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch

from rlt_mega.data.pairs import write_targets
from rlt_mega.loss import DOC_STARTS, IGNORE


def pack_rows(lengths: Sequence[int], capacity: int, order: Sequence[int]) -> list[list[int]]:
    """Best-fit packing: the records ``order`` (indices into lengths, each length <= capacity)
    -> rows, each a list of record indices whose lengths sum to <= capacity, in the order
    placed. O(N log N) over a sorted list of the open rows' free space."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free positions, row index), sorted
    for i in order:
        n = lengths[i]
        if not 0 < n <= capacity:
            raise ValueError(f"record {i} of {n} positions cannot go into a row of {capacity}")
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([i])
            left, row = capacity - n, len(rows) - 1
        else:
            left, row = free.pop(at)
            rows[row].append(i)
            left -= n
        if left > 0:
            bisect.insort(free, (left, row))
    return rows


def packed_batch(rows: Sequence[Sequence[tuple]], pad_id: int, length: int, reset: bool) -> dict:
    """rows: per row, its pairs as (ids, num_prompt, observed) -> {'inputs', 'targets'} (B,
    length) and, with ``reset``, 'doc_starts' (B, length) bool. Each pair fills len(ids) - 1
    positions, with sft_batch's targets (pairs.write_targets); the row's tail is padding (pad_id,
    IGNORE) that continues its last pair's document."""
    inputs = torch.full((len(rows), length), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    starts = torch.zeros((len(rows), length), dtype=torch.bool)
    for b, pairs in enumerate(rows):
        at = 0
        for ids, num_prompt, observed in pairs:
            x = torch.as_tensor(ids, dtype=torch.long)
            n = len(x) - 1
            if at + n > length:
                raise ValueError(f"pairs of {at + n} positions overflow a packed row of {length}")
            inputs[b, at:at + n] = x[:-1]
            write_targets(targets[b], at, x, num_prompt, observed)
            starts[b, at] = True
            at += n
    out = {"inputs": inputs, "targets": targets}
    if reset:
        out[DOC_STARTS] = starts
    return out


class PackedPairs:
    """Tokenized pairs (``ids``, ``num_prompt`` columns) packed into rows of ``length``
    positions; ``batch(row_indices)`` builds a packed batch of those rows."""

    def __init__(self, pairs, length: int, pad_id: int, reset: bool, seed: int, shuffle: bool = True) -> None:
        self.ids, self.num_prompt = list(pairs["ids"]), list(pairs["num_prompt"])
        self.observed = list(pairs["observed"]) if "observed" in pairs else [[]] * len(self.ids)
        self.length, self.pad_id, self.reset = length, pad_id, reset
        lengths = [len(x) - 1 for x in self.ids]
        if shuffle:
            order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
        else:
            order = list(range(len(lengths)))
        self.rows = pack_rows(lengths, length, order)
        self.num_positions = sum(lengths)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def fill(self) -> float:
        """The fraction of the rows' positions that hold pairs (not padding)."""
        return self.num_positions / max(1, len(self.rows) * self.length)

    def batch(self, rows: Sequence[int]) -> dict:
        pairs = [[(self.ids[i], self.num_prompt[i], self.observed[i]) for i in self.rows[r]] for r in rows]
        return packed_batch(pairs, self.pad_id, self.length, self.reset)
