"""The distributed engine: tensor parallel + decoder-ring pipeline + DeepSpeed ZeRO, behind
the Engine interface of parallel/engine.py, so the trainers drive it as they drive the local
engine.

The step's batches are this data-parallel rank's share of one optimizer step (every rank of a
model replica, its TP and PP ranks, passes the same ones); batching.py turns them into
pipeline micro-batches and rounds of ``parallel.micro_batches`` in flight.

Two paths:
* ``pp == 1``: the dense schedule (``model.forward``), one DeepSpeed forward/backward per
  pipeline micro-batch (DeepSpeed's gradient accumulation); ZeRO 0-3.
* ``pp > 1``: the ring schedule over the stages; gradients accumulate on shadow parameters
  (grads.py) and reach DeepSpeed in one backward per step; ZeRO 0-2.

Loss normalisation: the loss returns sums; the engine divides by the step's count summed over
every batch and data-parallel rank. DeepSpeed averages gradients over data-parallel ranks, so
the backward weighs each summed loss by ``dp / global_count``.

bf16 here is DeepSpeed's: bf16 parameters and activations, fp32 master weights and optimizer
state, fp32 gradient accumulation and data-parallel reduction (parallel.grad_accum_dtype and
grad_reduce_dtype; zero.py says what DeepSpeed does with them; without ZeRO DeepSpeed can only
accumulate in bf16). The local engine uses autocast over fp32 parameters.

The other jobs live beside it: checkpoint files in ds_checkpoint.py, reads of DeepSpeed's
state in ds_state.py, the ZeRO-3 sampling copy in sampling_copy.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from rlt_mega.config import CheckpointConfig, OptimConfig, ParallelConfig
from rlt_mega.loss import LM_LOSS, LogitsLoss
from rlt_mega.model.rlt import RLT
from rlt_mega.parallel import batching
from rlt_mega.parallel.batching import dense_logits
from rlt_mega.parallel.cuda_graphs import install_cuda_graphs
from rlt_mega.parallel.dims import ParallelDims, micro_batch_plan
from rlt_mega.parallel.ds_checkpoint import DeepSpeedCheckpoint
from rlt_mega.parallel.ds_state import DeepSpeedState
from rlt_mega.parallel.engine import EngineConfig, StepStats, lr_lambda
from rlt_mega.parallel.grads import ShadowGrads, deposit_grads, handover_pieces
from rlt_mega.parallel.p2p import P2P
from rlt_mega.parallel.pipeline import RingSchedule
from rlt_mega.parallel.sampling_copy import SamplingCopy
from rlt_mega.parallel.sharding import shard_for_rank
from rlt_mega.parallel.stage import RLTStage
from rlt_mega.parallel.tp import ShardedVocab, gather_vocab
from rlt_mega.parallel.zero import (DeepSpeedCopy, ZeroStepper, grad_accum_dtype, init_deepspeed,
                                   mark_for_grad_norm, sync_pipeline_replicas)


class DistributedEngine:
    """``model``: on the CPU, the full single-device model, or only this rank's stage (from an
    export) or stage and shard (parallel/build.py); it becomes this rank's stage and TP shard inside a DeepSpeed engine (``self.ds``)."""

    def __init__(self, model: RLT, dims: ParallelDims, optim: OptimConfig, engine: EngineConfig,
                 parallel: ParallelConfig, checkpoint: CheckpointConfig) -> None:
        self.dims, self.optim, self.engine_cfg = dims, optim, engine
        self.zero_stage = parallel.zero_stage
        self.num_in_flight = parallel.micro_batches  # M: pipeline micro-batches in flight
        self.bf16 = engine.dtype == "bf16"
        self.full_cfg = model.cfg
        shard_for_rank(model, dims)
        model.set_checkpointing(engine.checkpointing)
        if engine.cuda_graphs:  # (off: the model's default)
            install_cuda_graphs(model)
        mark_for_grad_norm(model, dims)
        mbs, accum = engine.micro_batch_size, engine.grad_accum
        self.num_pieces, _ = micro_batch_plan(mbs, accum, self.num_in_flight)
        accum_dtype = grad_accum_dtype(parallel, self.bf16)
        # PP: the step's fp32 accumulators go to DeepSpeed in as many bf16 backwards as keep them
        # exact where DeepSpeed accumulates in fp32 (grads.py), in one otherwise.
        self.num_handover = handover_pieces(self.bf16, accum_dtype)
        if dims.pp > 1:  # the step's gradients reach DeepSpeed in `num_handover` backwards (grads.py)
            ds_micro, self.ds_accum = mbs * accum, self.num_handover
        else:  # one DeepSpeed backward per pipeline micro-batch
            ds_micro, self.ds_accum = mbs // self.num_pieces, accum * self.num_pieces
        self.ds = init_deepspeed(model, dims, optim, self.zero_stage, self.bf16, ds_micro, self.ds_accum,
                                 accum_dtype, parallel.grad_reduce_dtype)
        self.stepper = ZeroStepper(self.ds, dims, optim, self.zero_stage, self.bf16)
        # bf16: the copy of the masters under train.bf16_cast, and its lag (zero.py)
        self.copy = DeepSpeedCopy(self.ds, dims, engine.bf16_cast, engine.seed) if self.bf16 else None
        if self.copy is not None:
            self.copy.remake(0)
        self.lr_factor = lr_lambda(optim, engine.total_steps)
        self.steps_taken = 0  # optimizer steps applied: the position in the learning-rate schedule
        self.vocab = ShardedVocab(dims)
        self.state = DeepSpeedState(self.ds, dims, self.zero_stage, self.bf16)
        self.files = DeepSpeedCheckpoint(self.ds, dims, self.state, self.full_cfg, checkpoint, self.layout)
        self._sampling_copy = SamplingCopy(self.module, dims, self.full_cfg) if self.zero_stage == 3 else None
        if dims.pp > 1:
            stage = RLTStage(self.ds.module, dims.layers, dims.is_first_stage, dims.is_last_stage, self.vocab)
            self.ring = RingSchedule(stage, P2P.for_pipeline(dims), dims.pp_rank, dims.pp)

    @property
    def module(self) -> nn.Module:
        return self.ds.module

    def layout(self) -> dict:
        out = {"tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp, "zero_stage": self.zero_stage}
        if self.dims.pp > 1:  # layers per stage: which parameters each stage holds
            out["pp_split"] = [len(r) for r in self.dims.stage_layers]
        return out

    def close(self) -> None:
        """Releases DeepSpeed's engine (its hooks and buffers)."""
        self.ds.destroy()

    # ------------------------------------------------------------------ helpers
    def _pipeline_batches(self, batches: Sequence[dict], loss: LogitsLoss) -> list[dict]:
        out = batching.pipeline_batches(list(batches), loss, self.num_pieces, self.dims.device)
        if self.dims.pp == 1 and self.zero_stage == 3:
            out = batching.same_length_over_dp(out, self.dims)
        return out

    def _global_count(self, batches: Sequence[dict], loss: LogitsLoss) -> float:
        """The step's normaliser: the loss's count summed over the batches and data-parallel ranks."""
        count = torch.tensor(float(sum(loss.count(b) for b in batches)), dtype=torch.float64, device=self.dims.device)
        return float(self.dims.all_reduce(count, axis="dp"))

    def _global_loss(self, loss_sum: Optional[torch.Tensor], count: float) -> float:
        """Sum of the losses (known on the last stage) -> the step's loss, on every rank."""
        total = torch.zeros((), dtype=torch.float64, device=self.dims.device)
        if torch.is_tensor(loss_sum) and self.dims.is_last_stage:
            total += loss_sum.to(torch.float64)
        self.dims.all_reduce(total, axis="dp")
        if self.dims.pp > 1:
            self.dims.all_reduce(total, axis="pp")
        return float(total) / max(count, 1.0)  # the normalisation: the global sum over the global count

    def _dense_loss(self, batch: dict, loss: LogitsLoss) -> torch.Tensor:
        return loss.logits_loss(dense_logits(self.ds, self.module, batch), batch, self.vocab)  # logits (b, T, V / tp) fp32

    def _all_finite(self, grads: dict) -> bool:
        """Every rank's accumulated gradients finite: one flag per tensor on the device, one
        reduction over the world, one host read."""
        flags = [torch.isfinite(g).all() for g in grads.values()]
        ok = (torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=self.dims.device))
        return bool(self.dims.all_reduce(ok.float().reshape(1), op="min").item())

    # ------------------------------------------------------------------ training
    def backward_step(self, batches: Sequence[dict], loss: LogitsLoss = LM_LOSS) -> tuple[float, float, bool]:
        """Forward and backward over the step's batches; afterwards the gradients are in
        DeepSpeed, reduced over the data-parallel group. Returns (the step's loss, its global
        count, finite). With pp == 1 the accumulation window's last ds.step() is the stepper's."""
        count = self._global_count(batches, loss)
        scale = self.dims.dp / max(count, 1.0)  # the normalisation: 1 / global count, times dp (DeepSpeed averages)
        loss_sum = None
        pieces = self._pipeline_batches(batches, loss)
        if self.dims.pp == 1:
            if len(pieces) != self.ds_accum:
                raise ValueError(f"train_step got {len(batches)} batches ({len(pieces)} pipeline micro-batches); "
                                 f"the engine was built for {self.engine_cfg.grad_accum} batches (train.grad_accum) "
                                 f"x {self.num_pieces} pieces")
            for i, piece in enumerate(pieces):
                part = self._dense_loss(piece, loss)
                self.ds.backward(part * scale, scale_wrt_gas=False)
                loss_sum = part.detach() if loss_sum is None else loss_sum + part.detach()
                if i < len(pieces) - 1:
                    self.ds.step()  # inside the accumulation window: no update, counts the micro-step
            step_loss = self._global_loss(loss_sum, count)
            return step_loss, count, math.isfinite(step_loss)
        shadows = ShadowGrads(self.module)
        with shadows.active():
            for round_ in batching.rounds(pieces, self.num_in_flight):
                part = self.ring.run(round_, scale, backward=True, loss=loss)
                if part is not None:
                    loss_sum = part if loss_sum is None else loss_sum + part
        step_loss = self._global_loss(loss_sum, count)
        grads = shadows.grads()
        finite = math.isfinite(step_loss) and self._all_finite(grads)
        if finite:  # a non-finite step never reaches DeepSpeed: nothing to undo
            sync_pipeline_replicas(grads, self.module, self.dims)
            deposit_grads(self.ds, grads, self.num_handover)
        return step_loss, count, finite

    def train_step(self, batches: Sequence[dict], loss: LogitsLoss = LM_LOSS) -> StepStats:
        self.module.train()
        step_loss, count, finite = self.backward_step(batches, loss)
        lr = self.optim.lr * self.lr_factor(self.steps_taken)
        if self.dims.pp > 1 and not finite:
            return StepStats(loss=step_loss, grad_norm=float("nan"), lr=lr, num_tokens=int(count), skipped=True)
        if self.copy is not None:
            self.copy.before_step()
        grad_norm, applied = self.stepper.step(lr, skip=not finite)
        skipped = not (applied and math.isfinite(grad_norm))
        if not skipped:
            self.steps_taken += 1
        metrics = {} if self.copy is None else self.copy.after_step(not skipped, self.steps_taken)
        return StepStats(loss=step_loss, grad_norm=grad_norm, lr=lr, num_tokens=int(count), skipped=skipped,
                         precision=metrics)

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[dict], loss: LogitsLoss = LM_LOSS) -> float:
        """The loss over the batches of every data-parallel rank (no gradients)."""
        self.module.eval()
        count = self._global_count(batches, loss)
        loss_sum = None
        pieces = self._pipeline_batches(batches, loss)
        if self.dims.pp == 1:
            loss_sum = sum(self._dense_loss(piece, loss) for piece in pieces)
        else:
            for round_ in batching.rounds(pieces, self.num_in_flight):
                part = self.ring.run(round_, 1.0, backward=False, loss=loss)
                if part is not None:
                    loss_sum = part if loss_sum is None else loss_sum + part
        return self._global_loss(loss_sum, count)

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (b, T, V) of the dense schedule on every rank; pp == 1 only."""
        if self.dims.pp != 1:
            raise NotImplementedError("logits() runs the dense schedule and needs parallel.pp == 1")
        return gather_vocab(self.ds(inputs.to(self.dims.device)), self.dims)

    def sampling_module(self) -> nn.Module:
        """The module that sampling, replay and evaluation run on: this rank's stage and TP shard
        with its whole parameters, current as of the last optimizer step. ZeRO 0-2: the
        engine's module itself; ZeRO-3: a gathered copy (sampling_copy.py), a collective over
        the data-parallel group."""
        return self.module if self._sampling_copy is None else self._sampling_copy.refresh()

    # ------------------------------------------------------------------ inspection
    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter gradient after backward_step."""
        return self.state.gradients()

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter, fp32 masters (collective under ZeRO-3)."""
        return self.state.parameters_fp32()

    def full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """The single-device state dict on global rank 0, None elsewhere (collective)."""
        return self.state.full_state_dict()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What the DeepSpeed checkpoint does not hold: the learning-rate schedule position."""
        return {"steps_taken": self.steps_taken}

    def load_state_dict(self, state: dict) -> None:
        self.steps_taken = int(state["steps_taken"])

    def save(self, directory: Path) -> None:
        self.files.save(directory, self.state_dict())

    def load(self, directory: Path) -> None:
        self.load_state_dict(self.files.load(directory))
        if self.copy is not None:  # DeepSpeed's load makes the nearest copy: remake the run's
            self.copy.remake(self.steps_taken)
