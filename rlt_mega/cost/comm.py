"""Communication of one optimizer step, per rank and per process group, and the pipeline
bubble of the decoder ring.

Volumes are bytes a rank sends. A ring all-reduce of S bytes over n ranks sends
2 (n-1)/n S per rank; a reduce-scatter or an all-gather (n-1)/n S. ``messages`` counts
collectives (or point-to-point sends) on the critical path: the decoder issues its tensor-
parallel all-reduces and pipeline sends once per position, so at long T they are many and
small, and latency, not bandwidth, prices them.

Tensor parallel (Megatron): per block a forward all-reduce after each row-parallel layer (o,
down; the decoder also after the cross o) and a backward all-reduce of the input gradient of
each column-parallel group (q/k/v, gate/up; cross q); the memory K/V projections take the
replicated memory, so their input gradient is all-reduced once per layer; vocab-parallel
embedding (forward) and lm_head (backward, plus three (B, T) fp32 reductions of the
cross-entropy). Recomputation repeats the forward all-reduces. A checkpointed RLT encoder
block keeps 1/tp of its input on each rank: three all-gathers of it per block (forward,
recompute, input gradient).

Pipeline: the encoder activations cross each stage boundary once per micro-batch (gradients
back); the memory m goes from the last stage to every stage (its gradient returns); the
decoder state crosses every boundary at every position, and the ring closes from the last
stage to stage 0 (z_t -> position t + 1).

Data parallel: ZeRO-0 all-reduces gradients; ZeRO-1/2 reduce-scatter gradients and
all-gather updated parameters; ZeRO-3 all-gathers parameters for the forward and again for
the backward of every micro-batch (per decoder position when the stage exceeds
stage3_max_live_parameters, since every position reuses every layer) and reduce-scatters
gradients.
"""

from __future__ import annotations

from rlt_mega.config import ModelConfig
from rlt_mega.cost.layout import Layout
from rlt_mega.cost.params import rank_param_counts, stage_layers


def ring_ticks(seq_len: int, micro_batches: int, stages: int) -> int:
    """Ticks of the decoder ring for M micro-batches of T positions over P stages: with
    M >= P stage s works on micro-batch (k - s) mod M at tick k and the ring is full after
    P - 1 ticks (M T + P - 1 in all); with M < P a micro-batch returns to stage 0 only every
    P ticks, so stages idle (P T + M - 1)."""
    M, P, T = micro_batches, stages, seq_len
    return T * max(M, P) + min(M, P) - 1


def bubble_fraction(seq_len: int, micro_batches: int, stages: int) -> float:
    """Idle fraction of a stage in the decoder ring: 1 - M T / ticks, which is
    (P - 1) / (M T + P - 1) for M >= P (docs/design.md, "Parallel layout")."""
    return 1.0 - micro_batches * seq_len / ring_ticks(seq_len, micro_batches, stages)


def encoder_bubble_fraction(micro_batches: int, stages: int) -> float:
    """GPipe fill and drain of the encoder pass over M micro-batches: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def _allreduce(n: int, size: float) -> float:
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def _gather(n: int, size: float) -> float:
    return (n - 1) / n * size if n > 1 else 0.0


def _tp_per_micro(cfg: ModelConfig, layout: Layout, n: int, first: bool, last: bool) -> tuple[float, int]:
    """Tensor-parallel all-reduce bytes and messages of one rank per micro-batch (n layers)."""
    if layout.tp == 1:
        return 0.0, 0
    tp, a, ck = layout.tp, layout.act_bytes, layout.checkpointing
    B, T, d = layout.micro_batch_size, layout.seq_len, cfg.d_model
    enc_ar = 2 * n * (2 + (1 if ck.encoder else 0))  # fwd 2, bwd 2, recompute 2 per block
    dec_ar = 3 * n * T * (2 + (1 if ck.decoder != "none" else 0))
    # a checkpointed RLT encoder block keeps 1/tp of its input (parallel/tp.py CheckpointShards):
    # all-gathered in the forward, in the recompute, and its input gradient in the backward
    enc_ag = 3 * n if ck.encoder and cfg.arch == "rlt" else 0
    tp_bytes = (enc_ar * _allreduce(tp, B * T * d * a) + dec_ar * _allreduce(tp, B * d * a)
                + n * _allreduce(tp, B * (T + 1) * d * a) + enc_ag * _gather(tp, B * T * d * a))
    tp_msgs = enc_ar + dec_ar + n + enc_ag
    if first:
        tp_bytes += _allreduce(tp, B * T * d * a)
        tp_msgs += 1
    if last:
        tp_bytes += _allreduce(tp, B * T * d * a) + 3 * _allreduce(tp, B * T * 4)
        tp_msgs += 4
    return tp_bytes, tp_msgs


def _pp_per_micro(cfg: ModelConfig, layout: Layout, first: bool, last: bool) -> tuple[float, int]:
    """Pipeline bytes and messages this rank sends per micro-batch."""
    pp = layout.pp
    if pp == 1:
        return 0.0, 0
    B, T, d = layout.micro_batch_size, layout.seq_len, cfg.d_model
    act = B * T * d * layout.act_bytes
    pp_bytes = act * ((not last) + (not first))  # encoder forward, backward
    pp_bytes += act * (pp - 1 if last else 1)  # memory broadcast (last) / its gradient
    pp_bytes += 2 * T * B * d * layout.act_bytes  # decoder state forward (ring) and its gradient
    return pp_bytes, (not last) + (not first) + (pp - 1 if last else 1) + 2 * T


def _dp_per_step(cfg: ModelConfig, layout: Layout, stage: int, micro: int, first: bool,
                 last: bool) -> tuple[float, int]:
    """Data-parallel bytes and messages of one rank per optimizer step (ZeRO stage aware)."""
    dp, w = layout.dp, 4 if layout.dtype == "fp32" else 2
    counts = rank_param_counts(cfg, layout.tp, layout.pp, stage, layout.pp_split)
    psi = counts["total"]
    dp_bytes, dp_msgs = 0.0, 0
    if dp > 1:
        if layout.zero_stage == 0:
            dp_bytes, dp_msgs = _allreduce(dp, psi * w), 1
        elif layout.zero_stage in (1, 2):
            dp_bytes, dp_msgs = 2 * _gather(dp, psi * w), 2
        else:
            regather = psi > layout.buckets.stage3_max_live_parameters
            gathers = (1 + (layout.seq_len if regather else 1)) * 2  # forward and backward, per micro-batch
            dp_bytes = micro * (gathers * _gather(dp, psi * w) + _gather(dp, psi * w))
            dp_msgs = micro * (gathers + 1)
    # Tied embeddings with P > 1: the lm_head copy's gradient is all-reduced with embed's.
    if layout.pp > 1 and cfg.tie_embeddings and (first or last):
        dp_bytes += _allreduce(2, (counts["embed"] + counts["lm_head"]) * w)
        dp_msgs += 1
    return dp_bytes, dp_msgs


def comm_per_step(cfg: ModelConfig, layout: Layout, stage: int) -> dict[str, dict[str, float]]:
    """Bytes sent and messages per optimizer step by one rank of ``stage``, by group."""
    n = len(stage_layers(cfg.n_layers, layout.pp, layout.pp_split)[stage])
    first, last = stage == 0, stage == layout.pp - 1
    micro = layout.micro_batches * layout.grad_accum  # micro-batches per optimizer step
    tp_bytes, tp_msgs = _tp_per_micro(cfg, layout, n, first, last)
    pp_bytes, pp_msgs = _pp_per_micro(cfg, layout, first, last)
    dp_bytes, dp_msgs = _dp_per_step(cfg, layout, stage, micro, first, last)
    return {
        "tp": {"bytes": micro * tp_bytes, "messages": micro * tp_msgs, "group_size": layout.tp},
        "pp": {"bytes": micro * pp_bytes, "messages": micro * pp_msgs, "group_size": layout.pp},
        "dp": {"bytes": dp_bytes, "messages": dp_msgs, "group_size": layout.dp},
    }
