"""The state the schedules carry between calls: encoder K/V, decoder K/V, memory K/V.

All buffers are (B, h_kv, capacity, Dh), preallocated once per sequence batch and written in
place; ``h_kv`` is whatever the projections produce (a tensor-parallel shard holds fewer
heads), so a buffer is allocated lazily at its first write. Layers are indexed globally; a
pipeline stage only ever touches its own layers.
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

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (B, h_kv, n, Dh) for positions start .. start + n - 1. Not recorded by autograd."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"cache capacity {self.capacity} exceeded by a write ending at position {end}")
        if self.k[layer] is None:
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.k[layer] = k.new_zeros(shape)
            self.v[layer] = v.new_zeros(shape)
        with torch.no_grad():
            self.k[layer][:, :, start:end] = k
            self.v[layer][:, :, start:end] = v

    def write_rows(self, layer: int, rows: torch.Tensor, batch_size: int, start: int, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """k, v: (n, h_kv, m, Dh) of positions [start, start + m) of rows ``rows`` (n,) of a
        batch of ``batch_size`` (the row schedule's encoder calls on some rows)."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"cache capacity {self.capacity} exceeded by a write ending at position {end}")
        if self.k[layer] is None:
            shape = (batch_size, k.shape[1], self.capacity, k.shape[3])
            self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        with torch.no_grad():
            self.k[layer][rows, :, start:end] = k
            self.v[layer][rows, :, start:end] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end): (B, h_kv, end, Dh) views of the buffers."""
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The row schedule (rollout/rows.py): row b's one position positions[b]; k, v (B, h_kv,
        1, Dh), positions (B,) long on the device (no host read)."""
        if self.k[layer] is None:
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        rows = torch.arange(k.shape[0], device=k.device)
        with torch.no_grad():
            self.k[layer][rows, :, positions] = k[:, :, 0]
            self.v[layer][rows, :, positions] = v[:, :, 0]


class RowsView:
    """Rows ``rows`` (a (n,) long tensor) of a cache with ``batch_size`` rows, as a cache of n
    rows for one encoder call of the row schedule: ``write`` goes into those rows (the buffer
    allocated for the whole batch at the first write), ``view`` gathers them."""

    def __init__(self, cache, rows: torch.Tensor, batch_size: int) -> None:
        self.cache, self.rows, self.batch_size = cache, rows, batch_size
        self.capacity = cache.capacity

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write_rows(layer, self.rows, self.batch_size, start, k, v)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.cache.view(layer, end)
        return k.index_select(0, self.rows), v.index_select(0, self.rows)


class DecoderKV(KVCache):
    """The decoder's own K/V with gradient buffers, for the dense schedule (full BPTT).

    The decoder attends at step t to the keys of every earlier step; keeping those keys in a
    preallocated buffer rather than concatenating per step keeps memory O(T) instead of
    O(T^2). Gradients into earlier keys are accumulated here by the attention backward of
    later steps and handed to the owning step when its own backward runs (see
    ``attention.DecoderSelfAttention``); the recurrence z_{t-1} -> u_t guarantees that every
    later step's backward has run by then.
    """

    def __init__(self, num_layers: int, capacity: int) -> None:
        super().__init__(num_layers, capacity)
        self.grad_k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.grad_v: list[Optional[torch.Tensor]] = [None] * num_layers

    def accumulate(self, layer: int, t: int, dk: torch.Tensor, dv: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds the gradients (B, h_kv, t + 1, Dh) of keys/values [0, t] and returns (and
        clears) those of position t, which are now complete."""
        if self.grad_k[layer] is None:
            shape = self.k[layer].shape
            # fp32 accumulation even when the keys are bf16.
            acc_dtype = torch.promote_types(dk.dtype, torch.float32)
            self.grad_k[layer] = torch.zeros(shape, dtype=acc_dtype, device=dk.device)
            self.grad_v[layer] = torch.zeros(shape, dtype=acc_dtype, device=dv.device)
        gk, gv = self.grad_k[layer], self.grad_v[layer]
        gk[:, :, : t + 1] += dk
        gv[:, :, : t + 1] += dv
        out_k = gk[:, :, t:t + 1].clone()
        out_v = gv[:, :, t:t + 1].clone()
        gk[:, :, t].zero_()  # cleared so that a second backward (retain_graph) starts from zero
        gv[:, :, t].zero_()
        return out_k, out_v


class MemoryKV(KVCache):
    """Cross-attention K/V of the encoder memory per layer, slot 0 holding the null memory:
    (B, h_kv, 1 + S, Dh). The decoder at position t reads slots [0, 1 + vis(t)).

    Dense schedule: set once per layer from the whole memory (``set``; autograd flows into
    the encoder). Rollout/replay: a preallocated buffer (``write``) that grows by one memory
    block per encoder call.

    Gradients (dense schedule): every decoder step reads a growing prefix of the memory. Had
    each step's prefix slice gone through autograd, its backward would build a full-size zero
    gradient and add it to the memory's (fill + add of (B, h_kv, 1 + S, Dh) per step and
    layer, O(T^2) traffic: ~45% of a profiled small_cpu step at T=512). Instead the step
    adds its prefix gradient here (``accumulate``) and the total is handed to the producer
    once: by ``MemoryGradients`` in one backward pass, or read with ``take_grads`` by a
    pipeline stage that backwards step by step.
    """

    def __init__(self, num_layers: int, capacity: int) -> None:
        super().__init__(num_layers, capacity)
        self.grad_k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.grad_v: list[Optional[torch.Tensor]] = [None] * num_layers

    def set(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer], self.v[layer] = k, v

    def visible(self, layer: int, vis: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.view(layer, 1 + vis)

    def accumulate(self, layer: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Adds the gradients (B, h_kv, n, Dh) of slots [0, n). fp32 accumulation even for
        bf16 K/V, as in DecoderKV."""
        if self.grad_k[layer] is None:
            shape = self.k[layer].shape
            acc_dtype = torch.promote_types(dk.dtype, torch.float32)
            self.grad_k[layer] = torch.zeros(shape, dtype=acc_dtype, device=dk.device)
            self.grad_v[layer] = torch.zeros(shape, dtype=acc_dtype, device=dv.device)
        n = dk.shape[2]
        self.grad_k[layer][:, :, :n] += dk
        self.grad_v[layer][:, :, :n] += dv

    def take_grads(self, layer: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The accumulated gradients of layer's K and V in their dtype (None if no step
        read them); cleared, so that a second backward starts from zero."""
        gk, gv = self.grad_k[layer], self.grad_v[layer]
        self.grad_k[layer] = self.grad_v[layer] = None
        if gk is None:
            return None, None
        return gk.to(self.k[layer].dtype), gv.to(self.v[layer].dtype)


class MemoryGradients(torch.autograd.Function):
    """Dense schedule: passes a layer's memory K/V through unchanged and, in backward, hands
    their producer the gradient the decoder steps accumulated in ``mem``. Every step reads
    the outputs, so autograd runs this node after the last of them.

    k, v: (B, h_kv, 1 + S, Dh) -> the same (views)."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, mem: MemoryKV, layer: int):
        ctx.set_materialize_grads(False)
        ctx.mem, ctx.layer = mem, layer
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, grad_k: Optional[torch.Tensor], grad_v: Optional[torch.Tensor]):
        acc_k, acc_v = ctx.mem.take_grads(ctx.layer)
        # Gradients that reached the outputs through autograd (a reader other than the
        # decoder's cross-attention) add to the accumulated ones.
        if acc_k is None:
            acc_k, acc_v = grad_k, grad_v
        else:
            acc_k = acc_k if grad_k is None else acc_k + grad_k
            acc_v = acc_v if grad_v is None else acc_v + grad_v
        return acc_k, acc_v, None, None
