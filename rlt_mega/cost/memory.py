"""Memory of one rank during a training step, phase by phase, and of a sampling batch.

What is alive comes from reading what ``model/rlt.py`` and ``model/attention.py`` save for
backward (checked tensor by tensor with saved-tensor hooks, and against torch's MemTracker in
tests/unit/test_costmodel.py). Per position and layer, with a = activation bytes (4 fp32, 2 bf16),
q = H Dh / tp, kv = H_kv Dh / tp, F = ffn / tp, H = heads / tp:

  each RMSNorm     its input kept at 4 bytes (fp32: the residual itself; bf16: the fp32
                   upcast that ``pow`` saves), the fp32 rstd, the output at a bytes (saved by
                   the next matmul) and, unless fp32 uses the fused CUDA kernel, the
                   normalised x at a bytes
  encoder block    2 norms; q and k after RoPE, v (a (2q + 2kv)); the attention output and
                   its fp32 log-sum-exp (a q + 4 H); SwiGLU gate, silu, up, product (4 a F)
  decoder block    3 norms; q after RoPE (the custom attention saves only q), its output,
                   the cross query and the cross output + lse (4 a q + 4 H); SwiGLU (4 a F)
  decoder input    recur_norm (its input is z_{t-1})
  memory           memory_norm; the slots {null} + m (a d (T+1)/T); the memory K/V of every
                   layer (2 a kv (T+1)/T), which cross-attention saves as views
  head             final_norm; the fp32 logits (4 V/tp) when the trainer keeps them and the
                   fp32 log-softmax the loss saves (4 V/tp). Chunked (train.checkpointing.
                   head_chunk = c, loss.Logits): the head's input z alone (a d), and in the
                   backward one chunk's recomputed head at a time: c positions (at most B T) of
                   final_norm, logits, log-softmax and their gradients, beside the head weight's
                   gradient accumulated over the chunks before

Outside autograd: the DecoderKV buffers (2 a kv per layer and position) for the whole step.
In backward the DecoderKV gradient buffers (2 x 4 kv per layer and position, fp32), the
accumulated gradient of every layer's memory K/V (cross-attention reads a growing slice, so
autograd keeps a full-size accumulator) and the gradients of the embeddings and of z.

The autograd engine runs a leaf's AccumulateGrad only after all of its uses: every shared
block is used at every decoder step, so its full gradient exists from the first decoder step
of the backward until the end of the backward whatever the ZeRO stage. ZeRO-2/3 therefore
shrink gradient memory only after the backward; the peak sits in the decoder backward. The
DecoderKV object is referenced from the graph, so its buffers (and their gradients) live
until the trainer drops the loss, i.e. through the optimizer step.

model.arch dense / looped (model/baselines.py): R * L encoder-like block applications (R =
model.loops, 1 for dense), no decoder, no memory, no DecoderKV; checkpointing (any mode) keeps
each block application's input. The sampling caches are R * L self-attention K/V layers.

Checkpointing: the encoder keeps each block's input (an RLT's after the first, 1/tp of it per
tensor-parallel rank); the decoder keeps z at each segment boundary; the backward recomputes one encoder block or one decoder segment at a time.

The decoder step (model/decoder.py) keeps none of its per-position tensors in autograd: its run's
slab, its weight copies and its gradient accumulators are the decoder's items
(cost/fused_memory.py says what they hold and how long they live).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlt_mega.config import CheckpointingConfig, ModelConfig
from rlt_mega.parallel.zero import bucket_elements
from rlt_mega.cost.fused_memory import fused_weight_bytes, fused_weight_numels, run_buffer_bytes, run_scratch_bytes
from rlt_mega.cost.layout import Layout
from rlt_mega.cost.params import rank_adapter_numels, rank_param_counts, rank_tensor_numels, stage_layers


@dataclass
class MemoryReport:
    """Bytes on one rank of one pipeline stage. ``phases`` are the candidate peaks."""

    stage: int
    weights: float
    gradients: float  # after the backward (partitioned under ZeRO-2/3)
    master_weights: float
    optimizer_states: float
    zero_buffers: float
    rope_tables: float
    activations: dict[str, float] = field(default_factory=dict)  # per micro-batch, end of forward
    phases: dict[str, float] = field(default_factory=dict)
    rollout: dict[str, float] = field(default_factory=dict)
    optimizer_state_numel: int = 0  # Adam moments (both) on this rank, elements
    master_numel: int = 0

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def static(self) -> float:
        return (self.weights + self.master_weights + self.optimizer_states + self.zero_buffers
                + self.rope_tables)


def zero_partition_numel(numels: list[int], dp: int, stage: int) -> int:
    """Elements of one rank's ZeRO partition as DeepSpeed 0.19 sizes it: stages 1/2 flatten a
    parameter group and pad it to a multiple of 2 * dp (``nccl_start_alignment_factor``);
    stage 3 pads every tensor to a multiple of dp. One parameter group is assumed."""
    if stage == 3:
        return sum(-(-n // dp) for n in numels)
    align = 2 * dp
    return -(-sum(numels) // align) * align // dp


def _norm(d: int, a: int, fused: bool, output_saved: bool = True) -> float:
    """Bytes per position one RMSNorm keeps (input, rstd, normalised x, output)."""
    normalised = 0 if (fused and a == 4) else a * d
    return 4 * d + 4 + normalised + (a * d if output_saved else 0)


def activation_per_token(cfg: ModelConfig, layout: Layout, stage: int,
                         checkpointing: CheckpointingConfig | None = None) -> dict[str, float]:
    """Bytes per position of one micro-batch saved at the end of the forward, by item
    (under ``checkpointing`` instead of the layout's when given)."""
    a, T, tp = layout.act_bytes, layout.seq_len, layout.tp
    d, Dh, fused = cfg.d_model, cfg.head_dim, layout.fused_rms_norm
    q, kv = cfg.n_heads * Dh / tp, cfg.n_kv_heads * Dh / tp
    f, h = cfg.ffn_hidden / tp, cfg.n_heads / tp
    n = len(stage_layers(cfg.n_layers, layout.pp, layout.pp_split)[stage])
    first, last = stage == 0, stage == layout.pp - 1
    ck = checkpointing or layout.checkpointing
    norm = _norm(d, a, fused)
    enc_block = 2 * norm + a * (2 * q + 2 * kv) + 4 * h + 4 * a * f
    if cfg.arch == "rlt":
        # the fused run's slab (K/V, memory K/V and their gradients included), per position
        # (its backward's scratch comes with the backward: estimate_memory)
        here = layout.replace(checkpointing=ck)
        slab = sum(run_buffer_bytes(cfg, here, stage).values()) - run_scratch_bytes(cfg, here, stage)
        return {  # a checkpointed block after the first keeps 1/tp of its input (parallel/tp.py)
            "encoder": a * d + (n - 1) * a * d / tp if ck.encoder else n * enc_block,
            "decoder": slab / (layout.micro_batch_size * T),
            # memory_norm (last stage) and the slots {null} + m that the K/V products save
            "memory": (_norm(d, a, fused, output_saved=False) if last else 0.0) + a * d * (T + 1) / T,
            "decoder_kv": 0.0,
            **_head_per_token(cfg, layout, ck, norm, last),
            "tokens": 8 * (first + last),
        }
    apps = cfg.loops * n  # dense / looped: block applications per token
    ckpt = ck.encoder or ck.decoder != "none"
    return {"encoder": apps * (a * d if ckpt else enc_block), **_head_per_token(cfg, layout, ck, norm, last),
            "tokens": 8 * (first + last)}


def _head_per_token(cfg: ModelConfig, layout: Layout, ck: CheckpointingConfig, norm: float, last: bool
                    ) -> dict[str, float]:
    """What the head saves per position to the end of the forward (the last stage): final_norm's and
    the fp32 logits' (the kept logits, the loss's log-softmax); chunked, z alone (the checkpoint's input)."""
    if not last:
        return {"head": 0.0, "logits": 0.0}
    if ck.head_chunk:
        return {"head": layout.act_bytes * cfg.d_model, "logits": 0.0}
    return {"head": norm, "logits": (4 * cfg.vocab_size / layout.tp) * ((1 if layout.keep_logits else 0) + 1)}


def recompute_per_token(cfg: ModelConfig, layout: Layout, stage: int) -> dict[str, float]:
    """Bytes per position that one recomputed piece materialises in the backward, expressed
    per position of the micro-batch (multiply by B T)."""
    ck = layout.checkpointing
    full = activation_per_token(cfg, layout, stage, CheckpointingConfig())
    n = len(stage_layers(cfg.n_layers, layout.pp, layout.pp_split)[stage])
    if cfg.arch != "rlt":
        ckpt = ck.encoder or ck.decoder != "none"
        return {"decoder": 0.0, "encoder": full["encoder"] / max(cfg.loops * n, 1) if ckpt else 0.0}
    # the decoder step recomputes into its preallocated slab (the decoder's own items)
    return {"decoder": 0.0, "encoder": full["encoder"] / max(n, 1) if ck.encoder else 0.0}


@dataclass
class _State:
    """One rank's training state outside the activations (bytes, and the numels they follow)."""
    counts: dict
    psi: int
    trained: int
    trained_numels: list
    part: int
    lora: bool
    weights: float
    master: float
    moments: float
    grads_after: float
    zero_buffers: float


def _training_state(cfg: ModelConfig, layout: Layout, stage: int) -> _State:
    """Weights, fp32 master copy, Adam moments, gradients after the backward and DeepSpeed's
    buffers of one rank of ``stage`` (ZeRO stage and LoRA aware)."""
    tp, pp, dp, zero = layout.tp, layout.pp, layout.dp, layout.zero_stage
    w = 4 if layout.dtype == "fp32" else 2
    counts = rank_param_counts(cfg, tp, pp, stage, layout.pp_split)
    psi = counts["total"]
    # What trains: every parameter, or (model.lora) only the adapters, the base frozen: the
    # gradients, the master copy and Adam's moments are the adapters', the weights both.
    adapter_numels = rank_adapter_numels(cfg, tp, pp, stage, layout.pp_split)
    trained_numels = adapter_numels or rank_tensor_numels(cfg, tp, pp, stage, layout.pp_split)
    trained = sum(trained_numels)
    part = trained if zero == 0 else zero_partition_numel(trained_numels, dp, zero)
    lora = bool(adapter_numels)
    buckets = layout.buckets

    # Weights, master copy, Adam moments, gradients after the backward.
    if zero == 3:
        # Resting partition + what is gathered for compute: the decoder reuses every layer at
        # every step, so the stage stays gathered when it fits max_live_parameters.
        # Under model.lora the frozen base rests partitioned beside the adapters as well.
        resting = zero_partition_numel(rank_tensor_numels(cfg, tp, pp, stage, layout.pp_split) + adapter_numels,
                                       dp, zero) if lora else part
        gathered = min(psi + (trained if lora else 0), buckets.stage3_max_live_parameters)
        weights = (resting + gathered) * w
    else:
        weights = -(-psi // (2 * dp)) * 2 * dp * w if zero in (1, 2) else psi * w
        weights += trained * w if lora else 0
    master = 0 if (zero == 0 and layout.dtype == "fp32") else 4 * part
    moments = 8 * part
    grads_after = trained * w if zero in (0, 1) else part * w
    # DeepSpeed's contiguous-gradient reduce bucket (allocated whole; the trainer sizes it to at
    # most the rank's trained elements, parallel/zero.bucket_elements) and, for ZeRO-3, the
    # parameter prefetch bucket.
    zero_buffers = 0.0
    if zero > 0:
        bucket = min(buckets.reduce_bucket_size, bucket_elements(trained))
        zero_buffers += bucket * w * (2 if buckets.overlap_comm and zero < 3 else 1)
    if zero == 3:
        zero_buffers += buckets.stage3_prefetch_bucket_size * w
    return _State(counts, psi, trained, trained_numels, part, lora, weights, master, moments, grads_after,
                  zero_buffers)


def _optimizer_step_extra(layout: Layout, trained: int, trained_numels: list, part: int, w: int) -> float:
    """What the optimizer step adds. ZeRO-0: the full gradients and foreach Adam's sqrt(v)
    temporary. ZeRO-1: DeepSpeed flattens this rank's partition of the (still full) gradients.
    ZeRO-2/3: the gradient partition, its flat fp32 copy and Adam's temporary on the partition."""
    zero = layout.zero_stage
    adam_temp = 4 * (trained if layout.foreach_optimizer else 2 * max(trained_numels))
    if zero == 0:
        step_extra = trained * w + adam_temp + (4 * trained if w != 4 else 0)
    elif zero == 1:
        step_extra = trained * w + part * w
    else:
        step_extra = part * w + 8 * part
    return step_extra


def _decoder_held(cfg: ModelConfig, layout: Layout, stage: int, act: dict, tok: int,
                  fused: bool) -> tuple[float, float, float, float]:
    """(retained per position, weight copies, accumulators, scratch per position) of the decoder.
    Retained: live until the loss is dropped. The fused decoder's slab (act["decoder"]) and its
    weight copies live until the loss is dropped; the accumulators through the decoder's backward
    (cost/fused_memory.py); the backward's scratch is freed at the end of the dense schedule's
    decoder backward, and a pipeline stage's runs keep theirs."""
    if not fused:
        return act["decoder_kv"], 0.0, 0.0, 0.0
    scratch = run_scratch_bytes(cfg, layout, stage) / tok
    copies = fused_weight_bytes(cfg, layout, stage)
    retained = act["decoder"] + (scratch if layout.pp > 1 else 0.0)
    return retained, copies["weights"], copies["accumulators"], scratch


def _head_working(cfg: ModelConfig, layout: Layout, head_params: int, chunk: int, tok: int, w: int) -> float:
    """What the last stage's head backward holds beside the saved activations: whole (chunk 0),
    the log-softmax's output, its gradient and the logits' gradient of every position; chunked,
    the last chunk recomputed (final_norm, logits, log-softmax) in its log-softmax backward,
    beside the head weight's gradient of the chunks before it."""
    V = cfg.vocab_size / layout.tp
    if not chunk:
        return tok * 2 * 4 * V
    head_grad = head_params * w if chunk < tok else 0.0
    return chunk * (_norm(cfg.d_model, layout.act_bytes, layout.fused_rms_norm) + 3 * 4 * V) + head_grad


def estimate_memory(cfg: ModelConfig, layout: Layout, stage: int) -> MemoryReport:
    """The memory of one rank of pipeline stage ``stage`` (see the module docstring)."""
    tp, pp = layout.tp, layout.pp
    a, B, T = layout.act_bytes, layout.micro_batch_size, layout.seq_len
    w = 4 if layout.dtype == "fp32" else 2
    st = _training_state(cfg, layout, stage)
    counts, psi, trained, trained_numels, part, lora = (st.counts, st.psi, st.trained, st.trained_numels, st.part,
                                                         st.lora)
    weights, master, moments, grads_after, zero_buffers = (st.weights, st.master, st.moments, st.grads_after,
                                                           st.zero_buffers)
    first, last = stage == 0, stage == pp - 1
    rope_tables = 2 * cfg.max_seq_len * cfg.head_dim * a  # cos/sin cached per device and dtype

    act = activation_per_token(cfg, layout, stage)
    rec = recompute_per_token(cfg, layout, stage)
    n = len(stage_layers(cfg.n_layers, pp, layout.pp_split)[stage])
    kv = cfg.n_kv_heads * cfg.head_dim / tp
    d, V = cfg.d_model, cfg.vocab_size / tp
    tok = B * T  # positions per micro-batch
    in_flight = layout.micro_batches if pp > 1 else 1
    saved = sum(act.values())
    baseline = cfg.arch != "rlt"
    act = {"decoder_kv": 0.0, **act}  # a baseline keeps no DecoderKV
    chunk = min(layout.checkpointing.head_chunk, tok)  # the chunked head's positions at a time (0: whole)
    logits_kept = 4 * V if (last and layout.keep_logits and not chunk) else 0.0
    logsoftmax = 4 * V if (last and not chunk) else 0.0
    fused = not baseline
    retained, held, accumulators, scratch = _decoder_held(cfg, layout, stage, act, tok, fused)  # (K/V grads: the slab's)
    embed_grad_params = counts["embed"] if not cfg.tie_embeddings else 0
    grads_in_backward = (psi - embed_grad_params) * w if not lora else trained * w  # shared weights: full, see docstring
    static = weights + master + moments + zero_buffers + rope_tables
    after_decoder = static + held  # every phase below comes after the decoder's forward
    # a pipeline stage makes its round's accumulators at the round's start and hands them to the
    # parameters at its end (parallel/stage.py): alive in every backward phase
    round_acc = accumulators if pp > 1 else 0.0

    phases = {}
    if last:
        phases["head_backward"] = (after_decoder + round_acc + in_flight * tok * saved
                                   + _head_working(cfg, layout, counts["lm_head"] or counts["embed"], chunk, tok, w))
    # the memory K/V gradients handed back (the fused run frees each layer's K/V gradients once
    # its copies are made: one layer's copies beside them at most), the embeddings' and z's
    mem_grads = (1 if fused else n) * 2 * a * kv * (T + 1) / T
    dec_extra = mem_grads + a * d * (first + last) + scratch
    dec_transient = 4 * a * kv * (T + 1) / T  # one layer's K/V gradients + a full-size slice grad
    if fused:
        # At the end of the fused Function's backward: no decoder parameter has a gradient yet
        # (the accumulators stand in for them); the head's have. Its own working buffers are in
        # the slab; the fold's backward then forms one weight-sized product at a time.
        tied = counts["embed"] if cfg.tie_embeddings else 0
        grads_in_backward = (counts["lm_head"] + counts["final_norm"] + tied) * w if not lora else 0.0
        numels = fused_weight_numels(cfg, layout, stage)  # (summed over the stage's layers)
        largest = max([numels[k] / max(n, 1) for k in numels if k != "recur"] + [numels["recur"]])
        dec_transient = 4 * largest / tok  # one weight's product at a time: the largest of one layer
    if not baseline:  # the baselines have no decoder
        phases["decoder_backward"] = (
            after_decoder + accumulators + grads_in_backward
            + in_flight * tok * (saved - act["head"] - logsoftmax + dec_extra)
            + tok * (rec["decoder"] + dec_transient))
    # One block's backward working set: the incoming gradient and, in the SwiGLU backward,
    # the gradients of the product, of silu and of up alive together while the product is gone.
    enc_transient = a * (2 * cfg.ffn_hidden / tp + d)
    # By now the memory's backward has run: its saved tensors are gone; the gradients of the
    # embeddings and of the encoder output are alive.
    phases["encoder_backward"] = (
        after_decoder + round_acc + trained * w
        + in_flight * tok * (act["encoder"] + act["tokens"] + logits_kept + retained + 2 * a * d)
        + tok * (rec["encoder"] + enc_transient))
    # The optimizer step. ZeRO-0: the full gradients and foreach Adam's sqrt(v) temporary.
    # ZeRO-1: DeepSpeed flattens this rank's partition of the (still full) gradients. ZeRO-2/3:
    # the gradient partition, its flat fp32 copy and Adam's temporary on the partition.
    step_extra = _optimizer_step_extra(layout, trained, trained_numels, part, w)
    phases["optimizer_step"] = after_decoder + step_extra + in_flight * tok * (retained + logits_kept)

    rollout = rollout_memory(cfg, layout, stage)
    rollout["total"] = static + rollout["kv_caches"]  # GRPO is colocated: training state stays
    return MemoryReport(stage=stage, weights=weights, gradients=grads_after, master_weights=master,
                        optimizer_states=moments, zero_buffers=zero_buffers, rope_tables=rope_tables,
                        activations={k: v * tok for k, v in act.items()}, phases=phases, rollout=rollout,
                        optimizer_state_numel=2 * part, master_numel=part if master else 0)


def rollout_memory(cfg: ModelConfig, layout: Layout, stage: int) -> dict[str, float]:
    """K/V caches of one sampling batch (no autograd): encoder and decoder self-attention
    caches and the memory K/V buffer (null slot + every position), per rank."""
    a = layout.act_bytes
    Bs = layout.rollout_batch or layout.micro_batch_size
    Tr = layout.rollout_len or layout.seq_len
    n = len(stage_layers(cfg.n_layers, layout.pp, layout.pp_split)[stage])
    kv = cfg.n_kv_heads * cfg.head_dim / layout.tp
    per_layer = 2 * a * kv * Bs
    if cfg.arch != "rlt":  # one self-attention cache per (loop, layer)
        caches = {"kv": cfg.loops * n * per_layer * Tr}
        caches["kv_caches"] = caches["kv"]
        caches["batch"], caches["positions"] = Bs, Tr
        return caches
    caches = {"encoder_kv": n * per_layer * Tr, "decoder_kv": n * per_layer * Tr,
              "memory_kv": n * per_layer * (1 + Tr)}
    caches["kv_caches"] = sum(caches.values())
    caches["batch"], caches["positions"] = Bs, Tr
    return caches
