"""The distributed engine: tensor parallel + decoder-ring pipeline + ZeRO, behind the interface
of the local engine (engine.py), so the trainers drive either::

    dims = ParallelDims.build(cfg.parallel, cfg.model, cfg.train.device, cfg.train)
    engine = build_engine(cfg, dims)
    engine.train_step(micro_batches) -> StepStats;  engine.eval_loss(micro_batches) -> float
    engine.save(dir) / engine.load(dir);  engine.layout();  engine.data_parallel_size()

``micro_batches`` is this data-parallel rank's share of one optimizer step: ``train.grad_accum``
dicts ``{"inputs": (b, T), "targets": (b, T)}`` (targets -100 where there is none); every rank
of a data-parallel replica (its TP and PP ranks) passes the same ones. They run in rounds of
``parallel.micro_batches`` pipeline micro-batches in flight (dims.micro_batch_plan).

Two paths:
* ``pp == 1``: the dense schedule (``model.forward``), one DeepSpeed forward/backward per
  pipeline micro-batch (DeepSpeed's gradient accumulation); ZeRO 0-3.
* ``pp > 1``: the ring schedule over the stages; gradients accumulate on shadow parameters
  (grads.py) and reach DeepSpeed in one backward per step; ZeRO 0-2.

Loss normalisation: the loss is the sum of token losses divided by the global count of loss
tokens of the step (all micro-batches, all data-parallel ranks); DeepSpeed averages gradients
over data-parallel ranks, so the backward weighs each token by ``dp / global_count``.

bf16 here is DeepSpeed's: bf16 parameters and activations, fp32 master weights and optimizer
state, fp32 gradient accumulation and data-parallel reduction (parallel.grad_accum_dtype and
grad_reduce_dtype; zero.py says what DeepSpeed does with them; without ZeRO DeepSpeed can only
accumulate in bf16). The local engine uses autocast over fp32 parameters.
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from rlt_mega import determinism
from rlt_mega.checkpoint import CheckpointError
from rlt_mega.config import Config, ConfigError
from rlt_mega.log import get_logger
from rlt_mega.model.rlt import RLT, build_model
from rlt_mega.parallel.dims import ParallelDims, micro_batch_plan
from rlt_mega.parallel.engine import CountFn, LogitsLoss, LossFn, StepStats, lm_count, lm_loss, lr_lambda
from rlt_mega.parallel.gather import gather_tp
from rlt_mega.parallel.build import build_stage
from rlt_mega.parallel.grads import ShadowGrads, deposit_grads, handover_pieces
from rlt_mega.parallel.p2p import P2P
from rlt_mega.parallel.pipeline import RingSchedule
from rlt_mega.parallel.stage import RLTStage, prune_to_stage
from rlt_mega.parallel.tp import IGNORE_INDEX, apply_tensor_parallel, gather_vocab, gather_vocab_grad, token_losses
from rlt_mega.parallel import reshard
from rlt_mega.parallel.zero import (ZeroStepper, grad_accum_dtype, init_deepspeed, mark_for_grad_norm,
                                   sync_pipeline_replicas)

log = get_logger(__name__)

DS_TAG = "deepspeed"  # sub-directory of a checkpoint with DeepSpeed's per-rank files


def requested(cfg: Config) -> bool:
    """A run needs the distributed engine when a launcher started several processes or the
    config asks for tensor/pipeline parallelism or ZeRO."""
    p = cfg.parallel
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or p.tp > 1 or p.pp > 1 or p.zero_stage > 0


@contextmanager
def launch(cfg: Config) -> Iterator[Optional[ParallelDims]]:
    """The layout of a run (None when one process suffices): validated before any process group
    exists, so a layout that does not fit fails on every rank at once; the process groups are
    released when the run ends. The process's kernels are made deterministic first
    (train.deterministic, rlt_mega/determinism.py), before any CUDA or NCCL work."""
    determinism.configure(cfg.train.deterministic)
    if not requested(cfg):
        yield None
        return
    dims = ParallelDims.build(cfg.parallel, cfg.model, cfg.train.device, cfg.train)
    try:
        yield dims
    finally:
        dims.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def build_engine(cfg: Config, dims: ParallelDims, model_fn: Optional[Callable[[], RLT]] = None
                 ) -> "DistributedEngine":
    """Builds this rank's part of the model and wraps it. ``model_fn`` returns the model on the
    CPU: the full single-device one, or only this rank's stage and shard (default:
    ``build.build_stage`` with train.seed, which builds nothing else and starts equal to the
    single-process model with the same seed)."""
    model = model_fn() if model_fn is not None else build_stage(cfg.model, dims, cfg.train.seed)
    return DistributedEngine(cfg, dims, model)


def shard_for_rank(model: RLT, dims: ParallelDims) -> RLT:
    """The full single-device model (or, from an export, only this rank's stage) -> this rank's
    pipeline stage with its tensor-parallel shard, on the rank's device (in place)."""
    if dims.pp > 1:  # idempotent: a stage read from an export is pruned already
        prune_to_stage(model, dims.layers, dims.is_first_stage, dims.is_last_stage)
    apply_tensor_parallel(model, dims)
    return model.to(dims.device)


def build_frozen(cfg: Config, dims: ParallelDims, model: RLT) -> RLT:
    """A model in this rank's layout without an optimizer, no gradients (GRPO's reference), in
    the dtype the engine's module computes in (DeepSpeed bf16 keeps bf16 parameters)."""
    model = shard_for_rank(model, dims)
    if cfg.train.dtype == "bf16":
        model = model.to(torch.bfloat16)
    return model.requires_grad_(False).eval()


class DistributedEngine:
    def __init__(self, cfg: Config, dims: ParallelDims, model: RLT) -> None:
        self.cfg, self.dims = cfg, dims
        self.M = cfg.parallel.micro_batches
        self.bf16 = cfg.train.dtype == "bf16"
        self.full_cfg = model.cfg
        shard_for_rank(model, dims)
        model.set_checkpointing(cfg.train.checkpointing)
        mark_for_grad_norm(model, dims)
        mbs, accum = cfg.train.micro_batch_size, cfg.train.grad_accum
        self.pieces, _ = micro_batch_plan(mbs, accum, self.M)
        accum_dtype = grad_accum_dtype(cfg.parallel, self.bf16)
        # PP: the step's fp32 accumulators go to DeepSpeed in as many bf16 backwards as keep them
        # exact where DeepSpeed accumulates in fp32 (grads.py), in one otherwise.
        self.handover = handover_pieces(self.bf16, accum_dtype)
        if dims.pp > 1:  # the step's gradients reach DeepSpeed in `handover` backwards (grads.py)
            ds_micro, self.ds_accum = mbs * accum, self.handover
        else:  # one DeepSpeed backward per pipeline micro-batch
            ds_micro, self.ds_accum = mbs // self.pieces, accum * self.pieces
        self.engine = init_deepspeed(model, dims, cfg.optim, cfg.parallel.zero_stage, self.bf16, ds_micro,
                                     self.ds_accum, accum_dtype, cfg.parallel.grad_reduce_dtype)
        self.universal_info = reshard.universal_checkpoint_info(self.full_cfg)
        self.stepper = ZeroStepper(self.engine, dims, cfg.optim, cfg.parallel.zero_stage, self.bf16)
        self.lr_factor = lr_lambda(cfg.optim, cfg.train.steps)
        self.steps_taken = 0  # optimizer steps applied: the position in the learning-rate schedule
        self._sampling_copy: Optional[nn.Module] = None  # ZeRO-3 only (sampling_module)
        if dims.pp > 1:
            stage = RLTStage(self.engine.module, dims.layers, dims.is_first_stage, dims.is_last_stage, dims.tp,
                             gather_vocab=self._gather_vocab)
            self.ring = RingSchedule(stage, P2P.for_pipeline(dims), dims.pp_rank, dims.pp)

    # ------------------------------------------------------------------ helpers
    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def layout(self) -> dict:
        out = {"tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp, "zero_stage": self.cfg.parallel.zero_stage}
        if self.dims.pp > 1:  # layers per stage: which parameters each stage holds
            out["pp_split"] = [len(r) for r in self.dims.stage_layers]
        return out

    def data_parallel_size(self) -> int:
        return self.dims.dp

    def _loss_kind(self, loss_fn: LossFn) -> str:
        """"lm": the built-in token loss (micro-batches cut into pipeline pieces); "logits": an
        engine.LogitsLoss (any layout; micro-batches used as given); "custom": a loss_fn(model, mb)
        that needs the whole model on each rank, tp == pp == 1."""
        if loss_fn is lm_loss:
            return "lm"
        if isinstance(loss_fn, LogitsLoss):
            return "logits"
        if self.dims.tp > 1 or self.dims.pp > 1:
            raise NotImplementedError("a loss_fn(model, mb) needs the full logits on one rank; under tensor or "
                                      "pipeline parallelism write it as an engine.LogitsLoss (a function of the "
                                      "logits the engine computes), as the token cross-entropy and GRPO are")
        return "custom"

    def _pieces(self, micro_batches: list[dict], kind: str) -> list[tuple[torch.Tensor, object]]:
        """The step's micro-batches as pipeline micro-batches (inputs, targets or the whole dict).
        The token loss cuts each into ``pieces`` row blocks (dims.micro_batch_plan; fewer when it
        has fewer rows, e.g. the last eval batch); another loss gets its micro-batches whole (it
        alone knows how its rows go together), so the caller forms them."""
        dev = self.dims.device
        if kind == "lm":
            out = [(x.to(dev), y.to(dev)) for mb in micro_batches
                   for x, y in zip(mb["inputs"].chunk(self.pieces), mb["targets"].chunk(self.pieces))]
        else:
            out = [(mb["inputs"].to(dev), mb) for mb in micro_batches]
        if self.dims.pp == 1 and self.cfg.parallel.zero_stage == 3:
            out = self._same_length_over_dp(out)
        return out

    def _same_length_over_dp(self, pieces: list[tuple[torch.Tensor, object]]) -> list[tuple[torch.Tensor, object]]:
        """ZeRO-3 gathers a partitioned parameter with a collective over the data-parallel group at
        each submodule call, and the decoder calls its blocks once per position: every rank must
        run the same number of positions, so each piece is padded to the longest of its index
        over the data-parallel ranks (pad tokens after the end: causal, so no earlier position
        changes; their targets are ignored, and a LogitsLoss reads only its own positions)."""
        lengths = torch.tensor([x.shape[1] for x, _ in pieces], dtype=torch.long, device=self.dims.device)
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=self.dims.dp_group)
        return [(_pad_to(x, int(T), 0), y if not torch.is_tensor(y) else _pad_to(y, int(T), IGNORE_INDEX))
                for (x, y), T in zip(pieces, lengths.tolist())]

    def _rounds(self, micro_batches: list[dict], kind: str) -> list[list[tuple[torch.Tensor, object]]]:
        """Pipeline micro-batches grouped into rounds of parallel.micro_batches in flight; the ring
        runs one length per round, so a LogitsLoss's inputs are padded to the round's longest."""
        pieces = self._pieces(micro_batches, kind)
        rounds = [pieces[i:i + self.M] for i in range(0, len(pieces), self.M)]
        if kind == "logits":
            rounds = [[(_pad_to(x, max(x2.shape[1] for x2, _ in r), 0), mb) for x, mb in r] for r in rounds]
        return rounds

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_vocab_grad(logits, self.dims)

    def _global_count(self, micro_batches: list[dict], count_fn: CountFn) -> float:
        """Loss tokens of the step summed over data-parallel ranks."""
        count = torch.tensor(float(sum(count_fn(mb) for mb in micro_batches)), dtype=torch.float64,
                             device=self.dims.device)
        dist.all_reduce(count, group=self.dims.dp_group)
        return float(count)

    def _global_loss(self, loss_sum: Optional[torch.Tensor], count: float) -> float:
        """Sum of token losses (known on the last stage) -> the global mean, on every rank."""
        total = torch.zeros((), dtype=torch.float64, device=self.dims.device)
        if torch.is_tensor(loss_sum) and (self.dims.pp == 1 or self.dims.is_last_stage):
            total += loss_sum.to(torch.float64)
        dist.all_reduce(total, group=self.dims.dp_group)
        if self.dims.pp > 1:
            dist.all_reduce(total, group=self.dims.pp_group)
        return float(total) / max(count, 1.0)

    def _dense_loss(self, x: torch.Tensor, y, kind: str, loss_fn: LossFn) -> torch.Tensor:
        if kind == "lm":
            return token_losses(self.engine(x), y, self.dims.tp).sum()  # logits (b, T, V / tp) fp32
        if kind == "logits":
            return loss_fn.logits_loss(self.engine(x), y, self._gather_vocab)
        return loss_fn(self.engine, {**y, "inputs": x})

    def _all_finite(self, grads: dict) -> bool:
        """Every rank's accumulated gradients finite: one flag per tensor on the device, one
        reduction over the world, one host read."""
        flags = [torch.isfinite(g).all() for g in grads.values()]
        ok = (torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=self.dims.device))
        ok = ok.float().reshape(1)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    # ------------------------------------------------------------------ training
    def backward_step(self, micro_batches: list[dict], loss_fn: LossFn = lm_loss, count_fn: CountFn = lm_count
                      ) -> tuple[float, float, bool]:
        """Forward and backward over the step's micro-batches; afterwards the gradients are in
        DeepSpeed, reduced over the data-parallel group. Returns (mean loss, global token count,
        finite). With pp == 1 the accumulation window's last engine.step() is optimizer_step's."""
        kind = self._loss_kind(loss_fn)
        count = self._global_count(micro_batches, count_fn)
        scale = self.dims.dp / max(count, 1.0)  # per-token weight; DeepSpeed averages over dp
        loss_sum = None
        if self.dims.pp == 1:
            chunks = self._pieces(micro_batches, kind)
            if len(chunks) != self.ds_accum:
                raise ValueError(f"train_step got {len(micro_batches)} micro-batches ({len(chunks)} pieces); the "
                                 f"engine was built for train.grad_accum={self.cfg.train.grad_accum} x {self.pieces} "
                                 "pieces")
            for i, (x, y) in enumerate(chunks):
                part = self._dense_loss(x, y, kind, loss_fn)
                self.engine.backward(part * scale, scale_wrt_gas=False)
                loss_sum = part.detach() if loss_sum is None else loss_sum + part.detach()
                if i < len(chunks) - 1:
                    self.engine.step()  # inside the accumulation window: no update, counts the micro-step
            loss = self._global_loss(loss_sum, count)
            return loss, count, math.isfinite(loss)
        shadows = ShadowGrads(self.module)
        with shadows.active():
            for round_ in self._rounds(micro_batches, kind):
                part = self.ring.run(round_, scale, backward=True, objective=loss_fn if kind == "logits" else None)
                if part is not None:
                    loss_sum = part if loss_sum is None else loss_sum + part
        loss = self._global_loss(loss_sum, count)
        grads = shadows.grads()
        finite = math.isfinite(loss) and self._all_finite(grads)
        if finite:  # a non-finite step never reaches DeepSpeed: nothing to undo
            sync_pipeline_replicas(grads, self.module, self.dims)
            deposit_grads(self.engine, grads, self.handover)
        return loss, count, finite

    def train_step(self, micro_batches: list[dict], loss_fn: LossFn = lm_loss, count_fn: CountFn = lm_count
                   ) -> StepStats:
        self.module.train()
        loss, count, finite = self.backward_step(micro_batches, loss_fn, count_fn)
        lr = self.cfg.optim.lr * self.lr_factor(self.steps_taken)
        if self.dims.pp > 1 and not finite:
            return StepStats(loss=loss, grad_norm=float("nan"), lr=lr, num_tokens=int(count), skipped=True)
        grad_norm, applied = self.stepper.step(lr, skip=not finite)
        skipped = not (applied and math.isfinite(grad_norm))
        if not skipped:
            self.steps_taken += 1
        return StepStats(loss=loss, grad_norm=grad_norm, lr=lr, num_tokens=int(count), skipped=skipped)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[dict], loss_fn: LossFn = lm_loss, count_fn: CountFn = lm_count) -> float:
        """Mean token loss over the micro-batches of every data-parallel rank (no gradients)."""
        self.module.eval()
        kind = self._loss_kind(loss_fn)
        count = self._global_count(micro_batches, count_fn)
        loss_sum = None
        if self.dims.pp == 1:
            loss_sum = sum(self._dense_loss(x, y, kind, loss_fn) for x, y in self._pieces(micro_batches, kind))
        else:
            for round_ in self._rounds(micro_batches, kind):
                part = self.ring.run(round_, 1.0, backward=False, objective=loss_fn if kind == "logits" else None)
                if part is not None:
                    loss_sum = part if loss_sum is None else loss_sum + part
        return self._global_loss(loss_sum, count)

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (b, T, V) of the dense schedule on every rank; pp == 1 only."""
        if self.dims.pp != 1:
            raise NotImplementedError("logits() runs the dense schedule and needs parallel.pp == 1")
        return gather_vocab(self.engine(inputs.to(self.dims.device)), self.dims)

    # ------------------------------------------------------------------ the no-grad schedules
    def sampling_module(self) -> nn.Module:
        """The module that sampling, replay and evaluation run on: this rank's stage and TP shard
        with its whole parameters, current as of the last optimizer step.

        ZeRO 0-2: the engine's module itself. ZeRO-3 partitions every parameter over the
        data-parallel group and gathers it with a collective at each submodule call; replicas
        that sample different numbers of positions would then wait in different collectives. So
        under ZeRO-3 this is a plain copy (built once, outside DeepSpeed's hooks) refreshed from the
        partitions by one gather of every parameter: a collective over the data-parallel group,
        which every rank must call at the same point. Its memory is one more model shard per rank
        (what a hybrid engine pays to generate from a ZeRO-3 model)."""
        if self.cfg.parallel.zero_stage != 3:
            return self.module
        import deepspeed

        if self._sampling_copy is None:
            copy_ = shard_for_rank(build_stage(self.full_cfg, self.dims, seed=0), self.dims)  # values copied below
            # requires_grad stays as on the engine's parameters (no gradient is ever computed
            # here): some kernels (F.rms_norm) take another path for a weight without it, and
            # samples must not depend on the ZeRO stage.
            self._sampling_copy = copy_.to(next(self.module.parameters()).dtype)
        mine = dict(self._sampling_copy.named_parameters())
        params = list(self.module.named_parameters())
        with torch.no_grad(), deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            for name, p in params:
                mine[name].copy_(p)
        return self._sampling_copy

    # ------------------------------------------------------------------ inspection
    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter gradient after backward_step (complete over the
        data-parallel partitions, via DeepSpeed's safe_get_full_grad)."""
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, p in self.module.named_parameters():
            g = safe_get_full_grad(p) if self.cfg.parallel.zero_stage > 0 or self.bf16 else p.grad
            if g is not None:
                out[name] = g.detach().float().clone()
        return out

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter: the fp32 master weights where DeepSpeed keeps
        them (a collective over the data-parallel group under ZeRO-3: call on every rank)."""
        from deepspeed.utils import safe_get_full_fp32_param

        masters = self._unfused_masters()
        out = {}
        for name, p in self.module.named_parameters():
            if id(p) in masters:
                out[name] = masters[id(p)].detach().clone()
            elif self.cfg.parallel.zero_stage > 0 or self.bf16:
                out[name] = safe_get_full_fp32_param(p).detach().clone()
            else:
                out[name] = p.detach().clone()
        return out

    def _unfused_groups(self) -> Optional[tuple[list, list]]:
        """bf16 without ZeRO runs DeepSpeed's FP16_UnfusedOptimizer: full fp32 masters
        (``fp32_groups``) parallel to the model's parameters (``fp16_groups``), which
        safe_get_full_fp32_param does not see. None for every other optimizer."""
        opt = self.engine.optimizer
        if self.cfg.parallel.zero_stage > 0 or not (hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups")):
            return None
        return opt.fp16_groups, opt.fp32_groups

    def _unfused_masters(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its fp32 master under FP16_UnfusedOptimizer (empty otherwise)."""
        groups = self._unfused_groups()
        if groups is None:
            return {}
        return {id(p): m for g16, g32 in zip(*groups) for p, m in zip(g16, g32)}

    def master_group_names(self) -> Optional[list[list[str]]]:
        """The names of FP16_UnfusedOptimizer's master groups, in its order (saved with the
        checkpoint: its ``fp32_groups`` are lists without names); None for other optimizers."""
        groups = self._unfused_groups()
        if groups is None:
            return None
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in g16] for g16 in groups[0]]

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The single-device state dict (fp32, CPU) on global rank 0, None elsewhere. Collective:
        every rank calls it."""
        local = self.parameters_fp32()
        if self.dims.dp_rank != 0:
            return None
        full = gather_tp(local, self.dims)
        if self.dims.tp_rank != 0:
            return None
        return gather_pp_to_first({k: v.cpu() for k, v in full.items()}, self.dims)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What the DeepSpeed checkpoint does not hold: the learning-rate schedule position."""
        return {"steps_taken": self.steps_taken}

    def load_state_dict(self, state: dict) -> None:
        self.steps_taken = int(state["steps_taken"])

    def save(self, directory: Path) -> None:
        """Every rank writes its shards (DeepSpeed's engine checkpoint: module and ZeRO optimizer
        state, under ``deepspeed/``, with the ``universal_checkpoint_info`` its converter needs);
        rank 0 adds ``engine.pt`` and, with ``checkpoint.consolidate`` (the default), a
        consolidated ``model.safetensors`` (the single-device layout, fp32 masters), which the
        export and inspect tools read like a single-process checkpoint (without it they
        consolidate from the shards). The caller (CheckpointManager) makes the directory atomic."""
        directory = Path(directory)
        client = {"universal_checkpoint_info": self.universal_info, "rlt_master_groups": self.master_group_names()}
        self.engine.save_checkpoint(str(directory), tag=DS_TAG, client_state=client, save_latest=False)
        consolidate = self.cfg.checkpoint.consolidate
        full = self.full_state_dict() if consolidate else None
        if self.dims.rank == 0:
            torch.save(self.state_dict(), directory / "engine.pt")
            if consolidate:
                self._save_consolidated(full, directory / "model.safetensors")
        dist.barrier()

    def _save_consolidated(self, full: dict[str, torch.Tensor], file: Path) -> None:
        from safetensors.torch import save_model

        model = build_model(self.full_cfg, "meta")
        model.to_empty(device="cpu")
        if self.full_cfg.tie_embeddings:
            model.lm_head.weight = model.embed.weight  # to_empty unties; re-tie before loading
            full.setdefault("lm_head.weight", full["embed.weight"])
        model.load_state_dict(full, strict=True)
        save_model(model, str(file))

    def load(self, directory: Path) -> None:
        """Resumes from a checkpoint written by :meth:`save`: on the same layout bit for bit; on
        another data-parallel size (or ZeRO stage within 1-2) with its optimizer state
        re-partitioned (reshard.py); any other layout change is an error naming both layouts."""
        directory = Path(directory)
        saved = reshard.saved_layout(directory) or self.layout()
        plan = reshard.resume_plan(saved, self.layout(), directory)
        if not (directory / DS_TAG).is_dir():
            raise CheckpointError(f"checkpoint {directory} has no {DS_TAG}/ directory: it was not written by the "
                                  f"distributed engine; {reshard.weights_only_hint(directory)}")
        if plan == reshard.UNIVERSAL:
            self._load_universal(directory)
        else:
            self._load_deepspeed(directory, directory)
        self.load_state_dict(torch.load(directory / "engine.pt", weights_only=False))
        if plan != reshard.SAME:
            log.warning("resumed %s, written with layout %s, on %s: optimizer state %s", directory,
                        reshard.format_layout(saved), reshard.format_layout(self.layout()),
                        "re-partitioned through DeepSpeed's universal checkpoint" if plan == reshard.UNIVERSAL
                        else "replicated over data-parallel ranks, loaded as is")

    def _load_deepspeed(self, load_dir: Path, directory: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(str(load_dir), tag=DS_TAG, load_module_strict=True,
                                                   load_optimizer_states=True, load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load {directory / DS_TAG} on layout {self.layout()}")

    def _load_universal(self, directory: Path) -> None:
        """Rank 0 converts the checkpoint's ZeRO shards with DeepSpeed's ds_to_universal into a
        scratch directory under checkpoint.dir; every rank loads its new partition from it
        (DeepSpeed's ``load_universal``, switched on for this load only); the scratch goes."""
        scratch = reshard.scratch_dir(self.cfg.checkpoint.dir, directory)
        error: Optional[Exception] = None
        if self.dims.rank == 0:
            try:
                reshard.remove(scratch)
                scratch.mkdir(parents=True)
                reshard.to_universal(directory / DS_TAG, scratch / DS_TAG)
            except Exception as exc:  # reported on every rank below, raised here
                error = exc
        failed = torch.tensor([float(error is not None)], device=self.dims.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            if self.dims.rank == 0:
                reshard.remove(scratch)
                raise error
            raise CheckpointError(f"rank 0 could not convert {directory / DS_TAG} to a universal checkpoint "
                                  "(its log has the reason)")
        self.engine._config.load_universal_checkpoint = True  # DeepSpeed reads it only while loading
        try:
            self._load_deepspeed(scratch, directory)
        finally:
            self.engine._config.load_universal_checkpoint = False
            dist.barrier()
            if self.dims.rank == 0:
                reshard.remove(scratch)


def gather_pp_to_first(named: dict[str, torch.Tensor], dims: ParallelDims) -> Optional[dict[str, torch.Tensor]]:
    """Merges the stages' dictionaries onto stage 0 (None on the other stages); a pipeline
    replica keeps the first stage's copy."""
    if dims.pp == 1:
        return named
    parts = [None] * dims.pp if dims.is_first_stage else None
    dist.gather_object(named, parts, dst=dims.pp_ranks[0], group=dims.pp_group)
    if not dims.is_first_stage:
        return None
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def _pad_to(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """(b, T) -> (b, length), right-padded with ``value``."""
    if x.shape[1] == length:
        return x
    return torch.nn.functional.pad(x, (0, length - x.shape[1]), value=value)
