"""The decoder step of the no-grad schedules (rollout and replay) with fewer, larger kernels.

At sampling batch sizes a decoder step is a few dozen small GEMMs and a few hundred small
elementwise ops; their dispatch cost, not their FLOPs, sets the step time (on this CPU the
module path spends ~5 of its ~6 ms per step outside the GEMMs: tools/bench/rollout.py and
the notes in docs/performance.md). This path computes the function of ``RLT.decoder_layer``
with:

- q, k, v fused into one GEMM, gate and up into another, over weights concatenated once per
  run and stored transposed (K, N), so every projection is one ``mm``/``addmm``;
- the residual adds folded into the output projections (``addmm``); the attention scale
  folded into the q weights;
- RoPE applied to q and k in one pass; the single-position attentions (self and cross) as
  two ``bmm`` around a softmax, without the autograd Function and its context.

It rounds differently from the module path (other GEMM shapes, fused adds), the same kind of
gap as between the dense schedule and the rollout, and rollout and replay both run it with
the same shapes, so their values stay equal bit for bit.

``DecodeWeights.build`` snapshots the parameters once per executor run: nothing changes them
during a no-grad run, and every run takes a new snapshot, so nothing computed from old
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

from rlt_mega.model.cache import KVCache, MemoryKV


@dataclass
class _LayerWeights:
    """One decoder layer; matrices transposed to (in, out)."""

    attn_norm: torch.Tensor  # (d,)
    qkv: torch.Tensor  # (d, (h + 2 h_kv) Dh), q columns pre-scaled by 1/sqrt(Dh)
    qkv_bias: Optional[torch.Tensor]  # ((h + 2 h_kv) Dh,), q part pre-scaled
    o: torch.Tensor  # (h Dh, d)
    cross_norm: torch.Tensor  # (d,)
    cross_q: torch.Tensor  # (d, h Dh), pre-scaled
    cross_o: torch.Tensor  # (h Dh, d)
    mlp_norm: torch.Tensor  # (d,)
    gate_up: torch.Tensor  # (d, 2F)
    down: torch.Tensor  # (F, d)
    num_heads: int
    num_kv_heads: int


def _plain(*modules: nn.Module) -> bool:
    return all(type(m) is nn.Linear for m in modules)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm without the module call: fp32/fp64 by the fused kernel, low precision in
    fp32 and cast back (the same formulas as RMSNorm.forward)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(dtype)
    return F.rms_norm(x, weight.shape, weight.to(x.dtype), eps)


def _residual_mm(u: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """u + a @ w; one addmm when the dtypes agree (a bf16 product into an fp32 stream is added
    after the GEMM, as the module path does under autocast)."""
    if u.dtype == a.dtype:
        return torch.addmm(u, a, w)
    return u + torch.mm(a, w)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query position, grouped heads: q (B h_kv, g, Dh) already scaled; keys, values
    (B h_kv, S, Dh) -> (B h_kv, g, Dh). Softmax in fp32 (fp64 for fp64), as attention._attend."""
    scores = torch.bmm(q, keys.transpose(1, 2))  # (B h_kv, g, S)
    acc = torch.promote_types(scores.dtype, torch.float32)
    probs = torch.softmax(scores, dim=-1, dtype=acc)
    return torch.bmm(probs.to(q.dtype) if probs.dtype != q.dtype else probs, values)


class DecodeWeights:
    """A snapshot of the decoder's weights for one no-grad run, in the dtype the GEMMs run in
    (the autocast dtype under autocast, else the parameters')."""

    def __init__(self, layers: dict[int, _LayerWeights], compute_dtype: torch.dtype, head_dim: int, eps: float,
                 memory_block: int, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
        self.layers, self.compute_dtype, self.head_dim, self.eps = layers, compute_dtype, head_dim, eps
        self.memory_block = memory_block
        self.cos, self.sin_signed = cos, sin_signed  # (max_seq_len, Dh) each

    @classmethod
    @torch.no_grad()
    def build(cls, model, layers: Optional[Sequence[int]] = None) -> Optional["DecodeWeights"]:
        """model: an RLT (possibly a pipeline stage's pruned one); layers: the stage's."""
        cfg = model.cfg
        layers = range(cfg.n_layers) if layers is None else layers
        device = model.null_memory.device
        param_dtype = model.null_memory.dtype
        if torch.is_autocast_enabled(device.type):
            compute_dtype = torch.get_autocast_dtype(device.type)
        else:
            compute_dtype = param_dtype
        Dh = cfg.head_dim
        scale = 1.0 / math.sqrt(Dh)
        out = {}
        for i in layers:
            blk, cb = model.decoder_block(i), model.cross[i]
            a, c, m = blk.attn, cb.attn, blk.mlp
            if not _plain(a.q, a.k, a.v, a.o, c.q, c.o, m.gate, m.up, m.down):
                return None

            def t(w: torch.Tensor) -> torch.Tensor:  # (out, in) -> (in, out), contiguous
                return w.to(compute_dtype).t().contiguous()

            qkv = torch.cat([a.q.weight * scale, a.k.weight, a.v.weight], dim=0)
            bias = None
            if a.q.bias is not None:
                bias = torch.cat([a.q.bias * scale, a.k.bias, a.v.bias]).to(compute_dtype)
            out[i] = _LayerWeights(
                attn_norm=blk.attn_norm.weight, qkv=t(qkv), qkv_bias=bias, o=t(a.o.weight),
                cross_norm=cb.cross_norm.weight, cross_q=t(c.q.weight * scale), cross_o=t(c.o.weight),
                mlp_norm=blk.mlp_norm.weight, gate_up=t(torch.cat([m.gate.weight, m.up.weight], dim=0)),
                down=t(m.down.weight), num_heads=a.q.weight.shape[0] // Dh, num_kv_heads=a.k.weight.shape[0] // Dh)
        cos, sin = model.rotary.tables(device, compute_dtype)
        half = Dh // 2
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=1)  # rotate-half folded into the sign
        return cls(out, compute_dtype, Dh, cfg.norm_eps, cfg.memory_block, cos, sin_signed)

    # ------------------------------------------------------------------ the step
    def decoder_layers(self, u: torch.Tensor, t: int, dec: KVCache, mem: MemoryKV,
                       layers: Sequence[int]) -> torch.Tensor:
        """u (B, 1, d) at position t -> (B, 1, d); writes the decoder K/V of position t."""
        B = u.shape[0]
        x = u.squeeze(1)  # (B, d)
        visible = 1 + self.memory_block * ((t + 1) // self.memory_block)  # null slot + vis(t)
        with torch.autocast(device_type=u.device.type, enabled=False):
            for i in layers:
                x = self._layer(self.layers[i], i, x, t, dec, mem, visible, B)
        return x.unsqueeze(1)

    def _layer(self, w: _LayerWeights, i: int, x: torch.Tensor, t: int, dec: KVCache, mem: MemoryKV,
               visible: int, B: int) -> torch.Tensor:
        cd, Dh, eps = self.compute_dtype, self.head_dim, self.eps
        h, h_kv = w.num_heads, w.num_kv_heads
        g = h // h_kv
        # self-attention over the decoder's K/V of positions [0, t]
        a = _rms(x, w.attn_norm, eps).to(cd)
        qkv = torch.mm(a, w.qkv) if w.qkv_bias is None else torch.addmm(w.qkv_bias, a, w.qkv)
        qk = qkv[:, :(h + h_kv) * Dh].view(B, h + h_kv, Dh)
        # RoPE at position t: x * cos + rotate_half(x) * sin, rotate_half = roll with signs
        qk = torch.addcmul(qk * self.cos[t], qk.roll(Dh // 2, dims=-1), self.sin_signed[t])
        v = qkv[:, (h + h_kv) * Dh:].view(B, h_kv, Dh)
        dec.write_position(i, t, qk[:, h:], v)
        keys, values = dec.view(i, t + 1)  # (B, h_kv, t + 1, Dh)
        q = qk[:, :h].reshape(B * h_kv, g, Dh)
        att = _attend(q, keys.reshape(B * h_kv, t + 1, Dh), values.reshape(B * h_kv, t + 1, Dh))
        x = _residual_mm(x, att.view(B, h * Dh), w.o)
        # cross-attention into {null} + the visible memory
        cq = torch.mm(_rms(x, w.cross_norm, eps).to(cd), w.cross_q).view(B * h_kv, g, Dh)
        ck, cv = mem.visible(i, visible - 1)  # (B, h_kv, visible, Dh)
        att = _attend(cq, ck.reshape(B * h_kv, visible, Dh).to(cd), cv.reshape(B * h_kv, visible, Dh).to(cd))
        x = _residual_mm(x, att.view(B, h * Dh), w.cross_o)
        # SwiGLU MLP
        gu = torch.mm(_rms(x, w.mlp_norm, eps).to(cd), w.gate_up)  # (B, 2F)
        F_ = gu.shape[1] // 2
        return _residual_mm(x, F.silu(gu[:, :F_]) * gu[:, F_:], w.down)
