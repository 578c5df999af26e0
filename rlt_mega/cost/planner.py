"""Which (tp, pp, dp, ZeRO, checkpointing, micro-batch) layouts fit a cluster, ranked by an
estimated step time, with the reasons.

The step-time model is a roofline with stated, configurable assumptions (``Hardware``):

- Large matmuls (the encoder, the memory K/V projections, the head: B T rows) run at
  ``mfu`` x peak FLOP/s.
- A decoder position is B rows through every layer of a stage: its time is the larger of
  compute (at ``mfu``) and reading the stage's weights plus the attended K/V from HBM (at
  ``hbm_eff`` x bandwidth); the backward reads the weights again and reads and writes the
  gradient accumulators. That is the roofline of a CUDA-graphed decoder step. Eager PyTorch
  also pays a CPU cost per operator (about 50 per decoder layer and position forward, 120
  backward, counted with a dispatch mode on this model): with ``launch_us`` > 0 a position
  takes at least that long; ``explain`` always reports that floor.
- Tensor-parallel all-reduces and pipeline sends cost latency + bytes / bandwidth, on
  NVLink when the group fits in a node, else on the per-GPU network share; nothing overlaps
  with compute (pessimistic for DP, realistic for the decoder's dependent steps).
- The decoder ring takes ``ring_ticks`` ticks per pass, the encoder pipeline M + P - 1.
- The optimizer step streams ~30 bytes per locally-updated parameter through HBM.

Layouts: tp divides the GPUs of a node (and the head counts and ffn), pp divides L,
dp = world / (tp pp); ZeRO-3 only without PP and ZeRO-2/3 only with dp > 1 (docs/engines.md: the
combinations we support); all micro-batches in flight when pp > 1 (the ring holds them all until
the backward), else gradient accumulation; the engine's loss keeps no logits for the backward (Layout.keep_logits).

Rows per decoder step: a decoder tick runs B rows (the micro-batch) through the stage's weights,
so its arithmetic intensity is about 2B / (bytes per weight) FLOP per weight byte, against a
ridge of ~185 on an H100/H200 in bf16: at a few rows the decoder reads its weights for almost no
work. So the micro-batch B is searched in powers of two up to ``MAX_ROWS``, beyond the
per-replica share of ``global_batch`` when that is smaller: the sequences per step then grow
(up to ``max_global_batch``) and the memory limit is what stops B. Layouts are ranked by
tokens/s (with a fixed batch: by step time); ``rows_curve`` gives the predicted MFU against
rows per step for a layout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from rlt_mega.config import CheckpointingConfig, ConfigError, ModelConfig
from rlt_mega.cost.comm import comm_per_step, ring_ticks
from rlt_mega.cost.flops import flop_rows
from rlt_mega.cost.layout import Layout
from rlt_mega.cost.memory import estimate_memory
from rlt_mega.parallel.dims import check_tp
from rlt_mega.cost.params import rank_param_counts, stage_layers

DECODER_OPS_FORWARD = 50  # aten operators per decoder layer and position (forward)
DECODER_OPS_BACKWARD = 120
MAX_ROWS = 1024  # the largest micro-batch (rows per decoder step) the planner tries


@dataclass
class Hardware:
    """A GPU cluster. Defaults: H100 SXM 80 GB nodes of 8 with NVLink and 400 Gb/s per GPU."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    usable_fraction: float = 0.9  # CUDA context, NCCL buffers, allocator fragmentation
    peak_tflops_bf16: float = 989.0
    peak_tflops_fp32: float = 67.0  # without TF32
    mfu: float = 0.5  # achieved fraction of peak on large matmuls
    hbm_gbps: float = 3350.0
    hbm_eff: float = 0.8
    intra_gbps: float = 360.0  # achieved all-reduce bus bandwidth inside a node
    inter_gbps: float = 40.0  # achieved per-GPU network bandwidth between nodes
    intra_latency_us: float = 10.0
    inter_latency_us: float = 25.0
    launch_us: float = 0.0  # CPU cost per eager operator charged to the step (0: CUDA graphs)
    eager_launch_us: float = 4.0  # only for the eager floor that ``explain`` reports
    # measured / predicted time of a decoder tick on this GPU (tools/gpu/calibrate.py's JSON,
    # ``load_calibration``): multiplies the roofline's decoder tick (1: the roofline as is)
    decoder_efficiency: float = 1.0

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if not 0 < self.usable_fraction <= 1 or not 0 < self.mfu <= 1 or not 0 < self.hbm_eff <= 1:
            raise ConfigError("usable_fraction, mfu and hbm_eff must be in (0, 1]")
        if not self.decoder_efficiency > 0:
            raise ConfigError(f"decoder_efficiency={self.decoder_efficiency}: a measured/predicted time ratio, > 0")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def capacity_bytes(self) -> float:
        return self.gpu_mem_gb * 1e9 * self.usable_fraction

    def link(self, span: int) -> tuple[float, float]:
        """(latency s, bandwidth B/s) of a group spanning ``span`` consecutive ranks."""
        if span <= self.gpus_per_node:
            return self.intra_latency_us * 1e-6, self.intra_gbps * 1e9
        return self.inter_latency_us * 1e-6, self.inter_gbps * 1e9


@dataclass
class LayoutEstimate:
    layout: Layout
    step_time: float
    peak_memory: float
    breakdown: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0

    def describe(self) -> str:
        lay, ck = self.layout, self.layout.checkpointing
        ckpt = ck.decoder + (f"({ck.decoder_k})" if ck.decoder == "every_k" else "") + (
            "+enc" if ck.encoder else "") + (f"+head({ck.head_chunk})" if ck.head_chunk else "")
        return (f"tp={lay.tp} pp={lay.pp} dp={lay.dp} zero={lay.zero_stage} ckpt={ckpt} "
                f"B={lay.micro_batch_size} M={lay.micro_batches} accum={lay.grad_accum}")


def _stages_to_check(pp: int) -> list[int]:
    return sorted({0, pp - 1, min(1, pp - 1)})


def step_time(cfg: ModelConfig, layout: Layout, hw: Hardware) -> dict[str, float]:
    """Seconds of one optimizer step by component (see the module docstring)."""
    T, B, M, P = layout.seq_len, layout.micro_batch_size, layout.micro_batches, layout.pp
    a = layout.act_bytes
    w = 4 if layout.dtype == "fp32" else 2
    peak = (hw.peak_tflops_fp32 if layout.dtype == "fp32" else hw.peak_tflops_bf16) * 1e12
    flop_rate, mem_rate = peak * hw.mfu, hw.hbm_gbps * 1e9 * hw.hbm_eff
    tp_lat, tp_bw = hw.link(layout.tp)
    pp_lat, pp_bw = hw.link(layout.tp * layout.pp)
    dp_lat, dp_bw = hw.link(layout.world_size)
    ck = layout.checkpointing
    kv = cfg.n_kv_heads * cfg.head_dim / layout.tp
    d = cfg.d_model

    worst: dict[str, float] = {}
    for s in _stages_to_check(P):
        n = len(stage_layers(cfg.n_layers, P, layout.pp_split)[s])
        rows = {(r.part, r.component): r for r in flop_rows(
            cfg, T, ck, layout.attention_kernel, layers=n, tp=layout.tp,
            first_stage=s == 0, last_stage=s == P - 1)}
        dec = [r for (part, comp), r in rows.items() if part == "decoder" and comp != "memory_kv_proj"]
        # --- decoder: one tick = B rows of one position through the stage's n layers
        counts = rank_param_counts(cfg, layout.tp, P, s, layout.pp_split)
        dec_weights = (counts["blocks"] if cfg.share_weights else counts["decoder_blocks"]) + counts["cross"]
        kv_read = n * B * 2 * kv * a * (T + 1)  # self K/V (mean (T+1)/2) + visible memory K/V
        fwd_gpu = max(sum(r.forward for r in dec) * B / T / flop_rate, (dec_weights * w + kv_read) / mem_rate)
        bwd_gpu = max(sum(r.backward for r in dec) * B / T / flop_rate,
                      (3 * dec_weights * w + 3 * kv_read) / mem_rate)
        tp_ar = 3 * n * (tp_lat + 2 * (layout.tp - 1) / layout.tp * B * d * a / tp_bw) if layout.tp > 1 else 0.0
        hop = (pp_lat + B * d * a / pp_bw) if P > 1 else 0.0
        eff = hw.decoder_efficiency  # (measured on a GPU: calibrate.py)
        fwd_tick = max(fwd_gpu * eff + tp_ar + hop, n * DECODER_OPS_FORWARD * hw.launch_us * 1e-6)
        bwd_tick = max(bwd_gpu * eff + tp_ar + hop, n * DECODER_OPS_BACKWARD * hw.launch_us * 1e-6)
        ticks = ring_ticks(T, M, P)
        decoder = ticks * (fwd_tick + bwd_tick + (fwd_tick if ck.decoder != "none" else 0.0))
        # --- encoder, memory K/V, head: B T rows per micro-batch, compute bound
        big = [r for (part, comp), r in rows.items() if not (part == "decoder" and comp != "memory_kv_proj")]
        mb_flops = sum(r.total for r in big) * B
        enc_tp = (2 * n * (3 if ck.encoder else 2) + n) * (
            tp_lat + 2 * (layout.tp - 1) / layout.tp * B * T * d * a / tp_bw) if layout.tp > 1 else 0.0
        enc_hop = 4 * (pp_lat + B * T * d * a / pp_bw) if P > 1 else 0.0
        encoder = (M + P - 1) * (mb_flops / flop_rate + enc_tp + enc_hop)
        # --- once per step: data-parallel communication, optimizer
        comm = comm_per_step(cfg, layout, s)["dp"]
        dp_time = comm["bytes"] / dp_bw + comm["messages"] * dp_lat if layout.dp > 1 else 0.0
        psi = counts["total"]
        local = psi if layout.zero_stage == 0 else psi / layout.dp
        optimizer = 30 * local / mem_rate
        parts = {"decoder": layout.grad_accum * decoder, "encoder_head": layout.grad_accum * encoder,
                 "data_parallel": dp_time, "optimizer": optimizer}
        parts["total"] = sum(parts.values())
        # what bounds a tick: the larger of compute and HBM (named by the larger of its two
        # reads: the weights, or the attended K/V), or the TP all-reduces' latency, or launches
        compute = sum(r.forward for r in dec) * B / T / flop_rate * eff
        weights_t, kv_t = dec_weights * w / mem_rate * eff, kv_read / mem_rate * eff
        launches = n * DECODER_OPS_FORWARD * hw.launch_us * 1e-6
        bound = max((compute, "compute"), (weights_t + kv_t, "weight reads" if weights_t >= kv_t else "K/V reads"),
                    (tp_ar, "TP latency"), (launches, "launches"))[1]
        if parts["total"] > worst.get("total", -1.0):
            worst = parts | {"decoder_bound": bound, "decoder_tick_fwd": fwd_tick, "decoder_tick_bwd": bwd_tick,
                             "decoder_tick_gpu": fwd_gpu, "decoder_tp_allreduce": tp_ar,
                             "decoder_launch": n * DECODER_OPS_FORWARD * hw.launch_us * 1e-6,
                             "ticks": ticks}
    return worst


def load_calibration(path: str) -> float:
    """The measured decoder efficiency of tools/gpu/calibrate.py's JSON: the median over its rows
    of measured / predicted decoder tick time (forward and backward)."""
    import json
    import statistics

    with open(path) as f:
        data = json.load(f)
    ratios = [r[k] for r in data.get("rows", []) for k in ("ratio_fwd", "ratio_bwd") if k in r]
    if not ratios or not all(x > 0 for x in ratios):
        raise ConfigError(f"{path}: no positive measured/predicted ratios (rows[].ratio_fwd, ratio_bwd): "
                          "write it with tools/gpu/calibrate.py --out")
    return statistics.median(ratios)


def peak_memory(cfg: ModelConfig, layout: Layout) -> float:
    return max(estimate_memory(cfg, layout, s).peak for s in _stages_to_check(layout.pp))


def _peak_within(cfg: ModelConfig, layout: Layout, capacity: float) -> Optional[float]:
    """``peak_memory`` when it is at most ``capacity``, else None: the stages one at a time (the
    last first, whose logits most often set the peak), stopping at the first over ``capacity``.
    Most candidates do not fit: this skips about half of the planner's memory estimates."""
    peak = 0.0
    for s in sorted(_stages_to_check(layout.pp), key=lambda s: s != layout.pp - 1):
        peak = max(peak, estimate_memory(cfg, layout, s).peak)
        if peak > capacity:
            return None
    return peak


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _shapes(pp: int, per_replica: int, B: int) -> list[tuple[int, int]]:
    """(micro-batches in flight M, accumulation) for B rows per micro-batch: the per-replica
    batch when B divides it, else (B above it) the smallest step of B rows that fills the
    pipeline (M = 1, or M = pp)."""
    if B <= per_replica:
        if per_replica % B:
            return []
        num_micro = per_replica // B
        if pp == 1:
            return [(1, num_micro)]
        return [(m, num_micro // m) for m in _divisors(num_micro) if m >= min(pp, num_micro)]
    return [(1, 1)] if pp == 1 else sorted({(1, 1), (pp, 1)})


def candidate_layouts(cfg: ModelConfig, hw: Hardware, seq_len: int, global_batch: int,
                      dtype: str = "bf16", max_global_batch: Optional[int] = None,
                      head_chunk: int = 0) -> list[Layout]:
    """Every layout of the enumeration in the module docstring: sequences per step from
    ``global_batch`` up to ``max_global_batch`` (default: exactly ``global_batch``); the head
    chunked by ``head_chunk`` positions (train.checkpointing.head_chunk) in every one."""
    world = hw.world_size
    most = max_global_batch or global_batch
    if most < global_batch:
        raise ConfigError(f"--max-global-batch {most} is below --global-batch {global_batch}: raise it "
                          "(or leave it out to keep the batch fixed)")
    k = 2 ** round(math.log2(max(1.0, math.sqrt(seq_len))))
    ckpts = [CheckpointingConfig(decoder=dm, decoder_k=k, encoder=enc, head_chunk=head_chunk)
             for dm in ("none", "every_k", "step") for enc in (False, True)]
    out = []
    for tp in _divisors(hw.gpus_per_node):
        try:
            check_tp(cfg, tp)
        except ConfigError:
            continue
        for pp in _divisors(cfg.n_layers):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            for zero in (0, 1, 2, 3):
                if (zero == 3 and pp > 1) or (zero > 0 and dp == 1):
                    continue
                for B in (2 ** i for i in range(int(math.log2(MAX_ROWS)) + 1)):
                    for M, accum in _shapes(pp, per_replica, B):
                        if dp * M * accum * B > most:
                            continue
                        for ck in ckpts:
                            out.append(Layout(seq_len=seq_len, micro_batch_size=B, micro_batches=M,
                                              grad_accum=accum, tp=tp, pp=pp, dp=dp, zero_stage=zero,
                                              checkpointing=ck, dtype=dtype))
    return out


def evaluate(cfg: ModelConfig, lay: Layout, hw: Hardware, mem: Optional[float] = None) -> LayoutEstimate:
    """The plan of one layout: its step time by component, peak memory (``mem`` when known),
    tokens/s and MFU."""
    mem = peak_memory(cfg, lay) if mem is None else mem
    parts = step_time(cfg, lay, hw)
    flops = sum(r.forward + r.backward for r in flop_rows(cfg, lay.seq_len, None, "flash")) * lay.sequences_per_step
    peak = (hw.peak_tflops_fp32 if lay.dtype == "fp32" else hw.peak_tflops_bf16) * 1e12
    return LayoutEstimate(lay, parts["total"], mem, parts, lay.tokens_per_step / parts["total"],
                flops / parts["total"] / (peak * hw.world_size))


def plan_layouts(cfg: ModelConfig, hw: Hardware, seq_len: int, global_batch: int,
                 dtype: str = "bf16", top: Optional[int] = None,
                 max_global_batch: Optional[int] = None, head_chunk: int = 0) -> tuple[list[LayoutEstimate], int]:
    """Layouts that fit, highest tokens/s first (ties: less memory), and the number of
    candidates considered."""
    candidates = candidate_layouts(cfg, hw, seq_len, global_batch, dtype, max_global_batch, head_chunk)
    plans = []
    for lay in candidates:
        mem = _peak_within(cfg, lay, hw.capacity_bytes)
        if mem is not None:
            plans.append(evaluate(cfg, lay, hw, mem))
    plans.sort(key=lambda p: (-p.tokens_per_s, p.peak_memory))
    return (plans[:top] if top else plans), len(candidates)


def rows_curve(plans: list[LayoutEstimate]) -> list[dict]:
    """Predicted MFU against rows per decoder step: for each micro-batch B among the layouts
    that fit (``plans``), the best of them. Where the list ends is the memory limit."""
    best: dict[int, LayoutEstimate] = {}
    for p in plans:
        B = p.layout.micro_batch_size
        if B not in best or p.tokens_per_s > best[B].tokens_per_s:
            best[B] = p
    return [{"rows": B, "mfu": p.mfu, "tokens_per_s": p.tokens_per_s, "peak_gb": p.peak_memory / 1e9,
             "sequences_per_step": p.layout.sequences_per_step, "layout": p.describe()}
            for B, p in sorted(best.items())]


def format_rows_curve(curve: list[dict]) -> str:
    lines = ["Rows per decoder step (the micro-batch B): the best layout that fits at each, predicted MFU",
             "     B    MFU     tokens/s  seq/step  peak GB  layout"]
    for r in curve:
        lines.append(f"  {r['rows']:>4} {r['mfu']:6.2%} {r['tokens_per_s']:>12,.0f} {r['sequences_per_step']:>9} "
                     f"{r['peak_gb']:8.1f}  {r['layout']}")
    if curve:
        lines.append(f"  (B = {2 * curve[-1]['rows']} fits no layout: the memory limit)")
    return "\n".join(lines)


def explain(plans: list[LayoutEstimate], cfg: ModelConfig, hw: Hardware) -> str:
    """Why the first plan: its time budget, and the best plan of each other kind."""
    if not plans:
        return ("No layout fits: even the most sharded layout with full checkpointing exceeds "
                f"{hw.gpu_mem_gb:g} GB x {hw.usable_fraction:.0%}. Use more nodes, a shorter "
                "sequence or a smaller global batch.")
    best = plans[0]
    b = best.breakdown
    lines = [f"Assumptions: {hw.mfu:.0%} of {hw.peak_tflops_bf16:g} (bf16) / {hw.peak_tflops_fp32:g} (fp32) "
             f"TFLOP/s on large matmuls; HBM {hw.hbm_eff:.0%} of {hw.hbm_gbps:g} GB/s; collectives "
             f"{hw.intra_gbps:g} GB/s + {hw.intra_latency_us:g} us in a node, {hw.inter_gbps:g} GB/s + "
             f"{hw.inter_latency_us:g} us across; no overlap; {hw.usable_fraction:.0%} of memory usable.",
             f"Best: {best.describe()}: {b['total']:.2f} s/step, {best.tokens_per_s:,.0f} tokens/s, "
             f"MFU {best.mfu:.1%}, peak {best.peak_memory / 1e9:.1f} GB of "
             f"{hw.capacity_bytes / 1e9:.1f} GB usable.",
             f"  time: decoder {b['decoder']:.2f} s ({b['ticks']:,} ring ticks x "
             f"{b['decoder_tick_fwd'] * 1e3:.2f} ms fwd / {b['decoder_tick_bwd'] * 1e3:.2f} ms bwd), "
             f"encoder+head {b['encoder_head']:.2f} s, data-parallel {b['data_parallel']:.2f} s, "
             f"optimizer {b['optimizer']:.3f} s."]
    gpu, launch, ar = b["decoder_tick_gpu"], b["decoder_launch"], b["decoder_tp_allreduce"]
    bound = ("CPU launch bound (eager operators; CUDA graphs would help most)" if launch > gpu + ar
             else "HBM/compute bound in its matmuls" if gpu >= ar else "tensor-parallel latency bound")
    lines.append(f"  a decoder position is {bound}: GPU {gpu * 1e3:.3f} ms, TP all-reduces "
                 f"{ar * 1e3:.3f} ms, launches {launch * 1e3:.3f} ms per stage.")
    n_stage = len(stage_layers(cfg.n_layers, best.layout.pp, best.layout.pp_split)[0])
    eager = n_stage * (DECODER_OPS_FORWARD + DECODER_OPS_BACKWARD) * hw.eager_launch_us * 1e-6
    if eager > b["decoder_tick_fwd"] + b["decoder_tick_bwd"] and hw.launch_us == 0:
        lines.append(f"  eager PyTorch would not reach this: {DECODER_OPS_FORWARD}+{DECODER_OPS_BACKWARD} "
                     f"operators per layer and position at {hw.eager_launch_us:g} us cost "
                     f"{eager * 1e3:.2f} ms per tick (fwd+bwd) against {(b['decoder_tick_fwd'] + b['decoder_tick_bwd']) * 1e3:.2f} ms "
                     f"of GPU work: capture the decoder step in a CUDA graph (or pass --launch-us).")
    lay = best.layout
    w = 4 if lay.dtype == "fp32" else 2
    peak = (hw.peak_tflops_fp32 if lay.dtype == "fp32" else hw.peak_tflops_bf16) * 1e12
    ridge = peak * hw.mfu / (hw.hbm_gbps * 1e9 * hw.hbm_eff)
    intensity = 2 * lay.micro_batch_size / w  # FLOP per weight byte of a decoder matmul
    lines.append(f"  B={lay.micro_batch_size} rows per position: {intensity:g} FLOP per weight byte against a "
                 f"ridge of {ridge:.0f}: " + ("weight-bandwidth bound, so more rows are nearly free and "
                                              "tensor parallelism (which splits the weights) pays"
                                              if intensity < ridge else "compute bound"))
    for label, differs in (("tensor parallel", lambda p: p.layout.tp != lay.tp),
                           ("pipeline", lambda p: p.layout.pp != lay.pp),
                           ("ZeRO stage", lambda p: p.layout.zero_stage != lay.zero_stage),
                           ("checkpointing", lambda p: (p.layout.checkpointing.decoder, p.layout.checkpointing.encoder)
                            != (lay.checkpointing.decoder, lay.checkpointing.encoder)),
                           ("micro-batch", lambda p: p.layout.micro_batch_size != lay.micro_batch_size)):
        alt = next((p for p in plans if differs(p)), None)
        if alt is None:
            lines.append(f"  no other {label} choice fits.")
            continue
        ratio = alt.step_time / best.step_time
        if ratio < 1.005:
            lines.append(f"  best other {label}: {alt.describe()}: the same time, peak "
                         f"{alt.peak_memory / 1e9:.1f} GB (ties go to less memory).")
            continue
        why = max(("decoder", "encoder_head", "data_parallel", "optimizer"),
                  key=lambda k: alt.breakdown[k] - b[k])
        lines.append(f"  best other {label}: {alt.describe()}: {ratio:.2f}x the time "
                     f"(+{alt.breakdown[why] - b[why]:.2f} s in {why}), peak {alt.peak_memory / 1e9:.1f} GB.")
    return "\n".join(lines)


def estimate_to_dict(p: LayoutEstimate) -> dict:
    lay = asdict(p.layout)
    return {"layout": lay, "describe": p.describe(), "step_time_s": p.step_time,
            "peak_memory_bytes": p.peak_memory, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu,
            "breakdown": p.breakdown}
