"""The single-device engine: model, AdamW, learning-rate schedule, one optimizer step over
micro-batches with gradient accumulation, clipping, and non-finite steps skipped.

The distributed engines (TP/PP/ZeRO) implement the same interface, so a trainer never knows
which one it drives:

    engine.train_step(micro_batches, loss_fn, count_fn) -> StepStats
    engine.eval_loss(micro_batches, loss_fn, count_fn) -> float
    engine.state_dict() / engine.load_state_dict(state)     (optimizer + schedule)
    engine.save(dir) / engine.load(dir)                     (weights + the state above)
    engine.layout() -> dict; engine.data_parallel_size() -> int

A micro-batch is a dict of tensors. ``loss_fn(model, mb)`` returns the SUM of the per-token
losses of ``mb``; ``count_fn(mb)`` its number of loss tokens. The engine divides by the total
count over all micro-batches of the step (and, distributed, over all data-parallel ranks).

A loss written as a :class:`LogitsLoss` (a function of the dense schedule's logits) runs on
every layout: the distributed engine computes the logits itself (a vocab shard under tensor
parallelism, on the last stage under pipeline parallelism) and hands them over.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from safetensors.torch import load_model, save_model

from rlt_mega.checkpoint import CheckpointError, check_weights, load_torch
from rlt_mega.config import OptimConfig, TrainConfig
from rlt_mega.learner.loss import count_tokens, cross_entropy_sum

LossFn = Callable[[nn.Module, dict], torch.Tensor]
CountFn = Callable[[dict], int]


class LogitsLoss:
    """A loss of the dense schedule's logits: ``logits_loss(logits, mb, gather_vocab)`` returns
    the SUM of the per-token losses of ``mb``, where logits (b, T, V_local) fp32 are those of
    the tokens ``mb["inputs"]`` (b, T0 <= T: a pipeline round pads its micro-batches to one
    length with tokens whose logits the loss must not read) and ``gather_vocab`` makes rows
    (..., V_local) whole (..., V), differentiably: V_local = V / tp under tensor parallelism.

    The contract is Megatron's ``forward_step -> (output, loss_fn)``: the engine owns where the
    logits come from, the loss only what is done with them."""

    def logits_loss(self, logits: torch.Tensor, mb: dict, gather_vocab: Callable) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, model: nn.Module, mb: dict) -> torch.Tensor:  # as a LossFn: one device, whole vocabulary
        return self.logits_loss(model(mb["inputs"]), mb, _whole)


def _whole(logits: torch.Tensor) -> torch.Tensor:
    return logits


def lm_loss(model: nn.Module, mb: dict) -> torch.Tensor:
    return cross_entropy_sum(model(mb["inputs"]), mb["targets"])


def lm_count(mb: dict) -> int:
    return count_tokens(mb["targets"])


@dataclass
class StepStats:
    loss: float  # mean loss per token of this step
    grad_norm: float  # before clipping
    lr: float
    num_tokens: int  # loss tokens of this step (all ranks)
    skipped: bool  # non-finite loss or gradient norm: no update


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: not on norms, biases, embeddings, null_memory, z_init."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.dim() >= 2 and "embed" not in name
        (decay if is_matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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
    def __init__(self, model: nn.Module, optim: OptimConfig, train: TrainConfig, device: torch.device) -> None:
        self.model, self.optim_cfg, self.device, self.dtype = model, optim, device, train.dtype
        self.optimizer, self.scheduler = build_optimizer(model, optim, train.steps)

    def _to_device(self, mb: dict) -> dict:
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in mb.items()}

    def train_step(self, micro_batches: Iterable[dict], loss_fn: LossFn = lm_loss,
                   count_fn: CountFn = lm_count) -> StepStats:
        self.model.train()
        micro_batches = [self._to_device(mb) for mb in micro_batches]
        total = sum(count_fn(mb) for mb in micro_batches)
        loss_sum = 0.0
        for mb in micro_batches:
            with autocast(self.device, self.dtype):
                loss = loss_fn(self.model, mb) / max(total, 1)  # mean over this step's loss tokens
            loss.backward()
            loss_sum += float(loss.detach())
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not (math.isfinite(loss_sum) and math.isfinite(grad_norm))
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(loss=loss_sum, grad_norm=grad_norm, lr=lr, num_tokens=total, skipped=skipped)

    @torch.no_grad()
    def eval_loss(self, micro_batches: Iterable[dict], loss_fn: LossFn = lm_loss,
                  count_fn: CountFn = lm_count) -> float:
        self.model.eval()
        loss_sum, total = 0.0, 0
        for mb in micro_batches:
            mb = self._to_device(mb)
            with autocast(self.device, self.dtype):
                loss_sum += float(loss_fn(self.model, mb))
            total += count_fn(mb)
        return loss_sum / max(total, 1)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def layout(self) -> dict:
        return {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}

    def data_parallel_size(self) -> int:
        return 1

    def save(self, directory: Path) -> None:
        save_model(self.model, str(directory / "model.safetensors"))
        torch.save(self.state_dict(), directory / "engine.pt")

    def load(self, directory: Path) -> None:
        check_layout(directory, self.layout())
        check_weights(directory / "model.safetensors", self.model)  # names the mismatch, one line
        load_model(self.model, str(directory / "model.safetensors"), strict=True, device=str(self.device))
        state = load_torch(directory / "engine.pt", map_location=self.device)
        try:
            self.load_state_dict(state)
        except (KeyError, ValueError, TypeError) as exc:  # torch's messages for a mismatched optimizer
            raise CheckpointError(f"checkpoint {directory}: the optimizer state does not fit this model "
                                  f"({type(exc).__name__}: {exc})") from None


def check_layout(directory: Path, layout: dict) -> None:
    """The local engine resumes only checkpoints of its own layout (one process, no ZeRO); the
    weights of any other move through export and train.init_from. (The distributed engine's
    rules are in parallel/reshard.py.)"""
    manifest = Path(directory) / "manifest.json"
    saved = json.loads(manifest.read_text()).get("layout") if manifest.is_file() else None
    if saved is not None and saved != layout:
        raise CheckpointError(f"checkpoint {directory} was written with layout {saved}, this run has {layout}: "
                              "resume on the same layout, or export it and start from the export "
                              "(train.init_from) to change layout")
