"""DeepSpeed ZeRO (stages 0-3) over the data-parallel group only.

DeepSpeed receives the stage's module, a torch AdamW (no JIT-compiled ops), and our ``mpu``
(dims.py), so ZeRO partitions over the data-parallel group and sums gradient norms over the
tp x pp group. What we adjust, and why:

* **Global-norm clipping across every group.** DeepSpeed counts a parameter in the norm when it
  is tensor-parallel (``tensor_model_parallel``/``model_parallel`` attribute) or when the rank's
  *tensor*-parallel rank is 0 (ZeRO, bf16 optimizer), or -- the plain fp32 path -- when the
  rank's *model*-parallel (tp x pp) rank is 0, which drops the replicated parameters (norms,
  biases) of every pipeline stage but the first. Pipeline replicas (a tied lm_head on the last
  stage, ``null_memory`` on stages > 0) must not be counted twice. :func:`mark_for_grad_norm`
  sets the attributes so that every formula counts each gradient exactly once; the tests
  compare the gradient norm with a single-process reference.
* The plain fp32 path (stage 0, no bf16) does not expose the norm it computes, so we call
  DeepSpeed's own ``clip_grad_norm_`` (same function, same mpu) and keep its result; DeepSpeed's
  ``gradient_clipping`` is then 0 on that path only, so clipping happens once.
* Gradient dtypes under bf16 (:func:`deepspeed_config`): fp32 accumulation over the step's
  micro-batches and an fp32 data-parallel reduction, by default (parallel.grad_accum_dtype,
  parallel.grad_reduce_dtype).
* ZeRO's reduce and all-gather buckets (:func:`bucket_elements`) hold at most the rank's trained
  elements: DeepSpeed allocates its 5e8-element reduce bucket whole at every backward, 2 GB in
  fp32 for a model of any size (measured on the CPU: 2 GB mapped and touched per step and rank,
  16 million page faults in a 6-step test). A bucket that holds every trained element groups
  the reduction exactly as the default does for a rank with fewer than 5e8 of them.
* ``deepspeed_shm_comm`` is switched off before ``init_distributed`` (it would JIT-compile a
  CPU op and is not needed: torch.distributed carries the collectives).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Optional

import torch
from torch import nn

from rlt_mega.config import OptimConfig, ParallelConfig
from rlt_mega.log import get_logger
from rlt_mega.parallel.dims import ParallelDims

log = get_logger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups, both engines': weight decay on matrices only (not on norms, biases,
    embeddings, null_memory, z_init); on the last pipeline stage a tied ``lm_head.weight`` is the
    embedding's copy and must be treated like it, or the two copies would drift apart (on one
    process it is the embedding's own parameter, listed once)."""
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = "embed" in name or (tied and name == "lm_head.weight")
        (decay if p.dim() >= 2 and not is_embedding else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def pipeline_replicas(model: nn.Module, dims: ParallelDims) -> dict[str, object]:
    """Parameters that exist on more than one pipeline stage: name -> the process group over
    which their gradients are summed. The copy on the first stage is the owner (counted in the
    gradient norm); the others are replicas. Frozen parameters (the base under model.lora)
    have no gradient to sum."""
    out = {}
    if dims.pp == 1:
        return out
    names = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if "null_memory" in names:
        out["null_memory"] = dims.pp_group
    tied = getattr(model.cfg, "tie_embeddings", False)
    if tied and (dims.is_first_stage or dims.is_last_stage):
        name = "embed.weight" if dims.is_first_stage else "lm_head.weight"
        if name in names:
            out[name] = dims.embed_group
    return out


def mark_for_grad_norm(model: nn.Module, dims: ParallelDims) -> None:
    """Sets DeepSpeed's attributes so each gradient is counted once in the global norm."""
    replicas = pipeline_replicas(model, dims)
    for name, p in model.named_parameters():
        owner_copy = dims.is_first_stage
        if name in replicas and not owner_copy:
            p.ds_pipe_replicated = True  # skipped by ZeRO and the bf16 optimizer
            if getattr(p, "tensor_model_parallel", False):
                p.tensor_model_parallel = False  # and by the fp32 path (whose mp rank is not 0 here)
            continue
        tp_sharded = getattr(p, "tensor_model_parallel", False)
        if not tp_sharded and dims.tp_rank == 0 and dims.pp_rank > 0:
            # A replicated parameter of a later stage: counted once, on its TP rank 0. The ZeRO
            # formula already does so (tp_rank == 0); this makes the fp32 path (mp_rank == 0) agree.
            p.model_parallel = True


def sync_pipeline_replicas(grads: dict[nn.Parameter, torch.Tensor], model: nn.Module, dims: ParallelDims) -> None:
    """Sums the gradients of pipeline-replicated parameters over their groups (in place)."""
    names = dict(model.named_parameters())
    for name, group in pipeline_replicas(model, dims).items():
        g = grads[names[name]]
        torch.distributed.all_reduce(g, group=group)


def grad_accum_dtype(parallel: ParallelConfig, bf16: bool) -> str:
    """The dtype gradients accumulate in (config.py, parallel.grad_accum_dtype): fp32 wherever
    DeepSpeed can; bf16 only when asked, or by default under bf16 without ZeRO (DeepSpeed 0.19
    has no fp32 accumulation for bf16 parameters without ZeRO: "unsupported mix")."""
    if not bf16:
        return "fp32"
    if parallel.grad_accum_dtype is not None:
        return parallel.grad_accum_dtype
    return "fp32" if parallel.zero_stage > 0 else "bf16"


DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's default reduce and all-gather bucket (elements)


def bucket_elements(trained: int) -> int:
    """ZeRO's reduce and all-gather bucket (elements) for a rank training ``trained`` elements:
    DeepSpeed's default, or all the rank's trained elements when fewer (rounded up to even:
    the all-gather bucket's alignment)."""
    return min(DEEPSPEED_BUCKET, max(2, trained + trained % 2))


def deepspeed_config(optim: OptimConfig, zero_stage: int, bf16: bool, micro_batch_size: int,
                     grad_accum_steps: int, accum_dtype: str = "fp32", reduce_dtype: str = "fp32",
                     trained: int = DEEPSPEED_BUCKET) -> dict:
    """What DeepSpeed 0.19.8 does with the dtypes (runtime/engine.py, _do_optimizer_sanity_check
    and _configure_zero_optimizer): bf16 parameters with ``data_types.grad_accum_dtype`` fp32 get
    the BF16_Optimizer under ZeRO-1 (fp32 gradient accumulators beside the bf16 .grad) and the
    ZeRO optimizer's separate fp32 accumulation under ZeRO-2/3; bf16 accumulation without ZeRO
    is DeepSpeed's bf16 DDP path. ``communication_data_type`` is the dtype of the data-parallel
    reduction (DeepSpeed's default under bf16 would be bf16). ``trained``: the rank's trained
    elements, which size ZeRO's buckets (:func:`bucket_elements`)."""
    plain_fp32 = zero_stage == 0 and not bf16
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        # Set explicitly: DeepSpeed's default is 1.0. The plain fp32 path clips in zero.py.
        "gradient_clipping": 0.0 if plain_fp32 else float(optim.grad_clip),
        # immediate_grad_update: the BF16_Optimizer adds each parameter's bf16 gradient to its
        # fp32 accumulator in the gradient hook and frees it. Without it, two backwards with no
        # engine forward between them (the pipeline's hand-over, grads.py) add the first
        # backward's gradient twice (measured, DeepSpeed 0.19.8: 1, 2, 4 accumulate to 11).
        "bf16": {"enabled": bool(bf16), "immediate_grad_update": True},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["data_types"] = {"grad_accum_dtype": accum_dtype}
        cfg["communication_data_type"] = reduce_dtype
    if zero_stage > 0:
        bucket = bucket_elements(trained)
        cfg["zero_optimization"] = {"stage": zero_stage, "overlap_comm": False,
                                    "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    return cfg


def init_deepspeed(model: nn.Module, dims: ParallelDims, optim: OptimConfig, zero_stage: int, bf16: bool,
                   micro_batch_size: int, grad_accum_steps: int, accum_dtype: str = "fp32",
                   reduce_dtype: str = "fp32"):
    """Wraps ``model`` in a DeepSpeed engine with a torch AdamW; returns the engine."""
    if dims.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no accelerator probing (and its warning) per rank
    import deepspeed

    deepspeed.utils.logger.setLevel(max(logging.WARNING, log.getEffectiveLevel()))  # its INFO lines are per rank
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # before init_distributed
    deepspeed.init_distributed(dist_backend=dims.backend)
    if bf16 and accum_dtype == "bf16":
        log.info("bf16 gradients accumulate in bf16 (parallel.grad_accum_dtype; fp32 needs ZeRO >= 1)")
    optimizer = torch.optim.AdamW(param_groups(model, optim.weight_decay), lr=optim.lr,
                                  betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=False)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = deepspeed_config(optim, zero_stage, bf16, micro_batch_size, grad_accum_steps, accum_dtype, reduce_dtype,
                              trained)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=dims.mpu())
    return engine


class ZeroStepper:
    """The optimizer step of a DeepSpeed engine: learning rate, clipping, global gradient norm."""

    def __init__(self, engine, dims: ParallelDims, optim: OptimConfig, zero_stage: int, bf16: bool) -> None:
        self.engine, self.dims, self.optim = engine, dims, optim
        self.plain_fp32 = zero_stage == 0 and not bf16

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def step(self, lr: Optional[float], skip: bool = False) -> tuple[float, bool]:
        """engine.step() at the accumulation boundary -> (global gradient norm before clipping,
        whether the update was applied). ``skip``: the step's loss was not finite. DeepSpeed's
        ZeRO and bf16 optimizers skip a step whose gradient norm is not finite by themselves;
        on the plain fp32 path we drop the gradients and let the step run empty (AdamW leaves
        parameters without gradients untouched), which keeps DeepSpeed's micro-step count."""
        if lr is not None:
            self.set_lr(lr)
        if self.plain_fp32:
            from deepspeed.runtime.utils import clip_grad_norm_

            params = [p for p in self.engine.module.parameters() if p.grad is not None]
            max_norm = self.optim.grad_clip if self.optim.grad_clip > 0 else math.inf
            norm = float(clip_grad_norm_(params, max_norm, mpu=self.dims.mpu()))
            if skip or not math.isfinite(norm):
                self.engine.zero_grad()
                self.engine.step()
                return norm, False
            self.engine.step()
            return norm, True
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return norm, bool(self.engine.was_step_applied()) and not skip


class DeepSpeedCopy:
    """train.bf16_cast under DeepSpeed: the bf16 copy its optimizers make of their fp32 masters
    after each step (round to nearest, a plain ``copy_``), remade by precision.bf16_copy when
    the cast is stochastic, and the copy's lag measured (precision.CopyLag) under either cast.

    Where each of DeepSpeed 0.19.8's bf16 optimizers keeps the pair (master, copy):
    * FP16_UnfusedOptimizer (bf16 without ZeRO): ``fp32_groups`` / ``fp16_groups``, whole
      parameters on every rank (its step: ``fp16_param.data.copy_(fp32_param.data)``);
    * BF16_Optimizer (ZeRO-1, fp32 accumulation): this rank's partition of each flat group,
      ``fp32_groups_flat_partition[i]`` / ``bf16_partitioned_groups[i][partition]``, then an
      all-gather of the bf16 partitions (``update_lp_params``);
    * DeepSpeedZeroOptimizer (ZeRO-1/2): ``single_partition_of_fp32_groups[i]`` /
      ``parallel_partitioned_bit16_groups[i][partition]``, then the same all-gather;
    * DeepSpeedZeroOptimizer_Stage3: ``fp32_partitioned_groups_flat[i]`` /
      ``fp16_partitioned_groups_flat[i]``, the parameters' partitions (gathered at each use).
    The stochastic copy is a function of (master, train.seed, step) alone (precision.py), so the
    partitions and replicas of one weight agree without any exchange beyond DeepSpeed's own
    all-gather. The metrics' sums run over every rank's pairs: a weight that several ranks hold
    whole (every weight under data parallelism without ZeRO, the norms under tensor
    parallelism) counts once per holder, which weights the fractions, not their meaning."""

    def __init__(self, ds, dims, cast: str, seed: int) -> None:
        self.ds, self.dims, self.cast, self.seed = ds, dims, cast, seed
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _partition(self, i: int) -> int:
        import deepspeed.comm as ds_dist

        return ds_dist.get_rank(group=self.ds.optimizer.real_dp_process_group[i])

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (fp32 master, bf16 copy) tensors, in a fixed order."""
        opt = self.ds.optimizer
        if hasattr(opt, "bf16_partitioned_groups"):  # BF16_Optimizer
            return [(m, opt.bf16_partitioned_groups[i][self._partition(i)])
                    for i, m in enumerate(opt.fp32_groups_flat_partition)]
        if hasattr(opt, "parallel_partitioned_bit16_groups"):  # ZeRO-1/2
            return [(m, opt.parallel_partitioned_bit16_groups[i][self._partition(i)])
                    for i, m in enumerate(opt.single_partition_of_fp32_groups)]
        if hasattr(opt, "fp16_partitioned_groups_flat"):  # ZeRO-3
            return list(zip(opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat))
        if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):  # FP16_UnfusedOptimizer
            return [(m, p.data) for g32, g16 in zip(opt.fp32_groups, opt.fp16_groups) for m, p in zip(g32, g16)]
        raise TypeError(f"train.dtype=bf16: no fp32 masters found in DeepSpeed's {type(opt).__name__}")

    @torch.no_grad()
    def remake(self, step: int) -> None:
        """The copy := precision.bf16_copy of the masters at optimizer step ``step`` (stochastic
        only: DeepSpeed's own copy is the nearest one), then DeepSpeed's all-gather of the
        partitions where it partitions (collective over the data-parallel group)."""
        if self.cast != "stochastic":
            return
        from rlt_mega.precision import bf16_copy, cast_key

        key = cast_key(self.seed, step)
        for master, copy in self.pairs():
            copy.copy_(bf16_copy(master.detach().view(copy.shape), self.cast, key))
        opt = self.ds.optimizer
        flat = getattr(opt, "bf16_groups_flat", None) or getattr(opt, "bit16_groups_flat", None)
        if flat is not None:
            from deepspeed.runtime.utils import all_gather_dp_groups

            parts = getattr(opt, "bf16_partitioned_groups", None) or opt.parallel_partitioned_bit16_groups
            all_gather_dp_groups(groups_flat=flat, partitioned_param_groups=parts,
                                 dp_process_group=opt.real_dp_process_group,
                                 start_alignment_factor=opt.nccl_start_alignment_factor,
                                 allgather_bucket_size=opt.allgather_bucket_size)
        elif hasattr(opt, "_unflatten_partitioned_parameters"):  # ZeRO-3: the parameters' partitions
            for i in range(len(opt.fp16_partitioned_groups_flat)):
                opt._unflatten_partitioned_parameters(i)
            if opt.persistent_parameters:  # those kept whole (the small ones) are gathered again from
                from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # their partitions

                for p in opt.persistent_parameters:  # (all_gather skips a parameter marked available)
                    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
                opt.persistent_parameters[0].all_gather(opt.persistent_parameters)

    def before_step(self) -> None:
        self._before = [(m.detach().clone(), c.detach().clone()) for m, c in self.pairs()]

    @torch.no_grad()
    def after_step(self, applied: bool, step: int) -> dict[str, float]:
        """After DeepSpeed's step: the copy of step ``step`` (the count of applied steps) and the
        step's precision metrics over every rank (collective); {} when no update was applied."""
        from rlt_mega.precision import CopyLag

        before, self._before = self._before, []
        if not applied:
            return {}
        self.remake(step)
        lag = CopyLag()
        for (m0, c0), (m, c) in zip(before, self.pairs()):
            lag.add(m0, m.detach(), c0, c.detach())
        return CopyLag.metrics(self.dims.all_reduce(lag.tensor(self.dims.device), axis="world").cpu())
