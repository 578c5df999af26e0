"""The fused decoder layout and kernels, used by the one decoder step
(model/decoder.py), which serves the sampler's no-grad steps and the training step alike.

Weights. A decoder layer is six products per position: ``qkv`` (q, k, v in one GEMM), ``o``,
``cross_q``, ``cross_o``, ``gate_up`` (gate and up in one GEMM) and ``down``; the first stage
adds ``recur`` (recur_proj). Each fused weight is (out, in) with the RMSNorm weight that precedes
it folded into its columns and the attention scale 1/sqrt(Dh) into the q rows, computed in fp32
at least and rounded once (:func:`fuse_layer`, :func:`fuse_recurrence`). With autograd on, the
folding is an ordinary differentiable expression of the parameters, so the training step only
needs the gradient of each fused weight: autograd takes it back to q/k/v/norm weights.

On sharded layers the same expressions read megatron-core's shards (column layers
(out/shards, in), row layers (out, in/shards)); a norm weight folded into a column shard gets only that
shard's part of its gradient, so it enters through ``replicate`` (identity forward, all-reduce of
the gradient backward: megatron's copy_to_tensor_model_parallel_region), supplied by parallel/.

Kernels. At decoder batch sizes (8-16 rows) a per-position product reads far more weight bytes
than it does FLOPs, and ``torch.mm`` (MKL) streams a weight set that does not fit the caches at
about a third of this CPU's matmul peak (d=512, L=4: 60 MB of decoder weights, 29 GFLOP/s against
a 95 GFLOP/s peak, measured by tools/bench/training.py's kernel line). oneDNN's linear with the
weight reordered once for the row count streams it at about twice that (54 GFLOP/s; 95 when the
weight is cached), so :class:`Gemm` prepares each weight once per forward (its forward form and,
for training, the transposed form of the input-gradient product) and uses oneDNN on CPU for fp32
and bf16 weights of at least ``MKLDNN_MIN_ELEMENTS`` elements; ``torch.mm`` elsewhere (fp64, CUDA,
small weights whose call overhead dominates). On the CPU that product reads the weight stored
transposed, (in, out) contiguous: MKL copies a transposed right operand into its packed layout on
every call, which at 8 rows took three times as long as the product itself (sampled with py-spy
in small_cpu's training step: 7% of the step; storing it transposed gains 4% there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from rlt_mega.precision import LOW_PRECISION

# Weights with fewer elements run torch.mm: oneDNN's linear costs ~10 us more per call, which
# it wins back only on larger weights (measured at 8-16 rows: 256 x 1408 84 vs 107 us, 704 x 256
# 47 vs 49, 256 x 512 38 vs 38, 128 x 768 31 vs 28). Tests set it to 0 to run the oneDNN kernels
# on tiny models.
MKLDNN_MIN_ELEMENTS = 150_000


def _mkldnn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _mkldnn_bf16() -> bool:
    """oneDNN's bf16 products need AVX512 (bw, vl, dq) or AVX-NE-CONVERT; on an AVX2-only CPU (an
    AMD EPYC without AVX512, say) its reorder refuses bf16 weights, so they run torch.mm there."""
    return _MKLDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()


_MKLDNN = _mkldnn_available()
MKLDNN_BF16 = _mkldnn_bf16()


def wide(w: torch.Tensor) -> torch.Tensor:
    """fp32 at least: folding happens there and is rounded once."""
    return w.to(torch.promote_types(w.dtype, torch.float32))


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of norm statistics, softmax and gradient accumulators: fp32 (fp64 for fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------
# Fused weights: differentiable expressions of the module parameters
# ------------------------------------------------------------------------------------------

Replicate = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


LAYER_WEIGHTS = ("qkv", "o", "cross_q", "cross_o", "gate_up", "down")


def fuse_layer(block: nn.Module, cross: nn.Module, head_dim: int, replicate: Replicate = _identity
               ) -> dict[str, Optional[torch.Tensor]]:
    """One decoder layer's fused weights (out, in), fp32 at least, plus ``qkv_bias``.

    block: the decoder's Block i (attn_norm, attn.q/k/v/o, mlp_norm, mlp.gate/up/down); cross:
    CrossBlock i. The cross-attention's k and v act on the memory, outside the per-position step
    (the memory K/V are inputs of the decoder)."""
    a, c, m = block.attn, cross.attn, block.mlp
    scale = 1.0 / math.sqrt(head_dim)

    def fold(w: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return w * replicate(wide(norm.weight))[None, :]

    qkv = torch.cat([wide(a.q.weight) * scale, wide(a.k.weight), wide(a.v.weight)])
    bias = None
    if a.q.bias is not None:
        bias = torch.cat([wide(a.q.bias) * scale, wide(a.k.bias), wide(a.v.bias)])
    return {
        "qkv": fold(qkv, block.attn_norm),
        "qkv_bias": bias,
        "o": wide(a.o.weight),
        "cross_q": fold(wide(c.q.weight) * scale, cross.cross_norm),
        "cross_o": wide(c.o.weight),
        "gate_up": fold(torch.cat([wide(m.gate.weight), wide(m.up.weight)]), block.mlp_norm),
        "down": wide(m.down.weight),
    }


def fuse_recurrence(recur_norm: nn.Module, recur_proj: nn.Module) -> torch.Tensor:
    """recur_proj with recur_norm folded in: (d, d), fp32 at least (replicated across shards)."""
    return wide(recur_proj.weight) * wide(recur_norm.weight)[None, :]


def head_counts(block: nn.Module, head_dim: int) -> tuple[int, int]:
    """(query heads, key/value heads) of this rank's shard: read off the projections."""
    return block.attn.q.weight.shape[0] // head_dim, block.attn.k.weight.shape[0] // head_dim


# ------------------------------------------------------------------------------------------
# The per-position product
# ------------------------------------------------------------------------------------------

class Gemm:
    """A weight w (out, in) in the compute dtype, prepared for the per-position products
    ``x @ w^T`` (``__call__``, ``add``) and, with ``backward``, ``g @ w`` (``grad_input``).

    rows: the batch size the products will see (oneDNN's reorder is tuned for it; any row
    count works)."""

    def __init__(self, w: torch.Tensor, rows: int, backward: bool = False,
                 bias: Optional[torch.Tensor] = None) -> None:
        self.w, self.bias, self.rows, self.backward = w, bias, rows, backward
        self.out_features, self.in_features = w.shape
        self.mkldnn = (_MKLDNN and w.device.type == "cpu" and w.numel() >= MKLDNN_MIN_ELEMENTS
                       and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and MKLDNN_BF16)))
        self._prepare()

    def _prepare(self) -> None:
        """The forms the products read, from ``w``: oneDNN's reordered weight (and, with
        ``backward``, its transpose's), or the forward product's right operand ``wt``: on the CPU
        a contiguous copy (MKL repacks a transposed right operand on every call), else a view."""
        w = self.w
        self.fwd = self.bwd = None
        if self.mkldnn:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            self.fwd = reorder(w.contiguous(), self.rows)
            self.bwd = reorder(w.t().contiguous(), self.rows) if self.backward else None
        self.wt = w.t().contiguous() if w.device.type == "cpu" and not self.mkldnn else w.t()

    def load(self, w: torch.Tensor) -> None:
        """New values for the weight, in place (a captured graph reads its address)."""
        self.w.copy_(w)
        self._prepare()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, in) -> x @ w^T (+ bias) (B, out)."""
        if self.mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.fwd, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.wt)
        return torch.addmm(self.bias, x, self.wt)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ w^T, the residual add fused into the product where the dtypes agree
        (a bf16 product into an fp32 stream is added after it, as the module path does under
        autocast)."""
        if residual.dtype != x.dtype:
            return residual + self(x)
        if self.mkldnn:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.fwd, None, "add")
        return torch.addmm(residual, x, self.wt)

    def grad_input(self, g: torch.Tensor) -> torch.Tensor:
        """g (B, out) -> g @ w (B, in): the gradient of the product's input."""
        if self.mkldnn:
            return torch.ops.mkldnn._linear_pointwise(g, self.bwd, None, "none", [], "")
        return torch.mm(g, self.w)


@dataclass
class LayerGemms:
    """One decoder layer's prepared products and head counts (this rank's shard)."""

    qkv: Gemm
    o: Gemm
    cross_q: Gemm
    cross_o: Gemm
    gate_up: Gemm
    down: Gemm
    num_heads: int
    num_kv_heads: int

    @classmethod
    def build(cls, fused: dict[str, Optional[torch.Tensor]], dtype: torch.dtype, rows: int, backward: bool,
              num_heads: int, num_kv_heads: int) -> "LayerGemms":
        """fused: :func:`fuse_layer`'s tensors (any dtype; cast to ``dtype`` here, once)."""
        bias = fused["qkv_bias"]
        bias = None if bias is None else bias.detach().to(dtype)

        def gemm(name: str, b: Optional[torch.Tensor] = None) -> Gemm:
            return Gemm(fused[name].detach().to(dtype), rows, backward, b)

        return cls(qkv=gemm("qkv", bias), o=gemm("o"), cross_q=gemm("cross_q"), cross_o=gemm("cross_o"),
                   gate_up=gemm("gate_up"), down=gemm("down"), num_heads=num_heads, num_kv_heads=num_kv_heads)


# ------------------------------------------------------------------------------------------
# Elementwise kernels: RMSNorm without its weight, RoPE, single-query attention
# ------------------------------------------------------------------------------------------

class NormConstants:
    """eps and the (d, 1) column of 1/d that turns mean(x^2) + eps into one addmm."""

    def __init__(self, d: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = stat_dtype(dtype)
        self.eps = torch.full((1,), eps, dtype=self.dtype, device=device)
        self.mean_col = torch.full((d, 1), 1.0 / d, dtype=self.dtype, device=device)


def rms_forward(x: torch.Tensor, nc: NormConstants, compute_dtype: torch.dtype,
                out: Optional[torch.Tensor] = None, out_r: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, d) -> (x / rms(x) in the compute dtype (B, d), 1 / rms(x) (B, 1) in the statistics
    dtype). The statistics in fp32 (fp64), as layers.RMSNorm; the norm's weight lives in the
    next product. ``out``/``out_r``: where to write them."""
    xf = x.float() if x.dtype in LOW_PRECISION else x
    r = torch.addmm(nc.eps, xf * xf, nc.mean_col, out=out_r).rsqrt_()
    if compute_dtype == xf.dtype:
        return torch.mul(xf, r, out=out), r
    a = (xf * r).to(compute_dtype)
    if out is not None:
        out.copy_(a)
        a = out
    return a, r


def rms_backward(da: torch.Tensor, a: torch.Tensor, r: torch.Tensor, nc: NormConstants,
                 residual: Optional[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient of x for a = x * r (r = 1 / rms(x)) given da, plus ``residual``:
    residual + r * (da - a * mean(da * a)). da, a (B, d); r (B, 1); -> (B, d) in the dtype of
    ``out`` (or of the statistics)."""
    if da.dtype != nc.dtype:
        da, a = da.to(nc.dtype), a.to(nc.dtype)
    rm = torch.mm(da * a, nc.mean_col).mul_(r)  # (B, 1): r * mean(da * a)
    if residual is None:
        g = torch.mul(da, r) if out is None or out.dtype != nc.dtype else torch.mul(da, r, out=out)
    elif residual.dtype == nc.dtype and (out is None or out.dtype == nc.dtype):
        g = torch.addcmul(residual, da, r, out=out)
    else:
        g = residual.to(nc.dtype) + da * r
    g = g.addcmul_(a, rm, value=-1)
    if out is not None and g is not out:
        out.copy_(g)
        g = out
    return g


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the rotate-half tables (max_seq_len, Dh): (cos, sin_fwd, sin_bwd) such that RoPE is
    ``x * cos + roll(x, Dh/2) * sin_fwd`` and its transpose ``g * cos + roll(g, Dh/2) * sin_bwd``
    (roll by half the head is its own inverse; the signs of rotate_half move with it)."""
    half = cos.shape[-1] // 2
    sin_fwd = torch.cat([-sin[:, :half], sin[:, half:]], dim=1)
    sin_bwd = torch.cat([sin_fwd[:, half:], sin_fwd[:, :half]], dim=1)
    return cos, sin_fwd, sin_bwd


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (B, heads, Dh); cos, sin (Dh,) or (1, Dh) of the position -> RoPE(x). With the
    backward table, the gradient of the input from the gradient of the output."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, x.roll(half, dims=-1), sin, out=out)


def attend(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One query position, grouped heads: q (B h_kv, g, Dh) already scaled; keys_t
    (B h_kv, Dh, S), values (B h_kv, S, Dh); mask: additive (1, 1, S) (0 or -inf), or None when
    every key is visible -> (B h_kv, g, Dh). Softmax in fp32 (fp64 for fp64)."""
    scores = torch.bmm(q, keys_t) if mask is None else torch.baddbmm(mask, q, keys_t)  # (B h_kv, g, S)
    probs = torch.softmax(scores, dim=-1, dtype=stat_dtype(scores.dtype))
    return torch.bmm(probs if probs.dtype == q.dtype else probs.to(q.dtype), values, out=out)


def attention_grads(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, grad_out: torch.Tensor,
                    mask: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`attend` for q: recomputes the probabilities (one query row per head)
    -> (probabilities, score gradients, both (B h_kv, g, S) in the statistics dtype, and the
    gradient of q (B h_kv, g, Dh)). The keys' gradient is q^T (score gradients), the values'
    probabilities^T grad_out: the caller adds them where they belong."""
    scores = torch.bmm(q, keys_t) if mask is None else torch.baddbmm(mask, q, keys_t)
    probs = torch.softmax(scores, dim=-1, dtype=stat_dtype(scores.dtype))  # (B h_kv, g, S)
    grad_p = torch.bmm(grad_out, values.transpose(1, 2))  # (B h_kv, g, S)
    grad_s = torch._softmax_backward_data(grad_p.to(probs.dtype), probs, -1, probs.dtype)
    gs = grad_s if grad_s.dtype == q.dtype else grad_s.to(q.dtype)
    return probs, grad_s, torch.bmm(gs, keys_t.transpose(1, 2), out=out)
