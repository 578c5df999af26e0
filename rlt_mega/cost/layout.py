"""What the cost model needs to know about a run besides the model: sequence length, batch
shape, parallel layout, ZeRO stage, activation checkpointing and precision.

``Layout.from_config`` reads it off a root :class:`~rlt_mega.config.Config` through the
trainer's own layout rules, so ``rlt-mega plan --config X`` accepts (and costs) exactly the
layouts ``rlt-mega pretrain --config X`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Optional

from rlt_mega.config import CheckpointingConfig, Config, _check

Dtype = Literal["fp32", "bf16"]
AttentionKernel = Literal["flash", "math"]


@dataclass
class ZeroBuckets:
    """DeepSpeed knobs that size ZeRO's communication buffers (elements), at DeepSpeed's
    defaults. They matter: a 5e8-element bf16 reduce bucket is 1 GB per rank (the trainer caps
    the reduce and all-gather buckets at the rank's trained elements: parallel/zero.py)."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False  # stage 1/2: a second reduce bucket when true
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000


@dataclass
class Layout:
    """One training step's shape and parallel layout.

    ``micro_batch_size`` (B) sequences per micro-batch; ``micro_batches`` (M) micro-batches in
    flight at once (the pipeline ring keeps all M alive until the backward); ``grad_accum``
    repeats of that per optimizer step. Sequences per step = dp * grad_accum * M * B.
    """

    seq_len: int
    micro_batch_size: int = 1
    micro_batches: int = 1
    grad_accum: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    # fp32: everything fp32. bf16: bf16 weights, gradients and activations with fp32 master
    # weights and Adam moments in the optimizer (DeepSpeed/Megatron mixed precision).
    dtype: Dtype = "fp32"
    pp_split: Optional[tuple[int, ...]] = None
    # flash: fused kernel that skips masked tiles and recomputes scores in backward (GPU);
    # math: the plain matmul-softmax-matmul composition (what flop_counter sees on CPU).
    attention_kernel: AttentionKernel = "flash"
    # The trainer holds the fp32 logits (B, T, V) through the backward (``logits = model(x)``
    # kept in a variable); the engine's ``lm_loss`` does not: only the loss's log-softmax stays.
    keep_logits: bool = False
    # CUDA's fused RMSNorm saves its input and rstd only; on CPU torch decomposes it and the
    # normalised x is saved as well.
    fused_rms_norm: bool = True
    # foreach AdamW (the CUDA default) takes sqrt(v) of all parameters at once; the for-loop
    # implementation (the CPU default) one tensor at a time.
    foreach_optimizer: bool = True
    # The fused decoder on CPU keeps oneDNN's reordered forward and backward copy of each large
    # weight (model/kernels.py, Gemm); on CUDA the products read the weights themselves.
    onednn_weights: bool = False
    rollout_batch: int = 0  # sequences in one sampling batch (0: micro_batch_size)
    rollout_len: int = 0  # prompt + completion positions (0: seq_len)
    buckets: ZeroBuckets = field(default_factory=ZeroBuckets)

    def __post_init__(self) -> None:
        if isinstance(self.checkpointing, dict):
            self.checkpointing = CheckpointingConfig(**self.checkpointing)
        if self.pp_split is not None:
            self.pp_split = tuple(self.pp_split)
        _check(self.seq_len >= 1, f"seq_len={self.seq_len}: must be >= 1")
        for name in ("micro_batch_size", "micro_batches", "grad_accum", "tp", "pp", "dp"):
            _check(getattr(self, name) >= 1, f"{name}={getattr(self, name)}: must be >= 1")
        _check(self.zero_stage in (0, 1, 2, 3), f"zero_stage={self.zero_stage}: must be 0, 1, 2 or 3")
        _check(self.dtype in ("fp32", "bf16"), f"dtype={self.dtype!r}: must be 'fp32' or 'bf16'")
        _check(self.attention_kernel in ("flash", "math"),
               f"attention_kernel={self.attention_kernel!r}: must be 'flash' or 'math'")
        _check(self.rollout_batch >= 0 and self.rollout_len >= 0, "rollout_batch, rollout_len must be >= 0")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def act_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def sequences_per_step(self) -> int:
        return self.dp * self.grad_accum * self.micro_batches * self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.seq_len

    def replace(self, **changes) -> "Layout":
        return replace(self, **changes)

    @classmethod
    def from_config(cls, cfg: Config, world_size: Optional[int] = None, **changes) -> "Layout":
        """The layout a run of ``cfg`` on ``world_size`` ranks would use, checked by the trainer's
        own rules (parallel.dims.resolve_layout: the same function, the same messages). Without
        ``world_size``: the world parallel.dp implies (tp * pp * dp; dp 1 when null)."""
        from rlt_mega.parallel.dims import micro_batch_plan, resolve_layout

        par = cfg.parallel
        if world_size is None:
            world_size = par.tp * par.pp * (par.dp if par.dp is not None else 1)
        tp, pp, dp = resolve_layout(par, cfg.model, world_size, cfg.train)
        # The trainer's grouping (micro_batch_plan): a step is grad_accum batches of
        # micro_batch_size rows; with pp > 1 they run in rounds of M in flight, cut into
        # M / grad_accum pieces when M > grad_accum.
        B, G, M = cfg.train.micro_batch_size, cfg.train.grad_accum, par.micro_batches
        if pp > 1:
            pieces, rounds = micro_batch_plan(B, G, M)
            B, G = B // pieces, rounds
        else:
            M = 1
        layout = cls(seq_len=cfg.data.seq_len, micro_batch_size=B, micro_batches=M, grad_accum=G,
                     tp=tp, pp=pp, dp=dp, zero_stage=par.zero_stage,
                     checkpointing=cfg.train.checkpointing, dtype=cfg.train.dtype,
                     pp_split=tuple(par.pp_split) if par.pp_split else None)
        return layout.replace(**changes) if changes else layout
