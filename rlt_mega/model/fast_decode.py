"""The decoder step and the memory writes of the no-grad schedules (rollout and replay), on the
fused layout and kernels of the training step (model/fused.py).

At sampling batch sizes a decoder step is a few dozen small GEMMs and a few hundred small
ops; their dispatch cost and the bytes of weight they stream, not their FLOPs, set the step
time (tools/bench/rollout.py shows this path against the module path). This path computes the
function of ``RLT.decoder_layer`` / ``RLT.append_memory`` with what the training step uses:

- the fused weights of model/fused.py (q/k/v in one product, gate/up in another, the RMSNorm
  weights and the attention scale folded in), prepared once per run as ``Gemm`` products
  (oneDNN with the weight reordered for the batch on CPU), the residual adds fused into the
  output products; the cross-attention's k and v in one more product for the memory writes;
- the same RMSNorm, RoPE and single-query attention kernels, and the same cache layout as the
  training step's buffers: keys stored transposed (``StepKV``).

It rounds differently from the module path (other GEMM kernels and shapes, folded scales, fused
adds): the same kind of gap as between the dense schedule and the rollout. Rollout and replay
both run it with the same shapes, so their values stay equal bit for bit.

``DecodeWeights.build`` snapshots the parameters once per executor run: nothing changes them
during a no-grad run and every run takes a new snapshot, so nothing computed from old
parameters is reused (the caches' rule). It returns None (the caller then runs the module
path) unless every projection is a plain ``nn.Linear``: a tensor-parallel model holds
megatron-core layers, and the sampler's ring runs their modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rlt_mega.model.fused import (Gemm, LayerGemms, NormConstants, attend, fuse_layer, head_counts, rms_forward, rope,
                                  rope_tables, stat_dtype, wide)
from rlt_mega.precision import LOW_PRECISION


class StepKV:
    """K/V per layer for the fast step, keys stored transposed: k_t (B, h_kv, Dh, capacity),
    v (B, h_kv, capacity, Dh), so both attention products read their right-hand side in the
    layout a GEMM wants (q @ K^T over (Dh, S) rows is 2-3x faster than over a transposed view
    at these sizes): the layout of the training step's buffers (model/fused_run.py). The
    decoder's own K/V (one position per write) and the cross-attention memory (slot 0 the null
    memory, then C positions per write) both use it. Buffers are allocated at the first write of
    each layer."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.capacity = capacity
        self.k_t: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v: list[Optional[torch.Tensor]] = [None] * num_layers

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (B, n, h_kv, Dh) of slots [start, start + n)."""
        B, n, h_kv, Dh = k.shape
        if start + n > self.capacity:
            raise ValueError(f"cache capacity {self.capacity} exceeded by a write ending at {start + n}")
        if self.k_t[layer] is None:
            self.k_t[layer] = k.new_zeros(B, h_kv, Dh, self.capacity)
            self.v[layer] = v.new_zeros(B, h_kv, self.capacity, Dh)
        self.k_t[layer].narrow(3, start, n).copy_(k.permute(0, 2, 3, 1))
        self.v[layer].narrow(2, start, n).copy_(v.transpose(1, 2))

    def write_rows(self, layer: int, rows: torch.Tensor, batch_size: int, start: int, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """The row schedule: k, v (n, m, h_kv, Dh) of slots [start, start + m) of rows ``rows``
        (n,) of a batch of ``batch_size``."""
        n, m, h_kv, Dh = k.shape
        if start + m > self.capacity:
            raise ValueError(f"cache capacity {self.capacity} exceeded by a write ending at {start + m}")
        if self.k_t[layer] is None:
            self.k_t[layer] = k.new_zeros(batch_size, h_kv, Dh, self.capacity)
            self.v[layer] = v.new_zeros(batch_size, h_kv, self.capacity, Dh)
        self.k_t[layer][rows, :, :, start:start + m] = k.permute(0, 2, 3, 1)
        self.v[layer][rows, :, start:start + m] = v.transpose(1, 2)

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The row schedule: row b's slot positions[b]; k, v (B, h_kv, Dh); positions (B,) long."""
        B, h_kv, Dh = k.shape
        if self.k_t[layer] is None:
            self.k_t[layer] = k.new_zeros(B, h_kv, Dh, self.capacity)
            self.v[layer] = v.new_zeros(B, h_kv, self.capacity, Dh)
        rows = torch.arange(B, device=k.device)
        self.k_t[layer][rows, :, :, positions] = k
        self.v[layer][rows, :, positions] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [0, end): k^T (B h_kv, Dh, end), v (B h_kv, end, Dh), views of the buffers."""
        k_t, v = self.k_t[layer], self.v[layer]
        B, h_kv, Dh, _ = k_t.shape
        return k_t[..., :end].reshape(B * h_kv, Dh, end), v[:, :, :end].reshape(B * h_kv, end, Dh)


def _bucket(rows: int) -> int:
    """The row count a batch of ``rows`` prepares its products for: the next power of two. The
    row schedule's batch changes size at every leave and entry (a few dozen sizes per call) and
    oneDNN's weight reorder costs about one product of 64 rows, while the row count it is
    tuned for hardly changes a product's time (measured at 8-64 rows, small_cpu). Rollout and
    replay see the same sizes, so they use the same products."""
    return 1 << max(0, rows - 1).bit_length()


def _plain(*modules: nn.Module) -> bool:
    return all(type(m) is nn.Linear for m in modules)


def _attend_masked(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``fused.attend`` with a key mask per row (the row schedule: rows at their own positions).
    hidden (B, 1, 1, S) bool, True where row b must not see key s; q (B h_kv, g, Dh)."""
    scores = torch.bmm(q, keys_t)  # (B h_kv, g, S)
    B = hidden.shape[0]
    scores = scores.view(B, -1, *scores.shape[1:]).masked_fill(hidden, float("-inf")).view_as(scores)
    probs = torch.softmax(scores, dim=-1, dtype=stat_dtype(scores.dtype))
    return torch.bmm(probs if probs.dtype == q.dtype else probs.to(q.dtype), values)


@dataclass
class RowPositions:
    """One decoder step of the row schedule: row b at position pos[b] (B,) long on the device;
    its keys [0, pos[b]] of the decoder's K/V and its memory slots [0, 1 + vis(pos[b])) visible.
    ``num_keys``/``num_slots`` (host ints, from the plan) bound them over the batch, and the masks
    (B, 1, 1, num_keys / num_slots) bool are True where a row must not look."""

    pos: torch.Tensor
    num_keys: int
    num_slots: int
    hide_keys: torch.Tensor
    hide_slots: torch.Tensor

    @classmethod
    def build(cls, pos: torch.Tensor, num_keys: int, memory_block: int) -> "RowPositions":
        C = memory_block
        num_slots = 1 + C * (num_keys // C)  # the null slot + vis of the furthest row
        visible = 1 + C * torch.div(pos + 1, C, rounding_mode="floor")  # (B,)
        hide_keys = torch.arange(num_keys, device=pos.device)[None, :] > pos[:, None]
        hide_slots = torch.arange(num_slots, device=pos.device)[None, :] >= visible[:, None]
        return cls(pos, num_keys, num_slots, hide_keys[:, None, None], hide_slots[:, None, None])

    def write(self, dec: "StepKV", i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, h_kv, Dh): each row's K/V at its own position."""
        dec.write_at(i, self.pos, k, v)

    def attend_keys(self, q: torch.Tensor, dec: "StepKV", i: int) -> torch.Tensor:
        return _attend_masked(q, *dec.view(i, self.num_keys), self.hide_keys)

    def attend_memory(self, q: torch.Tensor, mem: "StepKV", i: int) -> torch.Tensor:
        return _attend_masked(q, *mem.view(i, self.num_slots), self.hide_slots)


@dataclass
class _Position:
    """One decoder step of the lockstep schedule: every row at position t, the keys [0, t] and
    the memory slots [0, visible) of all rows visible (no masks). The interface of RowPositions."""

    t: int
    visible: int  # the null slot + vis(t)

    def write(self, dec: "StepKV", i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        dec.write(i, self.t, k[:, None], v[:, None])

    def attend_keys(self, q: torch.Tensor, dec: "StepKV", i: int) -> torch.Tensor:
        return attend(q, *dec.view(i, self.t + 1))

    def attend_memory(self, q: torch.Tensor, mem: "StepKV", i: int) -> torch.Tensor:
        return attend(q, *mem.view(i, self.visible))


class DecodeWeights:
    """A snapshot of the decoder's weights for one no-grad run, in the dtype the GEMMs run in
    (the autocast dtype under autocast, else the parameters'): the fused weights of each layer,
    prepared as products for each batch size the run meets."""

    def __init__(self, fused: dict[int, dict], cross_kv: dict[int, torch.Tensor], heads: tuple[int, int],
                 compute_dtype: torch.dtype, param_dtype: torch.dtype, head_dim: int, eps: float, memory_block: int,
                 cos: torch.Tensor, sin: torch.Tensor, d: int) -> None:
        self.fused, self.cross_kv_w = fused, cross_kv
        self.layer_ids = sorted(fused)
        self.heads, self.compute_dtype, self.head_dim = heads, compute_dtype, head_dim
        self.memory_block, self.num_layers = memory_block, max(fused) + 1
        self.cos, self.sin_fwd, _ = rope_tables(cos, sin)  # (max_seq_len, Dh)
        self.norm = NormConstants(d, eps, param_dtype, cos.device)
        self._gemms: dict[int, dict[int, LayerGemms]] = {}  # batch size -> layer -> products
        self._cross_kv: dict[int, dict[int, Gemm]] = {}

    @classmethod
    @torch.no_grad()
    def build(cls, model, layers: Optional[Sequence[int]] = None) -> Optional["DecodeWeights"]:
        """model: an RLT (possibly a pipeline stage's pruned one); layers: the stage's."""
        cfg = model.cfg
        layers = range(cfg.n_layers) if layers is None else layers
        if len(layers) == 0:
            return None
        device = next(model.parameters()).device
        param_dtype = model.cross[layers[0]].cross_norm.weight.dtype
        compute_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) \
            else param_dtype
        fused, cross_kv = {}, {}
        heads = (0, 0)
        for i in layers:
            blk, cb = model.decoder_block(i), model.cross[i]
            a, c, m = blk.attn, cb.attn, blk.mlp
            if not _plain(a.q, a.k, a.v, a.o, c.q, c.k, c.v, c.o, m.gate, m.up, m.down):
                return None
            fused[i] = {k: None if w is None else w.to(compute_dtype)
                        for k, w in fuse_layer(blk, cb, cfg.head_dim).items()}
            cross_kv[i] = torch.cat([wide(c.k.weight), wide(c.v.weight)]).to(compute_dtype)  # (2 h_kv Dh, d)
            heads = head_counts(blk, cfg.head_dim)
        cos, sin = model.rotary.tables(device, compute_dtype)
        return cls(fused, cross_kv, heads, compute_dtype, param_dtype, cfg.head_dim, cfg.norm_eps,
                   cfg.memory_block, cos, sin, cfg.d_model)

    def _cross_kv_products(self, rows: int) -> dict[int, Gemm]:
        """The memory's k/v products for ``rows`` rows (prepared once per bucket and run)."""
        bucket = _bucket(rows)
        if bucket not in self._cross_kv:
            self._cross_kv[bucket] = {i: Gemm(w, bucket) for i, w in self.cross_kv_w.items()}
        return self._cross_kv[bucket]

    def gemms(self, rows: int) -> dict[int, LayerGemms]:
        """The products prepared for batches of ``rows`` (once per bucket and run)."""
        bucket = _bucket(rows)
        if bucket not in self._gemms:
            h, h_kv = self.heads
            self._gemms[bucket] = {i: LayerGemms.build(w, self.compute_dtype, bucket, False, h, h_kv)
                                   for i, w in self.fused.items()}
        return self._gemms[bucket]

    # ------------------------------------------------------------------ caches and memory
    def new_cache(self, capacity: int) -> StepKV:
        """The decoder's own K/V for positions [0, capacity)."""
        return StepKV(self.num_layers, capacity)

    @torch.no_grad()
    def new_memory(self, null_memory: torch.Tensor, batch_size: int, capacity: int) -> StepKV:
        """Cross K/V for {null} + ``capacity`` positions, the null slot written (the fast path's
        ``RLT.init_memory``). null_memory: (d,)."""
        mem = StepKV(self.num_layers, 1 + capacity)
        null = null_memory.to(self.compute_dtype).expand(batch_size, 1, -1)
        self.append_memory(mem, null, -1)
        return mem

    def _memory_kv(self, m: torch.Tensor):
        """Per layer i: (i, k, v) of memory m (N, n, d) (memory_norm applied), k and v
        (N, n, h_kv, Dh) each: the cross-attention's k/v products, autocast off."""
        N, n, d = m.shape
        x = m.reshape(N * n, d).to(self.compute_dtype)
        products = self._cross_kv_products(N * n)
        with torch.autocast(device_type=m.device.type, enabled=False):
            for i in self.layer_ids:
                kv = products[i](x).view(N, n, 2, self.heads[1], self.head_dim)
                yield i, kv[:, :, 0], kv[:, :, 1]

    @torch.no_grad()
    def append_memory(self, mem: StepKV, m: torch.Tensor, start: int) -> None:
        """Commits memory m (B, n, d) (memory_norm applied) of positions [start, start + n)."""
        for i, k, v in self._memory_kv(m):
            mem.write(i, 1 + start, k, v)

    # ------------------------------------------------------------------ the step
    def decoder_layers(self, u: torch.Tensor, t: int, dec: StepKV, mem: StepKV) -> torch.Tensor:
        """u (B, 1, d) at position t -> (B, 1, d); writes the decoder K/V of position t."""
        at = _Position(t, 1 + self.memory_block * ((t + 1) // self.memory_block))
        return self._layers(u, at, self.cos[t], self.sin_fwd[t], dec, mem)

    def decoder_layers_rows(self, u: torch.Tensor, rp: RowPositions, dec: StepKV, mem: StepKV) -> torch.Tensor:
        """The row schedule's step: u (B, 1, d), row b at position rp.pos[b] -> (B, 1, d); writes
        the decoder K/V of each row's position. The same arithmetic as ``decoder_layers`` (RoPE
        rows gathered per row, masked keys contribute exp(-inf) = 0)."""
        cos, sin = self.cos.index_select(0, rp.pos)[:, None], self.sin_fwd.index_select(0, rp.pos)[:, None]
        return self._layers(u, rp, cos, sin, dec, mem)

    def _layers(self, u: torch.Tensor, at, cos: torch.Tensor, sin: torch.Tensor, dec: StepKV,
                mem: StepKV) -> torch.Tensor:
        x = u.squeeze(1)  # (B, d)
        gemms = self.gemms(x.shape[0])
        with torch.autocast(device_type=u.device.type, enabled=False):
            for i in self.layer_ids:
                x = self._layer(gemms[i], i, x, at, dec, mem, cos, sin)
        return x.unsqueeze(1)

    @torch.no_grad()
    def append_memory_rows(self, mem: StepKV, rows: torch.Tensor, batch_size: int, m: torch.Tensor,
                           start: int) -> None:
        """``append_memory`` into rows ``rows`` (n,) of a batch of ``batch_size``; m (n, C, d)."""
        for i, k, v in self._memory_kv(m):
            mem.write_rows(i, rows, batch_size, 1 + start, k, v)

    def _layer(self, w: LayerGemms, i: int, x: torch.Tensor, at, dec: StepKV, mem: StepKV,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The training step's forward (FusedRun._layer_forward without saving), over StepKV.
        ``at``: where the rows are, a _Position (every row at t: no masks) or a RowPositions (each
        row at its own position: K/V written per row, keys and memory slots masked per row);
        cos, sin: the RoPE rows of that position, or of each row's."""
        B, Dh, cd = x.shape[0], self.head_dim, self.compute_dtype
        h, h_kv = w.num_heads, w.num_kv_heads
        g = h // h_kv
        # self-attention over the decoder's K/V of the visible positions
        a, _ = rms_forward(x, self.norm, cd)
        qkv = w.qkv(a)
        qk = rope(qkv[:, :(h + h_kv) * Dh].view(B, h + h_kv, Dh), cos, sin)
        at.write(dec, i, qk[:, h:], qkv[:, (h + h_kv) * Dh:].view(B, h_kv, Dh))
        att = at.attend_keys(qk[:, :h].reshape(B * h_kv, g, Dh), dec, i)
        x = w.o.add(att.view(B, h * Dh), x)
        # cross-attention into {null} + the visible memory
        a, _ = rms_forward(x, self.norm, cd)
        cq = w.cross_q(a).view(B * h_kv, g, Dh)
        x = w.cross_o.add(at.attend_memory(cq, mem, i).view(B, h * Dh), x)
        # SwiGLU MLP
        a, _ = rms_forward(x, self.norm, cd)
        gu = w.gate_up(a)  # (B, 2F)
        f = gu.shape[1] // 2
        return w.down.add(F.silu(gu[:, :f]) * gu[:, f:], x)


__all__ = ["DecodeWeights", "StepKV", "LOW_PRECISION"]
