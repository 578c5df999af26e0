"""Pretraining windows: fixed-length slices of one flat token stream, shared by the in-memory
and the indexed data paths so that both cut exactly the same windows from the same corpus.

The stream is the corpus's documents in order, each followed by its end-of-text token (what
``rlt-mega preprocess`` stores in a ``.bin`` file, back to back). Window k is
``stream[k (T + 1) : (k + 1)(T + 1)]``: the inputs and the shifted targets of one row, cut as
HF's run_clm ``group_texts`` cuts them; the tail shorter than a window is dropped.

Why not megatron-core's ``GPTDataset`` (0.16.1) on top of the same ``.bin``: it works here (on
CPU, with or without torch.distributed; its compiled helpers ship in the wheel), but its
samples are other ones: documents reshuffled at every epoch, then samples of T + 1 tokens that
overlap by one (stride T), so its batches could not equal the in-memory path's. It also builds
three ``.npy`` index files per configuration in a cache directory (by default inside the
dataset's directory, which a shared read-only dataset does not allow), rank 0 first behind a
barrier over the whole world, for a sample count fixed when it is built; and
``BlendedDataset`` calls ``torch.distributed.get_rank()`` without checking that it is
initialised. Windows at a fixed stride need no index at all (window k starts at token
k (T + 1)); the blend uses megatron-core's compiled blending index directly (``blend.py``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def token_dtype(vocab_size: int) -> type:
    """The narrowest dtype for token ids: megatron-core's rule (``DType.optimal_dtype``), so an
    in-memory stream takes the room its ``.bin`` file would."""
    return np.uint16 if vocab_size < 65500 else np.int32


class TokenWindows:
    """Windows of seq_len + 1 tokens at stride seq_len + 1 over a flat token stream.

    ``stream`` is a numpy array in memory (the in-memory path) or a read-only memory map of an
    indexed dataset's ``.bin`` (the indexed path). Reading a window touches only its own pages,
    so a data-parallel rank that reads only its rows never loads the rest of the file.
    """

    def __init__(self, stream: np.ndarray, seq_len: int, name: str, owner: object = None) -> None:
        self.stream, self.window, self.name = stream, seq_len + 1, name
        self.owner = owner  # what holds the memory map open while the windows are in use
        self.num_windows = len(stream) // self.window

    def __len__(self) -> int:
        return self.num_windows

    def read(self, rows: Sequence[int]) -> torch.Tensor:
        """Windows ``rows`` -> (len(rows), T + 1) int64."""
        out = np.empty((len(rows), self.window), dtype=np.int64)
        for i, k in enumerate(rows):
            if not 0 <= k < self.num_windows:
                raise IndexError(f"window {k} of {self.name}: it has {self.num_windows}")
            out[i] = self.stream[k * self.window:(k + 1) * self.window]
        return torch.from_numpy(out)

    def __getitem__(self, k: int) -> torch.Tensor:
        return self.read([k])[0]  # (T + 1,)

    def first(self, n: int) -> torch.Tensor:
        """The first min(n, len) windows, (n, T + 1): the fixed evaluation windows."""
        return self.read(range(min(n, self.num_windows)))
