"""Building blocks shared by the encoder and the decoder: RMSNorm, RoPE, attention
projections, SwiGLU. Plain single-device modules: ``parallel/`` swaps the linear layers for
megatron-core ones by name, so every projection is an attribute called through ``__call__``
and head counts are read off the projection's output size (a shard holds
``n_heads / shards`` heads and the code below never needs to know).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlt_mega.model.attention import encoder_attention
from rlt_mega.precision import LOW_PRECISION


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back (the Llama/Qwen2 convention)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype in LOW_PRECISION:
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x.to(dtype)
        # fp32/fp64: the fused kernel (same values as the formula above, fewer dispatches)
        return F.rms_norm(x, self.weight.shape, self.weight.to(dtype), self.eps)


class Rotary(nn.Module):
    """Rotary position embedding, rotate-half layout (as HF Llama/Qwen2, so imports need no
    permutation of q/k weights).

    The tables are computed in float64 and kept outside the module's buffers, so that
    ``model.to(torch.bfloat16)`` cannot round them; they are moved to the input's device
    once and cast to the input's dtype at use.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (max_seq_len, Dh), computed in float64 and rounded once to ``dtype``
        (float32 for low-precision inputs, as HF does; the product is then taken in x's dtype)."""
        key = (device, dtype)
        if key not in self._tables:
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
                                             / self.head_dim))
            t = torch.arange(self.max_seq_len, dtype=torch.float64, device=device)
            emb = torch.outer(t, inv_freq).repeat(1, 2)
            table_dtype = dtype if dtype == torch.float64 else torch.float32
            self._tables[key] = (emb.cos().to(table_dtype).to(dtype), emb.sin().to(table_dtype).to(dtype))
        return self._tables[key]

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x: (B, h, T, Dh) at positions start .. start + T - 1."""
        T = x.shape[-2]
        if start + T > self.max_seq_len:
            raise ValueError(f"position {start + T - 1} is past model.max_seq_len={self.max_seq_len}: "
                             "raise model.max_seq_len")
        cos, sin = self.tables(x.device, x.dtype)
        cos, sin = cos[start:start + T], sin[start:start + T]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables at per-row positions (B, n) (documents packed in a row restart at 0): (cos,
        sin), each (B, 1, n, Dh), for ``rotate``."""
        cos, sin = self.tables(positions.device, dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, h, n, Dh) with table rows (B, 1, n, Dh) from ``rows``: the same products as
        ``forward`` where the positions are start + arange(n)."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


    def at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (B, h, 1, Dh), row b at position positions[b] ((B,) long on the device)."""
        cos, sin = self.tables(x.device, x.dtype)
        cos, sin = cos.index_select(0, positions)[:, None, None], sin.index_select(0, positions)[:, None, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class SelfAttentionProj(nn.Module):
    """The q, k, v, o projections of a shared block's self-attention."""

    def __init__(self, d: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(d, n_heads * head_dim, bias=bias)
        self.k = nn.Linear(d, n_kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(d, n_kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(n_heads * head_dim, d, bias=False)

    def heads(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d) through ``proj`` -> (B, heads, T, Dh)."""
        B, T, _ = x.shape
        return proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, d) -> q (B, h, T, Dh), k and v (B, h_kv, T, Dh)."""
        return self.heads(self.q, x), self.heads(self.k, x), self.heads(self.v, x)

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """attn: (B, h, T, Dh) -> (B, T, d)."""
        B, _, T, _ = attn.shape
        return self.o(attn.transpose(1, 2).reshape(B, T, -1))


class CrossAttentionProj(SelfAttentionProj):
    """Cross-attention of the decoder into the encoder memory: the same projections, no biases.
    No RoPE: the memory already carries its position through the encoder, and the null slot has
    no position."""

    def __init__(self, d: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__(d, n_heads, n_kv_heads, head_dim, bias=False)

    def kv(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """m: (B, S, d) memory -> k, v (B, h_kv, S, Dh)."""
        return self.heads(self.k, m), self.heads(self.v, m)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 1, d) -> (B, h, 1, Dh)."""
        return self.heads(self.q, x)


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """A shared block: pre-norm self-attention and SwiGLU MLP. Encoder layer i and decoder
    layer i call the same instance (unless model.share_weights is false)."""

    def __init__(self, d: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_hidden: int,
                 eps: float, qkv_bias: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d, eps)
        self.attn = SelfAttentionProj(d, n_heads, n_kv_heads, head_dim, qkv_bias)
        self.mlp_norm = RMSNorm(d, eps)
        self.mlp = SwiGLU(d, ffn_hidden)

    def causal(self, h: torch.Tensor, rotary: "Rotary", start: int, cache=None, slot: int = 0,
               documents=None) -> torch.Tensor:
        """The block over h (B, n, d) at positions [start, start + n), causal: with a cache
        (model/cache.py) its K/V go to layer ``slot`` of it and the queries attend to the cached
        prefix as well (no autograd through the cache); with documents (model/documents.py, the
        whole row: start 0, no cache) RoPE positions and attention are the documents' own."""
        q, k, v = self.attn.qkv(self.attn_norm(h))  # q (B, h, n, Dh); k, v (B, h_kv, n, Dh)
        if documents is not None:
            cos, sin = documents.rope(rotary, q.dtype)  # (B, 1, n, Dh)
            q, k = Rotary.rotate(q, cos, sin), Rotary.rotate(k, cos, sin)
        else:
            q, k = rotary(q, start), rotary(k, start)
        if cache is not None:
            cache.write(slot, start, k, v)
            k, v = cache.view(slot, start + h.shape[1])
        attn = encoder_attention(q, k, v, start) if documents is None else documents.attention(q, k, v)
        h = h + self.attn.out(attn)
        return h + self.mlp(self.mlp_norm(h))


class CrossBlock(nn.Module):
    """Decoder-only: pre-norm cross-attention into {null_memory} + committed memory."""

    def __init__(self, d: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.cross_norm = RMSNorm(d, eps)
        self.attn = CrossAttentionProj(d, n_heads, n_kv_heads, head_dim)
