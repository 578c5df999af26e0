"""The encoder's K/V cache of the rollout and replay, and the dense schedule's memory K/V.

Buffers are (B, h_kv, capacity, Dh), preallocated once per sequence batch and written in place;
``h_kv`` is whatever the projections produce (a sharded layer holds fewer heads), so a
buffer is allocated lazily at its first write. Layers are indexed globally; a pipeline stage only
ever touches its own layers. The decoder's own K/V and the rollout's memory K/V live in the decoder
step's layout (model/decoder.py, ``KVState``); the rollout's encoder calls write some rows of its
cache (rollout/executor.py ``RowsView``).
"""

from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    """Self-attention K/V per layer: the encoder's, or the decoder's during sampling/replay."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.capacity = capacity
        self.k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v: list[Optional[torch.Tensor]] = [None] * num_layers

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, rows: Optional[torch.Tensor] = None,
              batch_size: Optional[int] = None) -> None:
        """k, v: (n, h_kv, m, Dh) for positions [start, start + m) of rows ``rows`` (n,), or of the
        prefix [:n] (None), of a batch of ``batch_size`` rows (None: n). Not recorded by autograd."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"cache capacity {self.capacity} exceeded by a write ending at position {end}")
        if self.k[layer] is None:
            shape = (k.shape[0] if batch_size is None else batch_size, k.shape[1], self.capacity, k.shape[3])
            self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        index = slice(0, k.shape[0]) if rows is None else rows
        with torch.no_grad():
            self.k[layer][index, :, start:end] = k
            self.v[layer][index, :, start:end] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end): (B, h_kv, end, Dh) views of the buffers."""
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class MemoryKV(KVCache):
    """The dense schedule's cross-attention K/V of the encoder memory per layer, slot 0 holding
    the null memory: (B, h_kv, 1 + S, Dh), set once per layer from the whole memory with
    autograd into the encoder (``RLT.memory_kv``); the decoder step at position t reads slots
    [0, 1 + vis(t))."""

    def set(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer], self.v[layer] = k, v
