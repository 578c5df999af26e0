"""The distributed training engine: tensor parallel + decoder-ring pipeline + ZeRO, behind a
narrow interface the trainers call::

    dims = ParallelDims.build(cfg.parallel, cfg.model, cfg.train.device, cfg.train.micro_batch_size)
    engine = build_engine(cfg, dims)
    metrics = engine.train_step(micro_batches, lr)    # {"loss", "grad_norm", "tokens", "lr"}
    engine.eval_loss(micro_batches); engine.save(path, client_state); engine.load(path)

``micro_batches`` is this data-parallel rank's batch for one optimizer step: a list of
``train.grad_accum`` pairs ``(inputs (b, T), targets (b, T))`` with ``b = train.micro_batch_size``
(targets ``-100`` where there is none). Every rank of a data-parallel replica (its TP and PP
ranks) passes the same batch. Each pair is split into ``parallel.micro_batches`` pipeline
micro-batches.

Two paths:
* ``pp == 1``: the dense schedule (``model.forward``), one DeepSpeed forward/backward per
  micro-batch; works with ZeRO 0-3.
* ``pp > 1``: the ring schedule over the stages; gradients accumulate on shadow parameters
  (grads.py) and reach DeepSpeed in one backward per step; ZeRO 0-2.

Loss normalisation: the loss is the sum of token losses divided by the global count of valid
target tokens of the step (all micro-batches, all data-parallel ranks); since DeepSpeed averages
gradients over data-parallel ranks, the backward uses ``dp / global_count`` per token.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from rlt_mega.config import Config, ConfigError
from rlt_mega.log import get_logger
from rlt_mega.model.rlt import RLT, build_model
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.grads import ShadowGrads, deposit_grads
from rlt_mega.parallel.pipeline import P2P, RingSchedule
from rlt_mega.parallel.stage import RLTStage, prune_to_stage
from rlt_mega.parallel.tp import apply_tensor_parallel, gather_vocab, token_losses
from rlt_mega.parallel.zero import ZeroStepper, init_deepspeed, mark_for_grad_norm, sync_pipeline_replicas

log = get_logger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs (b, T), targets (b, T))


def build_engine(cfg: Config, dims: ParallelDims, model_fn: Optional[Callable[[], RLT]] = None) -> "ParallelEngine":
    """Builds this rank's part of the model and wraps it. ``model_fn`` returns the full
    single-device model (default: ``build_model(cfg.model, "cpu", seed=cfg.train.seed)``);
    every rank builds the same one and keeps its stage and TP shard, so the distributed model
    starts equal to the single-process model with the same seed."""
    model = model_fn() if model_fn is not None else build_model(cfg.model, "cpu", seed=cfg.train.seed)
    return ParallelEngine(cfg, dims, model)


class ParallelEngine:
    def __init__(self, cfg: Config, dims: ParallelDims, model: RLT) -> None:
        self.cfg, self.dims = cfg, dims
        self.M = cfg.parallel.micro_batches
        self.bf16 = cfg.train.dtype == "bf16"
        if dims.pp > 1:
            prune_to_stage(model, dims.layers, dims.is_first_stage, dims.is_last_stage)
        apply_tensor_parallel(model, dims)
        model.to(dims.device)
        model.set_checkpointing(cfg.train.checkpointing)
        mark_for_grad_norm(model, dims)
        self.model = model
        mbs = cfg.train.micro_batch_size
        if dims.pp > 1:  # one DeepSpeed backward per step (grads.py)
            ds_micro, ds_accum = mbs * cfg.train.grad_accum, 1
        else:  # one DeepSpeed backward per pipeline micro-batch
            ds_micro, ds_accum = mbs // self.M, cfg.train.grad_accum * self.M
        self.ds_accum = ds_accum
        self.engine = init_deepspeed(model, dims, cfg.optim, cfg.parallel.zero_stage, self.bf16, ds_micro, ds_accum)
        self.stepper = ZeroStepper(self.engine, dims, cfg.optim, cfg.parallel.zero_stage, self.bf16)
        if dims.pp > 1:
            stage = RLTStage(self.engine.module, dims.layers, dims.is_first_stage, dims.is_last_stage, dims.tp)
            self.p2p = P2P(dims.pp_ranks, dims.pp_rank, dims.device)
            self.ring = RingSchedule(stage, self.p2p, dims.pp_rank, dims.pp)

    # ------------------------------------------------------------------ helpers
    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def _split(self, batch: Batch) -> list[Batch]:
        inputs, targets = batch
        if inputs.shape[0] % self.M != 0:
            raise ConfigError(f"a micro-batch of {inputs.shape[0]} rows cannot be split into parallel.micro_batches="
                              f"{self.M} pipeline micro-batches: make train.micro_batch_size a multiple of {self.M}")
        dev = self.dims.device
        return [(x.to(dev), y.to(dev)) for x, y in zip(inputs.chunk(self.M), targets.chunk(self.M))]

    def _global_count(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Valid target tokens of the step summed over data-parallel ranks (fp64 count)."""
        count = sum((y != -100).sum() for _, y in micro_batches).to(torch.float64).to(self.dims.device)
        dist.all_reduce(count, group=self.dims.dp_group)
        return count

    def _global_loss(self, loss_sum: Optional[torch.Tensor], count: torch.Tensor) -> float:
        """Sum of token losses (known on the last stage) -> the global mean on every rank."""
        total = torch.zeros((), dtype=torch.float64, device=self.dims.device)
        if loss_sum is not None:
            total += loss_sum.to(torch.float64)
        dist.all_reduce(total, group=self.dims.dp_group)
        if self.dims.pp > 1:
            if not self.dims.is_last_stage:
                total.zero_()
            dist.all_reduce(total, group=self.dims.pp_group)
        return float(total / count.clamp_min(1))

    # ------------------------------------------------------------------ training
    def backward_step(self, micro_batches: list[Batch]) -> tuple[float, float]:
        """Forward and backward over the step's micro-batches; gradients are reduced over the
        data-parallel group but no optimizer step is taken. Returns (loss, token count).
        With pp == 1 and gradient accumulation the last engine.step() happens in step()."""
        count = self._global_count(micro_batches)
        scale = float(self.dims.dp / count.clamp_min(1))  # per-token weight; DeepSpeed averages over dp
        loss_sum = None
        if self.dims.pp == 1:
            chunks = [c for mb in micro_batches for c in self._split(mb)]
            if len(chunks) != self.ds_accum:
                raise ValueError(f"train_step got {len(micro_batches)} micro-batches; the engine was built for "
                                 f"train.grad_accum={self.cfg.train.grad_accum}")
            for i, (x, y) in enumerate(chunks):
                logits = self.engine(x)  # (b, T, V / tp) fp32
                part = token_losses(logits, y, self.dims.tp).sum()
                self.engine.backward(part * scale, scale_wrt_gas=False)
                loss_sum = part.detach() if loss_sum is None else loss_sum + part.detach()
                if i < len(chunks) - 1:
                    self.engine.step()  # inside the accumulation window: no update, counts the micro-step
        else:
            shadows = ShadowGrads(self.module)
            with shadows.active():
                for mb in micro_batches:
                    part = self.ring.run(self._split(mb), scale, backward=True)
                    if part is not None:
                        loss_sum = part if loss_sum is None else loss_sum + part
            grads = shadows.grads()
            sync_pipeline_replicas(grads, self.module, self.dims)
            deposit_grads(self.engine, grads)
        return self._global_loss(loss_sum, count), float(count)

    def optimizer_step(self, lr: Optional[float]) -> float:
        """Clips by the global gradient norm and steps; returns the norm (before clipping)."""
        return self.stepper.step(lr)

    def train_step(self, micro_batches: list[Batch], lr: Optional[float] = None) -> dict:
        loss, tokens = self.backward_step(micro_batches)
        grad_norm = self.optimizer_step(lr)
        return {"loss": loss, "grad_norm": grad_norm, "tokens": tokens,
                "lr": self.engine.optimizer.param_groups[0]["lr"]}

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[Batch]) -> float:
        """Mean token loss over the micro-batches of every data-parallel rank (no gradients)."""
        count = self._global_count(micro_batches)
        loss_sum = None
        for mb in micro_batches:
            if self.dims.pp == 1:
                part = sum(token_losses(self.engine(x), y, self.dims.tp).sum() for x, y in self._split(mb))
            else:
                part = self.ring.run(self._split(mb), 1.0, backward=False)
            if part is not None:
                loss_sum = part if loss_sum is None else loss_sum + part
        return self._global_loss(loss_sum, count)

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (b, T, V) of the dense schedule; pp == 1 only."""
        if self.dims.pp != 1:
            raise NotImplementedError("logits() runs the dense schedule and needs parallel.pp == 1")
        return gather_vocab(self.engine(inputs.to(self.dims.device)), self.dims)

    # ------------------------------------------------------------------ inspection
    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter gradient after backward_step (full over the
        data-parallel partitions, via DeepSpeed's own safe_get_full_grad)."""
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, p in self.module.named_parameters():
            g = safe_get_full_grad(p) if self.cfg.parallel.zero_stage > 0 or self.bf16 else p.grad
            if g is not None:
                out[name] = g.detach().float().clone()
        return out

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter (fp32 master weights where DeepSpeed keeps them)."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, p in self.module.named_parameters():
            if self.cfg.parallel.zero_stage > 0 or self.bf16:
                out[name] = safe_get_full_fp32_param(p).detach().clone()
            else:
                out[name] = p.detach().clone()
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | os.PathLike, client_state: Optional[dict] = None) -> None:
        """Every rank writes its shards (DeepSpeed engine checkpoint: module and ZeRO optimizer
        state) into ``path``. Atomic: written to ``path.tmp`` and renamed after every rank is done."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        if self.dims.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        dist.barrier()
        self.engine.save_checkpoint(str(tmp), tag="state", client_state=client_state or {}, save_latest=False)
        dist.barrier()
        if self.dims.rank == 0:
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        dist.barrier()

    def load(self, path: str | os.PathLike) -> dict:
        """Loads a checkpoint written by :meth:`save` on the same layout; returns client_state."""
        path = Path(path)
        if not (path / "state").is_dir():
            raise FileNotFoundError(f"{path} is not an rlt_mega engine checkpoint (no {path / 'state'})")
        load_path, client_state = self.engine.load_checkpoint(str(path), tag="state", load_module_strict=True,
                                                              load_optimizer_states=True,
                                                              load_lr_scheduler_states=False)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path} (was it saved on another layout?)")
        return client_state or {}
