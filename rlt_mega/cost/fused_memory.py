"""Memory of the decoder step (model/decoder.py) on one rank, for cost/memory.py.

The fused path keeps nothing in autograd's graph per position: one run per micro-batch owns a
slab of preallocated buffers (``DecoderRun.buffer_bytes()`` names them; :func:`run_buffer_bytes`
prices the same list, model/run_buffers.py), and the stage holds a few copies of its decoder weights:

  slab, per micro-batch   model/run_buffers.run_buffers, the list the decoder allocates from:
                          "saved": every tensor the backward and the weight-gradient flush read,
                          for every position ("none") or, checkpointed every k positions, for a
                          ring of whole flush chunks covering W + k - 1 positions (k = 1: the
                          tensors only a position's own backward reads in one slot); "inputs":
                          the stage inputs a checkpointed run recomputes from; "kv": decoder and
                          memory K/V and their fp32 gradients; "wgrad_ring": W positions of each
                          product's output gradient (the deferred weight gradients); "kv_rows":
                          KV_CHUNK positions of query rows, probabilities and score gradients (the
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
from rlt_mega.model import run_buffers as run_buffers_module
from rlt_mega.model.run_buffers import bytes_by_purpose, run_buffers
from rlt_mega.cost.layout import Layout
from rlt_mega.cost.params import stage_layers


def _shapes(cfg: ModelConfig, layout: Layout) -> tuple[int, int, int, int, int]:
    """(d, Dh, h, h_kv, F) on one tensor-parallel rank."""
    tp = layout.tp
    return cfg.d_model, cfg.head_dim, cfg.n_heads // tp, cfg.n_kv_heads // tp, cfg.ffn_hidden // tp


def segment_of(layout: Layout):
    """The decoder run's segment length k (None: not checkpointed): model/dense_decode.segment_length."""
    ck = layout.checkpointing
    if ck.decoder == "none":
        return None
    return 1 if ck.decoder == "step" else ck.decoder_k


def run_buffer_bytes(cfg: ModelConfig, layout: Layout, stage: int, grad: bool = True,
                     scratch: bool = False) -> dict[str, int]:
    """One micro-batch's slab by purpose, in bytes: DecoderRun.buffer_bytes() of the run the dense
    schedule (or a pipeline stage) builds for B = micro_batch_size rows of T = seq_len positions,
    from the list it allocates (model/run_buffers.py). scratch: {"scratch": the backward's part}."""
    n = len(stage_layers(cfg.n_layers, layout.pp, layout.pp_split)[stage])
    by_purpose, backward = _run_buffer_bytes(_shapes(cfg, layout), n, layout.micro_batch_size, layout.seq_len,
                                             layout.act_bytes, segment_of(layout), stage == 0, grad,
                                             run_buffers_module.WGRAD_ROWS)
    return {"scratch": backward} if scratch else dict(by_purpose)


@functools.lru_cache(maxsize=4096)  # the planner asks for the same shapes across its thousands of layouts
def _run_buffer_bytes(shapes: tuple, n: int, B: int, T: int, a: int, checkpoint, first: bool, grad: bool,
                      wgrad_rows: int) -> tuple:
    """-> (bytes by purpose, the backward's part): one list of buffers serves both.
    (wgrad_rows: part of the key only; run_buffers reads it, and tests change it)"""
    d, Dh, h, h_kv, F = shapes
    # the stream and compute dtypes are the run's activation dtype; statistics fp32
    roles = {"compute": a, "stream": a, "stat": 4}
    buffers = run_buffers(range(n), B, T, 1 + T, d, Dh, h, h_kv, F, grad=grad, with_input=first,
                          checkpoint=checkpoint)
    return (tuple(bytes_by_purpose(buffers, roles).items()),
            sum(bytes_by_purpose(buffers, roles, backward=True).values()))


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
