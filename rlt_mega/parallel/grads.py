"""Gradient accumulation for the pipeline, outside DeepSpeed's gradient hooks.

A pipeline stage runs many backward passes per optimizer step (one per decoder position and
micro-batch: the gradient of each step's output arrives over the wire). DeepSpeed's ZeRO
hooks fire on every accumulation into a parameter's ``.grad`` and treat each as a
gradient-accumulation micro-step (ZeRO-2 would reduce-scatter the whole stage's gradient
T*M times per step). So the schedule computes with *shadow* parameters: leaves that share
storage with the real parameters but are different tensors, so DeepSpeed's hooks never see
them. Their gradients accumulate (in fp32 for low-precision parameters) over the whole round;
:func:`deposit_grads` then hands them to DeepSpeed in one ordinary backward, whose data-parallel
reduction, clipping and optimizer step are DeepSpeed's own.

Trade-off, stated: the accumulators hold one full gradient of the stage, so ZeRO-2's
partitioned-gradient memory saving does not apply under pipeline parallelism (ZeRO-1's
optimizer-state partitioning does). Reducing per backward would keep it, at T*M times the
data-parallel traffic.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from rlt_mega.precision import LOW_PRECISION


class ShadowGrads:
    """Swaps every parameter of ``module`` for a shadow leaf while active; collects gradients."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.shadows: dict[int, nn.Parameter] = {}
        self.originals: dict[int, nn.Parameter] = {}
        self.acc32: dict[int, torch.Tensor] = {}  # fp32 accumulators of low-precision shadows
        self._swapped: list = []

    def _shadow(self, p: nn.Parameter) -> nn.Parameter:
        key = id(p)
        if key not in self.shadows:
            sh = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            if p.requires_grad and p.dtype in LOW_PRECISION:
                self.acc32[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

                def move_to_fp32(param: torch.Tensor, key=key) -> None:
                    self.acc32[key].add_(param.grad)
                    param.grad = None

                sh.register_post_accumulate_grad_hook(move_to_fp32)
            self.shadows[key] = sh
            self.originals[key] = p
        return self.shadows[key]

    @contextmanager
    def active(self) -> Iterator["ShadowGrads"]:
        for mod in self.module.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    self._swapped.append((mod, name, p))
                    mod._parameters[name] = self._shadow(p)
        try:
            yield self
        finally:
            for mod, name, p in self._swapped:
                mod._parameters[name] = p
            self._swapped = []

    def grads(self) -> dict[nn.Parameter, torch.Tensor]:
        """Real parameter -> accumulated gradient (zeros for a parameter no backward reached)."""
        out = {}
        for key, p in self.originals.items():
            if not p.requires_grad:
                continue
            if key in self.acc32:
                out[p] = self.acc32[key]
            else:
                g = self.shadows[key].grad
                out[p] = torch.zeros_like(p) if g is None else g
        return out


def deposit_grads(engine, grads: dict[nn.Parameter, torch.Tensor]) -> None:
    """One DeepSpeed backward whose parameter gradients are exactly ``grads``:
    d/dp sum(p * g) = g (a product with 1, exact in every dtype)."""
    if hasattr(engine.optimizer, "clear_backward_seen_flag"):
        # What engine.forward would do; this backward has no engine.forward of its own.
        engine.optimizer.clear_backward_seen_flag()
    surrogate = sum((p * g.to(p.dtype)).sum() for p, g in grads.items())
    engine.backward(surrogate, scale_wrt_gas=False)
