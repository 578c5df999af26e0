"""The engine interface every trainer drives, and its single-device implementation.

An :class:`Engine` holds this rank's part of the model with its optimizer and learning-rate
schedule, and runs one optimizer step over the step's batches. Two implement it, and a
trainer never knows which it drives (train/builders.py picks one):

* :class:`LocalEngine` (here): one device, torch AdamW, autocast for bf16;
* ``parallel.distributed.DistributedEngine``: tensor parallel + the decoder-ring pipeline +
  DeepSpeed ZeRO over the data-parallel group.

A batch is a dict of tensors (``inputs`` (b, T) and whatever the loss reads). The loss is a
``rlt_mega.loss.LogitsLoss``: it returns the SUM of a batch's losses and counts the batch's
share of the normaliser; the engine divides the step's sum by the global count (every batch
of the step, every data-parallel rank), so gradient accumulation and data parallelism do not
change the objective.

Each engine receives the layout (parallel.dims.ParallelDims) and its own sub-configs: the
optimizer's (OptimConfig) and :class:`EngineConfig`, the step's shape and precision, which
each job derives from its config in one place.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from safetensors.torch import load_model, save_model

from rlt_mega.checkpoint import CheckpointError, check_weights, load_torch
from rlt_mega.parallel.adapter_files import base_state, load_adapters, save_adapters, state_hash
from rlt_mega.model.lora import has_adapters
from rlt_mega.config import CheckpointingConfig, OptimConfig, TrainConfig
from rlt_mega.loss import LM_LOSS, WHOLE_VOCAB, LogitsLoss
from rlt_mega.parallel.batching import dense_logits
from rlt_mega.parallel.cuda_graphs import install_cuda_graphs
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.zero import param_groups
from rlt_mega.parallel.reshard import KEYS, LayoutFreeState, StateWriter, changes, format_layout, same_layout, saved_layout
from rlt_mega.log import get_logger
from rlt_mega.precision import CopyLag, bf16_copy, cast_key, precision

log = get_logger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built for besides the layout and the optimizer. Pretraining and SFT
    take it from train.* as written (:meth:`from_train`); GRPO derives it (train/grpo.py,
    ``engine_config``): its optimizer steps are epochs x minibatches per GRPO step, and a
    batch is a minibatch's rows / grad_accum."""

    total_steps: int  # optimizer steps the learning-rate schedule spans
    micro_batch_size: int  # rows of one batch
    grad_accum: int  # batches per optimizer step
    dtype: str = "fp32"  # "fp32" or "bf16" (precision.DTYPES)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    cuda_graphs: bool = False  # train.cuda_graphs: the fused decoder's positions as captured CUDA graphs
    bf16_cast: str = "nearest"  # train.bf16_cast: how bf16 runs make the copy of the fp32 masters
    seed: int = 0  # train.seed: the key of the stochastic cast (precision.cast_key)

    @classmethod
    def from_train(cls, train: TrainConfig) -> "EngineConfig":
        return cls(total_steps=train.steps, micro_batch_size=train.micro_batch_size, grad_accum=train.grad_accum,
                   dtype=train.dtype, checkpointing=train.checkpointing, cuda_graphs=train.cuda_graphs,
                   bf16_cast=train.bf16_cast, seed=train.seed)


@dataclass
class StepStats:
    loss: float  # the step's loss: its summed loss / its global count
    grad_norm: float  # before clipping
    lr: float
    num_tokens: int  # the step's global count (loss tokens of all ranks, for the token losses)
    skipped: bool  # non-finite loss or gradient norm: no update
    # bf16: precision.CopyLag's metrics of the step (precision/stale_fraction, precision/copy_lag)
    precision: dict = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """What a trainer may ask of an engine (module docstring)."""

    dims: ParallelDims

    @property
    def module(self) -> nn.Module:
        """This rank's part of the model, as trained."""

    def train_step(self, batches: Sequence[dict], loss: LogitsLoss = LM_LOSS) -> StepStats:
        """One optimizer step over this data-parallel rank's batches of the step (every rank of
        a model replica passes the same ones); a non-finite loss or gradient skips the update."""

    def eval_loss(self, batches: Sequence[dict], loss: LogitsLoss = LM_LOSS) -> float:
        """The loss over the batches of every data-parallel rank (no gradients)."""

    def sampling_module(self) -> nn.Module:
        """The module that sampling, replay and evaluation run on (current parameters)."""

    def state_dict(self) -> dict:
        """What resuming needs beyond :meth:`save`'s files (the schedule's position)."""

    def load_state_dict(self, state: dict) -> None: ...

    def save(self, directory: Path) -> None:
        """Weights and optimizer state into a checkpoint directory (every rank calls it)."""

    def load(self, directory: Path) -> None: ...

    def layout(self) -> dict:
        """{"tp", "pp", "dp", "zero_stage"[, "pp_split"]}: recorded with every checkpoint."""


def lr_lambda(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up to optim.lr, then cosine decay to optim.min_lr at total_steps."""

    def factor(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        span = max(1, total_steps - optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / span)
        floor = optim.min_lr / optim.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: nn.Module, optim: OptimConfig, total_steps: int
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(param_groups(model, optim.weight_decay), lr=optim.lr,
                            betas=(optim.beta1, optim.beta2), eps=optim.eps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(optim, total_steps))


class LocalEngine:
    """The whole model on one device (the single-process layout): AdamW, the learning-rate
    schedule, gradient accumulation over the step's batches, clipping, non-finite steps
    skipped. bf16 is autocast over fp32 parameters: under train.bf16_cast=nearest they are the
    masters, and autocast's round-to-nearest makes the copy each product reads; under
    stochastic the optimizer steps separate fp32 masters and the module's trained parameters
    hold their stochastic bf16 copy (``_Bf16Masters``), which every product, the sampler and
    the replay read exactly as stored."""

    def __init__(self, model: nn.Module, dims: ParallelDims, optim: OptimConfig, engine: EngineConfig,
                 layout_free: bool = True) -> None:
        if dims.world_size != 1:
            raise ValueError(f"the local engine runs on one process; this layout has {dims.world_size} ranks "
                             "(parallel.distributed.DistributedEngine runs on them)")
        self.model, self.dims, self.optim_cfg = model, dims, optim
        self.layout_free = layout_free  # checkpoint.layout_free: every save also writes state/
        self.device, self.dtype = dims.device, engine.dtype
        model.set_checkpointing(engine.checkpointing)
        if engine.cuda_graphs:  # (off: the model's default)
            install_cuda_graphs(model)
        self.optimizer, self.scheduler = build_optimizer(model, optim, engine.total_steps)
        self._base_sha = None  # under adapters: the frozen base's hash, computed at the first save
        self.masters = _Bf16Masters(model, self.optimizer, engine) if engine.dtype == "bf16" else None

    @property
    def module(self) -> nn.Module:
        return self.model

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def train_step(self, batches: Sequence[dict], loss: LogitsLoss = LM_LOSS) -> StepStats:
        self.model.train()
        batches = [self._to_device(b) for b in batches]
        total = sum(loss.count(b) for b in batches)  # one process: the step's count is the global count
        loss_sum = 0.0
        for b in batches:
            with precision(self.dtype, self.device):
                # The normalisation: each batch's loss SUM over the step's count.
                part = loss.logits_loss(dense_logits(self.model, self.model, b), b, WHOLE_VOCAB) / max(total, 1)
            part.backward()
            loss_sum += float(part.detach())
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not (math.isfinite(loss_sum) and math.isfinite(grad_norm))
        metrics = {}
        if not skipped:
            if self.masters is not None:
                self.masters.before_step()
            self.optimizer.step()
            self.scheduler.step()
            if self.masters is not None:
                metrics = self.masters.after_step(self.scheduler.last_epoch)
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.zero_grad()
        return StepStats(loss=loss_sum, grad_norm=grad_norm, lr=lr, num_tokens=int(total), skipped=skipped,
                         precision=metrics)

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[dict], loss: LogitsLoss = LM_LOSS) -> float:
        self.model.eval()
        loss_sum, total = 0.0, 0
        for b in batches:
            b = self._to_device(b)
            with precision(self.dtype, self.device):
                loss_sum += float(loss.logits_loss(dense_logits(self.model, self.model, b), b, WHOLE_VOCAB))
            total += loss.count(b)
        return loss_sum / max(total, 1)  # the normalisation: the summed loss over the summed count

    def sampling_module(self) -> nn.Module:
        return self.model

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def layout(self) -> dict:
        return {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}

    def _holding_masters(self):
        """A context in which the module's parameters are the fp32 masters (what checkpoints
        store; the copy is remade from them on load); nothing to swap without separate masters."""
        return self.masters.in_module() if self.masters is not None else contextlib.nullcontext()

    def save(self, directory: Path) -> None:
        with self._holding_masters():
            if has_adapters(self.model):  # the adapters only, and the hash of the frozen base
                save_adapters(self.model, directory, self._base_hash())
            else:
                save_model(self.model, str(directory / "model.safetensors"))
        torch.save(self.state_dict(), directory / "engine.pt")
        if self.layout_free:
            self._save_layout_free(directory)

    def _trained(self) -> list[tuple[str, nn.Parameter]]:
        """(name, the tensor the optimizer steps): the module's trained parameter, or its fp32
        master under train.bf16_cast=stochastic."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if self.masters is None or not self.masters.stochastic:
            return named
        master_of = {id(p): m for p, m in zip(self.masters.params, self.masters.masters)}
        return [(n, master_of[id(p)]) for n, p in named]

    def _save_layout_free(self, directory: Path) -> None:
        """The layout-free state (parallel/reshard.py): whole tensors, one process."""
        steps = [int(st["step"]) for st in self.optimizer.state.values() if "step" in st]
        writer = StateWriter(directory, 0, 0, 1, 0, {"adam_step": max(steps, default=0),
                                                     "steps_taken": self.scheduler.last_epoch})
        for name, p in self._trained():
            st = self.optimizer.state.get(p, {})
            writer.add(name, {"fp32": p, **{k: st.get(k, torch.zeros_like(p)) for k in KEYS[1:]}})
        writer.close()

    @torch.no_grad()
    def _load_layout_free(self, directory: Path) -> None:
        """Parameters, Adam state and schedule position from another layout's checkpoint."""
        state = LayoutFreeState.open(directory)
        tied = bool(getattr(self.model.cfg, "tie_embeddings", False))
        for name, p in self._trained():
            values = {k: state.read(state.lookup(name, tied), k, 1, 0).to(self.device) for k in KEYS}
            if values["fp32"].shape != p.shape:
                raise CheckpointError(f"checkpoint {directory}: '{name}' is {tuple(values['fp32'].shape)} in its "
                                      f"layout-free state, {tuple(p.shape)} in this model")
            p.copy_(values["fp32"])
            self.optimizer.state[p] = {"step": torch.tensor(float(state.adam_step)),
                                       "exp_avg": values["exp_avg"].clone(), "exp_avg_sq": values["exp_avg_sq"].clone()}
        n = state.steps_taken
        sched = self.scheduler
        sched.load_state_dict({**sched.state_dict(), "last_epoch": n, "_step_count": n + 1})
        for group, base, factor in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * factor(n)
        sched._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if self.masters is not None:  # the masters were loaded: remake the copy of step n
            self.masters.remake(n)
        log.warning("resumed %s, written with layout %s, on one process (%s): fp32 masters, Adam moments and step of "
                    "%d parameters from its layout-free state", directory, format_layout(saved_layout(directory) or {}),
                    changes(saved_layout(directory) or {}, self.layout()), len(state.names()))

    def _base_hash(self) -> str:
        """sha256 of the frozen base under adapters (computed once: it never changes)."""
        if self._base_sha is None:
            self._base_sha = state_hash(base_state(self.model))
        return self._base_sha

    def load(self, directory: Path) -> None:
        saved = saved_layout(directory)
        written_here = saved is None or (same_layout(saved, self.layout()) and (directory / "engine.pt").is_file()
                                         and not (directory / "deepspeed").is_dir())  # not the distributed engine's
        if not written_here:
            return self._load_layout_free(directory)
        if has_adapters(self.model):
            load_adapters(self.model, directory, self._base_hash())
        else:
            check_weights(directory / "model.safetensors", self.model)  # names the mismatch, one line
            load_model(self.model, str(directory / "model.safetensors"), strict=True, device=str(self.device))
        state = load_torch(directory / "engine.pt", map_location=self.device)
        try:
            self.load_state_dict(state)
        except (KeyError, ValueError, TypeError) as exc:  # torch's messages for a mismatched optimizer
            raise CheckpointError(f"checkpoint {directory}: the optimizer state does not fit this model "
                                  f"({type(exc).__name__}: {exc})") from None
        if self.masters is not None:  # the loaded weights are the masters: remake the step's copy
            self.masters.reload(self.scheduler.last_epoch)


class _Bf16Masters:
    """The local engine's bf16 copy (LocalEngine's docstring) and its lag metrics.

    nearest: the trained parameters are the masters; the copy is their nearest bf16, which
    autocast makes at each product, so nothing is stored and the metrics compare the casts.
    stochastic: ``masters`` are fp32 tensors the optimizer steps (its parameter groups are
    rewritten to them at construction, before any state exists); after each applied step the
    module's parameter becomes precision.bf16_copy(master, key of the step's count), stored in
    fp32 (every value a bf16 one, so autocast's cast of it is exact). The first copy, keyed by
    step 0, is made at construction."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, engine: EngineConfig) -> None:
        self.cast, self.seed = engine.bf16_cast, engine.seed
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.stochastic = self.cast == "stochastic"
        self.masters = self.params
        if self.stochastic:
            self.masters = [nn.Parameter(p.detach().clone()) for p in self.params]
            master_of = {id(p): m for p, m in zip(self.params, self.masters)}
            for group in optimizer.param_groups:
                group["params"] = [master_of[id(p)] for p in group["params"]]
            self.remake(0)
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy_of(self, i: int, step: int) -> torch.Tensor:
        return bf16_copy(self.masters[i], self.cast, cast_key(self.seed, step))

    @torch.no_grad()
    def remake(self, step: int) -> None:
        """The module's parameters := the copy of the masters made at optimizer step ``step``."""
        if self.stochastic:
            for i, p in enumerate(self.params):
                p.copy_(self.copy_of(i, step))

    def before_step(self) -> None:
        """The gradient moves to the masters (stochastic); the masters and copies are kept to
        measure the step."""
        if self.stochastic:
            for p, m in zip(self.params, self.masters):
                m.grad, p.grad = p.grad, None
        self._before = [(m.detach().clone(), p.detach().to(torch.bfloat16))
                        for p, m in zip(self.params, self.masters)]

    @torch.no_grad()
    def after_step(self, step: int) -> dict[str, float]:
        """Remakes the copy of the applied step ``step`` (the count of applied steps) and returns
        its precision metrics (one process: the sums are the totals)."""
        self.remake(step)
        lag = CopyLag()
        for (m0, c0), p, m in zip(self._before, self.params, self.masters):
            copy = p.detach().to(torch.bfloat16)
            lag.add(m0, m.detach(), c0, copy)
        self._before = []
        return CopyLag.metrics(lag.tensor("cpu"))

    def zero_grad(self) -> None:
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def reload(self, step: int) -> None:
        """After a checkpoint's weights were loaded into the module (they are the masters)."""
        if self.stochastic:
            for p, m in zip(self.params, self.masters):
                m.copy_(p)
            self.remake(step)

    @contextlib.contextmanager
    def in_module(self):
        """The module's parameters hold the masters' storage inside the context."""
        if not self.stochastic:
            yield
            return
        held = [p.data for p in self.params]
        for p, m in zip(self.params, self.masters):
            p.data = m.data
        try:
            yield
        finally:
            for p, d in zip(self.params, held):
                p.data = d

