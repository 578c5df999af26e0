"""Memory of the decoder step (model/decoder.py) on one rank, for cost/memory.py.

The fused path keeps nothing in autograd's graph per position: one run per micro-batch owns a
slab of preallocated buffers (``DecoderRun.buffer_bytes()`` names them; :func:`run_buffer_bytes`
is the same arithmetic), and the stage holds a few copies of its decoder weights:

  slab, per micro-batch   "saved": the slot tensors (RoPE'd q/k, cross query, gate/up, SwiGLU
                          product) for every position ("none") or, checkpointed (recomputed
                          before each backward), for one position and the SwiGLU product for
                          W = ceil(512 / B) positions (its weight-gradient flush reads it); in
                          every mode the three norms' normalised inputs with 1/rms and the two
                          attention outputs per position; "kv": decoder and memory K/V and their
                          fp32 gradients; "wgrad_ring": W positions of each product's output
                          gradient (the deferred weight gradients); "kv_rows": KV_CHUNK
                          positions of query rows, probabilities and score gradients (the
                          deferred K/V gradients); "input_grads": the embeddings' gradient
  fused weights           each product's fused weight (fp32 at least), kept from the forward
                          to the end of the step; the fold's saved inputs (the concatenated
                          q/k/v and gate/up, the scaled cross query); in a bf16 run the bf16
                          copies the products read; on CPU oneDNN's reordered forward and
                          backward forms of every weight of >= MKLDNN_MIN_ELEMENTS elements
                          and a transposed copy of each smaller one
  accumulators            fp32, one per fused weight, from the decoder's backward until autograd
                          has taken each to the parameters

The slab and the fused weights belong to the graph: they live until the loss is dropped, through
the encoder's backward and the optimizer step (the slab then goes back to the workspace pool,
which keeps it for the next step: in a long run it is resident). The part only the backward
uses (rings, K/V gradients and rows, the embeddings' gradient: :func:`run_scratch_bytes`) is
allocated at the decoder's backward and, in the dense schedule, freed at its end. tests/unit/test_costmodel.py
checks the slab against DecoderRun.buffer_bytes() exactly and the step's peak against MemTracker.
"""

from __future__ import annotations

import functools

from rlt_mega.config import ModelConfig
from rlt_mega.model import kernels as fused_kernels
from rlt_mega.model.decoder import KV_CHUNK, checkpoint_slots, wgrad_positions
from rlt_mega.model.workspace import SLAB_ALIGN
from rlt_mega.cost.layout import Layout
from rlt_mega.cost.params import stage_layers

PURPOSES = ("saved", "wgrad_ring", "kv_rows", "kv", "input_grads")


def _aligned(nbytes: float) -> int:
    return -(-int(nbytes) // SLAB_ALIGN) * SLAB_ALIGN


def _shapes(cfg: ModelConfig, layout: Layout) -> tuple[int, int, int, int, int]:
    """(d, Dh, h, h_kv, F) on one tensor-parallel rank."""
    tp = layout.tp
    return cfg.d_model, cfg.head_dim, cfg.n_heads // tp, cfg.n_kv_heads // tp, cfg.ffn_hidden // tp


def _checkpointed(layout: Layout) -> bool:
    return layout.checkpointing.decoder != "none"


def run_buffer_bytes(cfg: ModelConfig, layout: Layout, stage: int, grad: bool = True,
                     scratch: bool = False) -> dict[str, int]:
    """One micro-batch's slab by purpose, in bytes: DecoderRun.buffer_bytes() of the run the dense
    schedule (or a pipeline stage) builds for B = micro_batch_size rows of T = seq_len positions."""
    n = len(stage_layers(cfg.n_layers, layout.pp, layout.pp_split)[stage])
    out = _run_buffer_bytes(_shapes(cfg, layout), n, layout.micro_batch_size, layout.seq_len, layout.act_bytes,
                            _checkpointed(layout), stage == 0, grad)
    if scratch:
        return {"scratch": out["wgrad_ring"] + out["kv_rows"] + out["input_grads"] + out["kv_grads"]}
    return {k: v for k, v in out.items() if k != "kv_grads"}


@functools.lru_cache(maxsize=4096)  # the planner asks for the same shapes across its thousands of layouts
def _run_buffer_bytes(shapes: tuple, n: int, B: int, T: int, a: int, checkpointed: bool, first: bool,
                      grad: bool) -> dict[str, int]:
    """run_buffer_bytes of n layers of these shapes, "kv" holding the K/V gradients, also named
    apart as "kv_grads" (part of the scratch); ``first``: the stage that holds the recurrence input."""
    d, Dh, h, h_kv, F = shapes
    g, BH, S = h // h_kv, B * h_kv, 1 + T  # S: the null slot + every position's memory
    st = 4  # the statistics dtype (1/rms, K/V gradients, the K/V rows): fp32
    W, Wkv = wgrad_positions(B, T), min(KV_CHUNK, T)
    slots = checkpoint_slots(B, T) if checkpointed else T
    out = dict.fromkeys((*PURPOSES, "kv_grads"), 0)
    if n:  # every layer's buffers are the same: one layer's, times n below
        one = 1 if checkpointed else slots  # qk, cq, gu: one slot when checkpointed
        for width, rows in (((h + h_kv) * Dh, one), (h * Dh, one), (2 * F, one), (F, slots)):  # qk cq gu f
            out["saved"] += _aligned(rows * B * width * a) if grad else 0  # (a run without backward keeps none)
        for width, size in ((d, a), (1, st), (h * Dh, a), (d, a), (1, st), (h * Dh, a), (d, a), (1, st)):
            out["saved"] += _aligned(T * B * width * size) if grad else 0  # a1 r1 o1 a2 r2 c a3 r3
        out["kv"] += 2 * _aligned(B * h_kv * Dh * T * a) + 2 * _aligned(BH * Dh * S * a)
        if grad:
            for width in ((h + 2 * h_kv) * Dh, d, h * Dh, d, 2 * F, d):  # dqkv g2 dcq g3 dgu g4
                out["wgrad_ring"] += _aligned(W * B * width * a)
            out["kv_grads"] += 2 * _aligned(B * h_kv * Dh * T * st) + 2 * _aligned(BH * Dh * S * st)
            for keys in (T, S):  # self, memory: q and do rows, p and ds rows
                out["kv_rows"] += 2 * _aligned(BH * Wkv * g * Dh * st) + 2 * _aligned(BH * Wkv * g * keys * st)
    out = {k: n * v for k, v in out.items()}
    if first and grad:  # the recurrence input: a0 and r0, and u's gradient
        out["saved"] += _aligned(T * B * d * a) + _aligned(T * B * st)
        out["input_grads"] += _aligned(T * B * d * a)
    out["kv"] += out["kv_grads"]
    return out


def run_scratch_bytes(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """The part of :func:`run_buffer_bytes` that only the backward uses (DecoderRun.scratch_bytes():
    the rings, the K/V gradients and rows, the embeddings' gradient). The dense schedule allocates
    it at the decoder's backward and frees it at the end; a pipeline stage keeps it with the run."""
    return run_buffer_bytes(cfg, layout, stage, scratch=True)["scratch"]


def fused_weight_numels(cfg: ModelConfig, layout: Layout, stage: int) -> dict[str, int]:
    """Elements of each fused weight of the stage on one rank, by product (summed over its layers)."""
    d, Dh, h, h_kv, F = _shapes(cfg, layout)
    n = len(stage_layers(cfg.n_layers, layout.pp, layout.pp_split)[stage])
    per_layer = {"qkv": (h + 2 * h_kv) * Dh * d, "o": d * h * Dh, "cross_q": h * Dh * d, "cross_o": d * h * Dh,
                 "gate_up": 2 * F * d, "down": d * F}
    out = {k: n * v for k, v in per_layer.items()}
    out["qkv_bias"] = n * (h + 2 * h_kv) * Dh if cfg.qkv_bias else 0
    out["recur"] = d * d if stage == 0 else 0
    return out


def fused_weight_bytes(cfg: ModelConfig, layout: Layout, stage: int) -> dict[str, float]:
    """The stage's weight copies: "weights" (the fused weights, the fold's saved inputs and the
    compute-dtype forms: alive from the decoder's forward to the end of the step) and
    "accumulators" (the deferred weight gradients, during the decoder's backward)."""
    numel = fused_weight_numels(cfg, layout, stage)
    d, Dh, h, h_kv, F = _shapes(cfg, layout)
    a, total = layout.act_bytes, sum(numel.values())
    fused = 4 * total  # fp32 at least (fp32 and bf16 runs)
    # the fold w * norm saves w: the concatenated qkv and gate_up and the scaled cross query are
    # new tensors; o, cross_o, down and recur are the parameters themselves (fp32) or, in a
    # bf16 run, fp32 copies (the fused weights themselves, or recur's input)
    folded = 4 * (numel["qkv"] + numel["cross_q"] + numel["gate_up"] + (numel["recur"] if a != 4 else 0))
    forms = 0.0 if a == 4 else a * total  # the products' bf16 copies
    if layout.onednn_weights:  # on the CPU (model/fused.Gemm): oneDNN's forward and backward forms
        # of the large fp32/bf16 weights, the transposed copy the torch.mm products read of the rest
        sizes = {"qkv": (h + 2 * h_kv) * Dh * d, "o": d * h * Dh, "cross_q": h * Dh * d, "cross_o": d * h * Dh,
                 "gate_up": 2 * F * d, "down": d * F, "recur": d * d}
        for name, size in sizes.items():
            count = numel[name] // size if size else 0  # layers of the stage (or the recurrence)
            onednn = size >= fused_kernels.MKLDNN_MIN_ELEMENTS and (a == 4 or (a == 2 and fused_kernels.MKLDNN_BF16))
            forms += (2 if onednn else 1) * a * size * count
    return {"weights": fused + folded + forms, "accumulators": 4.0 * total}
