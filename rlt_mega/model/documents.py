"""Document structure of a packed row: several documents in one row of the dense schedule,
with nothing crossing a boundary (``data.reset_at_document``).

A row of T positions holds documents back to back. Each is computed as if it were alone in
a row of its own, starting at position 0:

- RoPE positions restart at 0 at each document's first position (``positions``);
- encoder self-attention and decoder self-attention see keys of the same document only;
- the decoder at document-local position p sees the memory of the same document's positions
  < vis(p) = C * floor((p + 1) / C): memory blocks are counted from the document's start, so
  a document whose length is not a multiple of C ends with a partial block, whose memory
  only its own later positions could have seen (none do: the block is never committed);
- the recurrent state resets to z_init at each document's first position.

So the loss of a packed row is the sum of its documents' losses trained one per row (up to
floating-point rounding of the masked kernels).

The structure is one object built once per batch from a (B, T) bool tensor of document
starts (``batch["doc_starts"]``, the only thing the data path writes); every mask is a
device tensor computed here in a few batched ops, and a decoder step slices its row of
them (model/layout.py, ``Step.documents``), so no step syncs with the host. Padding appended
to a row continues its last document (causal: no earlier position changes).
"""

from __future__ import annotations

from typing import Optional

import torch

from rlt_mega.loss import DOC_STARTS
from rlt_mega.model.attention import encoder_attention


class Documents:
    """Per-row documents of a (B, T) batch; ``starts[:, 0]`` is always a start."""

    def __init__(self, starts: torch.Tensor) -> None:
        if starts.dim() != 2:
            raise ValueError(f"document starts must be (B, T) bool, got shape {tuple(starts.shape)}")
        T = starts.shape[1]
        starts = starts.to(torch.bool).clone()
        starts[:, 0] = True  # a row always begins a document (or the tail of one, cut by the window)
        idx = torch.arange(T, device=starts.device)
        first = torch.where(starts, idx, 0).cummax(dim=1).values  # (B, T) the row index of the document's start
        self.starts = starts  # (B, T)
        self.positions = idx - first  # (B, T) position within the document
        self.ids = starts.long().cumsum(dim=1)  # (B, T) document index within the row, from 1
        same = self.ids[:, :, None] == self.ids[:, None, :]  # (B, T query, T key)
        # (B, T, T) causal within the document; with memory(C) O(B T^2) bools, as the encoder's mask is
        self.attend = same & (idx[:, None] >= idx[None, :])
        self._same = same
        self._memory: dict[int, torch.Tensor] = {}
        self._rope: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._step_tables: Optional[tuple] = None  # (the decoder's tables, their rows (B, T, Dh) each)

    @classmethod
    def of(cls, batch: dict) -> Optional["Documents"]:
        """The batch's documents, None for a batch without ``doc_starts`` (one document a row)."""
        starts = batch.get(DOC_STARTS)
        return None if starts is None else cls(starts)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.starts.shape)

    def memory(self, C: int) -> torch.Tensor:
        """(B, T, 1 + T) bool: query position t sees memory slot 0 (null) and slot 1 + s iff s is
        in t's document and positions[s] < vis(positions[t]) = C * floor((positions[t] + 1) / C)."""
        if C not in self._memory:
            visible = C * ((self.positions + 1) // C)  # (B, T) document-local vis
            mem = self._same & (self.positions[:, None, :] < visible[:, :, None])  # (B, T, T)
            null = torch.ones_like(mem[:, :, :1])
            self._memory[C] = torch.cat([null, mem], dim=2)
        return self._memory[C]

    def rope(self, rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables at the documents' positions, (cos, sin) each (B, 1, T, Dh), gathered once
        per batch and dtype (``rotary``: the model's layers.Rotary); a step slices its column."""
        if dtype not in self._rope:
            self._rope[dtype] = rotary.rows(self.positions, dtype)
        return self._rope[dtype]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The encoder's self-attention, causal within each document: q (B, h, T, Dh), k, v
        (B, h_kv, T, Dh) -> (B, h, T, Dh)."""
        return encoder_attention(q, k, v, 0, self.attend)

    # ------------------------------------------------------------------ one decoder step
    def rope_rows(self, tables: tuple, t: int) -> tuple:
        """The decoder step's RoPE rows at step t, each row at its position in its document:
        ``tables`` (cos, sin_fwd, sin_bwd), (max_seq_len, Dh) each (model/kernels.py) -> the same,
        (B, 1, Dh) each (views of rows gathered once per batch and tables)."""
        if self._step_tables is None or self._step_tables[0] is not tables:
            rows = tuple(x[self.positions] for x in tables)  # (B, T, Dh) each
            self._step_tables = (tables, rows)
        return tuple(x[:, t, None] for x in self._step_tables[1])
