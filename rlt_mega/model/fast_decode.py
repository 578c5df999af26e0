"""The decoder step and the memory writes of the no-grad schedules (rollout and replay), with
fewer, larger kernels.

At sampling batch sizes a decoder step is a few dozen small GEMMs and a few hundred small
ops; their dispatch cost, not their FLOPs, sets the step time (small_cpu, batch 8, one CPU
thread: the module path took ~4.5 ms for the 4 decoder layers of a step, of which ~0.8 ms
were GEMMs; this path ~2 ms; tools/bench/rollout.py shows both). This path computes the
function of
``RLT.decoder_layer`` / ``RLT.append_memory`` with:

- q, k, v fused into one GEMM, gate and up into another, the cross-attention's k and v into a
  third, over weights concatenated once per run and stored transposed (in, out), so that
  every projection is one ``mm``/``addmm``;
- the RMSNorm weights and the attention scale folded into the weights that follow them; the
  residual adds folded into the output projections (``addmm``);
- RoPE of q and k in one pass; the single-position attentions (self and cross) as two ``bmm``
  around a softmax over keys stored transposed (``StepKV``), without the autograd Function.

It rounds differently from the module path (other GEMM shapes, folded scales, fused adds):
the same kind of gap as between the dense schedule and the rollout. Rollout and replay both
run it with the same shapes, so their values stay equal bit for bit.

``DecodeWeights.build`` snapshots the parameters once per executor run: nothing changes them
during a no-grad run and every run takes a new snapshot, so nothing computed from old
parameters is reused (the caches' rule). It returns None (the caller then runs the module
path) unless every projection is a plain ``nn.Linear``: a tensor-parallel model holds
megatron-core layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rlt_mega.precision import LOW_PRECISION


class StepKV:
    """K/V per layer for the fast step, keys stored transposed: k_t (B, h_kv, Dh, capacity),
    v (B, h_kv, capacity, Dh), so both attention products read their right-hand side in the
    layout a GEMM wants (q @ K^T over (Dh, S) rows is 2-3x faster than over a transposed view
    at these sizes). The decoder's own K/V (one position per write) and the cross-attention
    memory (slot 0 the null memory, then C positions per write) both use it. Buffers are
    allocated at the first write of each layer."""

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


@dataclass
class _LayerWeights:
    """One decoder layer; matrices transposed to (in, out), RMSNorm weights folded into rows."""

    qkv: torch.Tensor  # (d, (h + 2 h_kv) Dh): attn_norm folded in, q columns scaled by 1/sqrt(Dh)
    qkv_bias: Optional[torch.Tensor]  # ((h + 2 h_kv) Dh,), q part scaled
    o: torch.Tensor  # (h Dh, d)
    cross_q: torch.Tensor  # (d, h Dh): cross_norm folded in, scaled
    cross_kv: torch.Tensor  # (d, 2 h_kv Dh): the memory's k and v (memory_norm is applied before)
    cross_o: torch.Tensor  # (h Dh, d)
    gate_up: torch.Tensor  # (d, 2F): mlp_norm folded in
    down: torch.Tensor  # (F, d)
    num_heads: int
    num_kv_heads: int


def _plain(*modules: nn.Module) -> bool:
    return all(type(m) is nn.Linear for m in modules)


def _residual_mm(u: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """u + a @ w; one addmm when the dtypes agree (a bf16 product into an fp32 stream is added
    after the GEMM, as the module path does under autocast)."""
    if u.dtype == a.dtype:
        return torch.addmm(u, a, w)
    return u + torch.mm(a, w)


def _attend(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query position, grouped heads: q (B h_kv, g, Dh) already scaled; keys_t
    (B h_kv, Dh, S), values (B h_kv, S, Dh) -> (B h_kv, g, Dh). Softmax in fp32 (fp64 for
    fp64), as attention._attend."""
    scores = torch.bmm(q, keys_t)  # (B h_kv, g, S)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return torch.bmm(probs if probs.dtype == q.dtype else probs.to(q.dtype), values)


def _attend_masked(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``_attend`` with a key mask per row (the row schedule: rows at their own positions).
    hidden (B, 1, 1, S) bool, True where row b must not see key s; q (B h_kv, g, Dh)."""
    scores = torch.bmm(q, keys_t)  # (B h_kv, g, S)
    B = hidden.shape[0]
    scores = scores.view(B, -1, *scores.shape[1:]).masked_fill(hidden, float("-inf")).view_as(scores)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
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


class DecodeWeights:
    """A snapshot of the decoder's weights for one no-grad run, in the dtype the GEMMs run in
    (the autocast dtype under autocast, else the parameters')."""

    def __init__(self, layers: dict[int, _LayerWeights], compute_dtype: torch.dtype, head_dim: int, eps: float,
                 memory_block: int, cos: torch.Tensor, sin_signed: torch.Tensor, d: int,
                 param_dtype: torch.dtype) -> None:
        self.layers, self.compute_dtype, self.head_dim = layers, compute_dtype, head_dim
        self.memory_block, self.num_layers = memory_block, max(layers) + 1
        self.cos, self.sin_signed = cos, sin_signed  # (max_seq_len, Dh) each
        # RMSNorm statistics in fp32 (fp64 for fp64): eps + mean(x^2) as one addmm with 1/d.
        stat = torch.float64 if param_dtype == torch.float64 else torch.float32
        self.eps = torch.full((1,), eps, dtype=stat, device=cos.device)
        self.mean_col = torch.full((d, 1), 1.0 / d, dtype=stat, device=cos.device)

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
        Dh = cfg.head_dim
        scale = 1.0 / math.sqrt(Dh)
        out = {}
        for i in layers:
            blk, cb = model.decoder_block(i), model.cross[i]
            a, c, m = blk.attn, cb.attn, blk.mlp
            if not _plain(a.q, a.k, a.v, a.o, c.q, c.k, c.v, c.o, m.gate, m.up, m.down):
                return None

            def wide(w: torch.Tensor) -> torch.Tensor:  # folding happens in fp32 at least, rounded once
                return w.to(torch.promote_types(w.dtype, torch.float32))

            def t(w: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
                """(out, in) -> (in, out) in the compute dtype, a norm's weight folded into the rows."""
                w = wide(w).t()
                if norm is not None:
                    w = w * wide(norm.weight)[:, None]
                return w.to(compute_dtype).contiguous()

            bias = None
            if a.q.bias is not None:
                bias = torch.cat([wide(a.q.bias) * scale, wide(a.k.bias), wide(a.v.bias)]).to(compute_dtype)
            out[i] = _LayerWeights(
                qkv=t(torch.cat([wide(a.q.weight) * scale, wide(a.k.weight), wide(a.v.weight)]), blk.attn_norm),
                qkv_bias=bias, o=t(a.o.weight), cross_q=t(wide(c.q.weight) * scale, cb.cross_norm),
                cross_kv=t(torch.cat([c.k.weight, c.v.weight])), cross_o=t(c.o.weight),
                gate_up=t(torch.cat([m.gate.weight, m.up.weight]), blk.mlp_norm), down=t(m.down.weight),
                num_heads=a.q.weight.shape[0] // Dh, num_kv_heads=a.k.weight.shape[0] // Dh)
        cos, sin = model.rotary.tables(device, compute_dtype)
        half = Dh // 2
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=1)  # rotate_half as a roll with signs
        return cls(out, compute_dtype, Dh, cfg.norm_eps, cfg.memory_block, cos, sin_signed, cfg.d_model,
                   param_dtype)

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

    @torch.no_grad()
    def append_memory(self, mem: StepKV, m: torch.Tensor, start: int) -> None:
        """Commits memory m (B, n, d) (memory_norm applied) of positions [start, start + n)."""
        B, n, d = m.shape
        x = m.reshape(B * n, d).to(self.compute_dtype)
        with torch.autocast(device_type=m.device.type, enabled=False):
            for i, w in self.layers.items():
                kv = torch.mm(x, w.cross_kv).view(B, n, 2, w.num_kv_heads, self.head_dim)
                mem.write(i, 1 + start, kv[:, :, 0], kv[:, :, 1])

    # ------------------------------------------------------------------ the step
    def decoder_layers(self, u: torch.Tensor, t: int, dec: StepKV, mem: StepKV) -> torch.Tensor:
        """u (B, 1, d) at position t -> (B, 1, d); writes the decoder K/V of position t."""
        x = u.squeeze(1)  # (B, d)
        visible = 1 + self.memory_block * ((t + 1) // self.memory_block)  # the null slot + vis(t)
        cos, sin = self.cos[t], self.sin_signed[t]
        with torch.autocast(device_type=u.device.type, enabled=False):
            for i, w in self.layers.items():
                x = self._layer(w, i, x, t, dec, mem, visible, cos, sin)
        return x.unsqueeze(1)

    def decoder_layers_rows(self, u: torch.Tensor, rp: "RowPositions", dec: StepKV, mem: StepKV) -> torch.Tensor:
        """The row schedule's step: u (B, 1, d), row b at position rp.pos[b] -> (B, 1, d); writes
        the decoder K/V of each row's position. The same arithmetic as ``decoder_layers`` (RoPE
        rows gathered per row, masked keys contribute exp(-inf) = 0)."""
        x = u.squeeze(1)  # (B, d)
        cos, sin = self.cos.index_select(0, rp.pos)[:, None], self.sin_signed.index_select(0, rp.pos)[:, None]
        with torch.autocast(device_type=u.device.type, enabled=False):
            for i, w in self.layers.items():
                x = self._layer_rows(w, i, x, rp, dec, mem, cos, sin)
        return x.unsqueeze(1)

    def _layer_rows(self, w: _LayerWeights, i: int, x: torch.Tensor, rp: "RowPositions", dec: StepKV, mem: StepKV,
                    cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, Dh = x.shape[0], self.head_dim
        h, h_kv = w.num_heads, w.num_kv_heads
        g = h // h_kv
        a = self._norm(x)
        qkv = torch.mm(a, w.qkv) if w.qkv_bias is None else torch.addmm(w.qkv_bias, a, w.qkv)
        qk = qkv[:, :(h + h_kv) * Dh].view(B, h + h_kv, Dh)
        qk = torch.addcmul(qk * cos, qk.roll(Dh // 2, dims=-1), sin)  # RoPE at each row's position
        v = qkv[:, (h + h_kv) * Dh:].view(B, h_kv, Dh)
        dec.write_at(i, rp.pos, qk[:, h:], v)
        att = _attend_masked(qk[:, :h].reshape(B * h_kv, g, Dh), *dec.view(i, rp.num_keys), rp.hide_keys)
        x = _residual_mm(x, att.view(B, h * Dh), w.o)
        cq = torch.mm(self._norm(x), w.cross_q).view(B * h_kv, g, Dh)
        x = _residual_mm(x, _attend_masked(cq, *mem.view(i, rp.num_slots), rp.hide_slots).view(B, h * Dh), w.cross_o)
        gu = torch.mm(self._norm(x), w.gate_up)  # (B, 2F)
        f = gu.shape[1] // 2
        return _residual_mm(x, F.silu(gu[:, :f]) * gu[:, f:], w.down)

    @torch.no_grad()
    def append_memory_rows(self, mem: StepKV, rows: torch.Tensor, batch_size: int, m: torch.Tensor,
                           start: int) -> None:
        """``append_memory`` into rows ``rows`` (n,) of a batch of ``batch_size``; m (n, C, d)."""
        n, c, d = m.shape
        x = m.reshape(n * c, d).to(self.compute_dtype)
        with torch.autocast(device_type=m.device.type, enabled=False):
            for i, w in self.layers.items():
                kv = torch.mm(x, w.cross_kv).view(n, c, 2, w.num_kv_heads, self.head_dim)
                mem.write_rows(i, rows, batch_size, 1 + start, kv[:, :, 0], kv[:, :, 1])

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in the compute dtype (the norm's weight lives in the next GEMM): the
        statistics in fp32 (fp64), as layers.RMSNorm."""
        xf = x.float() if x.dtype in LOW_PRECISION else x
        inv_rms = torch.addmm(self.eps, xf * xf, self.mean_col).rsqrt_()  # (B, 1)
        return (xf * inv_rms).to(self.compute_dtype)

    def _layer(self, w: _LayerWeights, i: int, x: torch.Tensor, t: int, dec: StepKV, mem: StepKV,
               visible: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, Dh = x.shape[0], self.head_dim
        h, h_kv = w.num_heads, w.num_kv_heads
        g = h // h_kv
        # self-attention over the decoder's K/V of positions [0, t]
        a = self._norm(x)
        qkv = torch.mm(a, w.qkv) if w.qkv_bias is None else torch.addmm(w.qkv_bias, a, w.qkv)
        qk = qkv[:, :(h + h_kv) * Dh].view(B, h + h_kv, Dh)
        qk = torch.addcmul(qk * cos, qk.roll(Dh // 2, dims=-1), sin)  # RoPE at position t
        v = qkv[:, (h + h_kv) * Dh:].view(B, 1, h_kv, Dh)
        dec.write(i, t, qk[:, None, h:], v)
        att = _attend(qk[:, :h].reshape(B * h_kv, g, Dh), *dec.view(i, t + 1))
        x = _residual_mm(x, att.view(B, h * Dh), w.o)
        # cross-attention into {null} + the visible memory
        cq = torch.mm(self._norm(x), w.cross_q).view(B * h_kv, g, Dh)
        x = _residual_mm(x, _attend(cq, *mem.view(i, visible)).view(B, h * Dh), w.cross_o)
        # SwiGLU MLP
        gu = torch.mm(self._norm(x), w.gate_up)  # (B, 2F)
        f = gu.shape[1] // 2
        return _residual_mm(x, F.silu(gu[:, :f]) * gu[:, f:], w.down)
