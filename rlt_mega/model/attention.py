"""Attention kernels of the three attention kinds: causal encoder self-attention (one batch or
chunk by chunk with a cache), single-position decoder self-attention over the decoder's own
K/V, and single-position cross-attention into the visible memory.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from rlt_mega.model.cache import DecoderKV, KVCache, MemoryKV


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                      mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of queries at positions [start, start + n) to keys [0, start + n).

    q: (B, h, n, Dh); k, v: (B, h_kv, start + n, Dh) -> (B, h, n, Dh). ``mask`` (B, n, start + n)
    bool, packed documents (model/documents.py): query i sees key j where True (causal within
    its document).
    """
    n, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
    if start == 0 and S == n:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # A chunk after a cached prefix: query i (position start + i) sees keys j <= start + i.
    q_pos = torch.arange(start, start + n, device=q.device)
    k_pos = torch.arange(S, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q: (B, h_kv, g, Dh) grouped queries of one position; k, v: (B, h_kv, 1 + vis, Dh), all
    visible (the null slot and the committed memory) -> (B, h_kv, g, Dh). ``mask`` (B, 1, 1,
    1 + vis) bool: packed documents, the slots of the query's own document (the null slot
    always)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def memory_attention(q: torch.Tensor, mem: MemoryKV, layer: int, n: int,
                     mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Cross-attention of one position into memory slots [0, n) of ``layer``: q (B, h_kv, g,
    Dh) grouped -> (B, h_kv, g, Dh). The forward is ``cross_attention`` in every schedule
    (sampling, replay, training), so values are identical; with autograd the prefix's
    gradient goes to ``mem.accumulate`` instead of through a slice (see MemoryKV)."""
    k, v = mem.k[layer], mem.v[layer]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return MemoryAttention.apply(q, k, v, mem, layer, n, mask)
    return cross_attention(q, k[:, :, :n], v[:, :, :n], mask)


class MemoryAttention(torch.autograd.Function):
    """``cross_attention`` into the prefix [0, n) of the memory K/V whose backward adds the
    prefix's K/V gradient to ``mem`` (returning none for k, v themselves).

    Backward recomputes the attention with autograd on the same inputs, under the forward's
    autocast state, so q, k and v get exactly the gradients a plain autograd graph gives
    (the same kernels on the same values); the extra forward of one query row per head is
    cheap next to the full-size fill the slice would cost."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mem: MemoryKV, layer: int,
                n: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        ctx.save_for_backward(q)
        ctx.mem, ctx.layer, ctx.n, ctx.mask = mem, layer, n, mask
        ctx.autocast = (torch.is_autocast_enabled(q.device.type), torch.get_autocast_dtype(q.device.type))
        return cross_attention(q, k[:, :, :n], v[:, :, :n], mask)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (q,) = ctx.saved_tensors
        mem: MemoryKV = ctx.mem
        k, v = mem.k[ctx.layer][:, :, :ctx.n], mem.v[ctx.layer][:, :, :ctx.n]
        needs = ctx.needs_input_grad
        with torch.enable_grad():
            q_, k_, v_ = (x.detach().requires_grad_(r) for x, r in zip((q, k, v), needs[:3]))
            enabled, dtype = ctx.autocast
            with torch.autocast(device_type=q.device.type, dtype=dtype, enabled=enabled):
                out = cross_attention(q_, k_, v_, ctx.mask)
            wrt = [x for x in (q_, k_, v_) if x.requires_grad]
            grads = iter(torch.autograd.grad(out, wrt, grad_out))
        grad_q, grad_k, grad_v = (next(grads) if r else None for r in needs[:3])
        if grad_k is not None:
            mem.accumulate(ctx.layer, grad_k, grad_v)
        return grad_q, None, None, None, None, None, None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with the probabilities returned; softmax in fp32 (or fp64). ``mask``
    (B, 1, 1, S) bool: the keys of the query's own document (packed rows); masked keys get
    probability exactly 0, so neither they nor their gradients depend on other documents."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, h_kv, g, S)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v), probs


class DecoderSelfAttention(torch.autograd.Function):
    """Decoder self-attention at step t over the decoder's K/V of positions [0, t].

    Forward writes this step's k, v into the cache and attends to the cached prefix, so
    memory grows O(T) over a sequence. Backward recomputes the probabilities (cheap: one
    query row per head), adds the key/value gradients of [0, t] to the cache's gradient
    buffer and returns the (now complete) gradient of this step's k and v.

    Under no_grad (sampling, replay) only the forward runs, the same code as in training.
    Computed in the dtype of q with autocast off, so forward and backward see the same types.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                layer: int, t: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        # q: (B, h_kv, g, Dh) grouped; k, v: (B, h_kv, 1, Dh); mask (B, 1, 1, t + 1) or None
        cache.write(layer, t, k, v)
        keys, values = cache.view(layer, t + 1)
        with torch.autocast(device_type=q.device.type, enabled=False):
            out, _ = _attend(q, keys.to(q.dtype), values.to(q.dtype), mask)
        ctx.save_for_backward(q)
        ctx.cache, ctx.layer, ctx.t, ctx.mask = cache, layer, t, mask
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (q,) = ctx.saved_tensors
        cache: DecoderKV = ctx.cache
        if not isinstance(cache, DecoderKV):
            raise RuntimeError("decoder self-attention backward needs a DecoderKV cache (dense schedule)")
        keys, values = cache.view(ctx.layer, ctx.t + 1)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        scale = 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(device_type=q.device.type, enabled=False):
            _, probs = _attend(q, keys, values, ctx.mask)  # (B, h_kv, g, t + 1)
            grad_out = grad_out.to(q.dtype)
            grad_values = torch.matmul(probs.transpose(-1, -2), grad_out)  # (B, h_kv, t + 1, Dh)
            grad_probs = torch.matmul(grad_out, values.transpose(-1, -2))  # (B, h_kv, g, t + 1)
            grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
            grad_q = torch.matmul(grad_scores, keys) * scale
            grad_keys = torch.matmul(grad_scores.transpose(-1, -2), q) * scale
        grad_k, grad_v = cache.accumulate(ctx.layer, ctx.t, grad_keys, grad_values)
        kv_dtype = cache.k[ctx.layer].dtype
        return grad_q, grad_k.to(kv_dtype), grad_v.to(kv_dtype), None, None, None, None


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The row schedule's single-position attention (no grad), rows at their own positions:
    q (B, h_kv, g, Dh) grouped, k, v (B, h_kv, S, Dh), hidden (B, 1, 1, S) True where row b
    must not look -> (B, h_kv, g, Dh). Softmax in fp32 (fp64), autocast off, as the decoder's
    self-attention."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        k, v = k.to(q.dtype), v.to(q.dtype)
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = (torch.matmul(q, k.transpose(-1, -2)) * scale).masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
        return torch.matmul(probs, v)
