"""Gradient accumulation for the pipeline, outside DeepSpeed's gradient hooks.

A pipeline stage runs many backward passes per optimizer step (one per decoder position and
micro-batch: the gradient of each step's output arrives over the wire). DeepSpeed's ZeRO
hooks fire on every accumulation into a parameter's ``.grad`` and treat each as a
gradient-accumulation micro-step (ZeRO-2 would reduce-scatter the whole stage's gradient
T*M times per step). So the schedule computes with *shadow* parameters: leaves that share
storage with the real parameters but are different tensors, so DeepSpeed's hooks never see
them. Their gradients accumulate (in fp32 for low-precision parameters) over the whole round;
:func:`deposit_grads` then hands them to DeepSpeed in ordinary backwards (three bf16 parts that
keep the fp32 sums exactly where DeepSpeed accumulates in fp32, one otherwise), whose
data-parallel reduction, clipping and optimizer step are DeepSpeed's own.

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


def handover_pieces(bf16: bool, accum_dtype: str) -> int:
    """How many backwards hand the step's fp32 accumulators to DeepSpeed: 3 when its optimizer
    accumulates bf16 gradients in fp32 (the three bf16 parts of an fp32 value sum back to it
    exactly, see ``split_fp32``), else 1 (a single rounding of the fp32 sum)."""
    return 3 if bf16 and accum_dtype == "fp32" else 1


def split_fp32(g: torch.Tensor, dtype: torch.dtype, pieces: int) -> list[torch.Tensor]:
    """fp32 g -> ``pieces`` tensors of ``dtype`` whose sum, added in fp32 in order, is g: each
    part is the rounding of what the earlier ones left. bf16 keeps 8 of fp32's 24 significant
    bits (and its exponent range), so three parts hold all of them."""
    parts, rest = [], g.float()
    for _ in range(pieces - 1):
        part = rest.to(dtype)
        parts.append(part)
        rest = rest - part.float()
    parts.append(rest.to(dtype))
    return parts


def deposit_grads(engine, grads: dict[nn.Parameter, torch.Tensor], pieces: int = 1) -> None:
    """DeepSpeed backwards whose parameter gradients add up to exactly ``grads``:
    d/dp sum(p * g) = g (a product with 1, exact in every dtype). With ``pieces`` > 1 a
    low-precision parameter's fp32 gradient goes in as that many parts (``split_fp32``), one
    backward each, inside one accumulation window of DeepSpeed's (``gradient_accumulation_steps``
    = pieces; the last engine.step() of the window is the optimizer's): DeepSpeed's fp32
    accumulation then holds the fp32 sum itself, where one backward would round it to bf16.
    Under ZeRO-2 every backward is reduced, so this costs ``pieces`` reductions per step."""
    parts = {p: split_fp32(g, p.dtype, pieces) if p.dtype in LOW_PRECISION else [g] + [None] * (pieces - 1)
             for p, g in grads.items()}
    for i in range(pieces):
        if hasattr(engine.optimizer, "clear_backward_seen_flag"):
            # What engine.forward would do; this backward has no engine.forward of its own.
            engine.optimizer.clear_backward_seen_flag()
        surrogate = sum((p * part[i].to(p.dtype)).sum() for p, part in parts.items() if part[i] is not None)
        engine.backward(surrogate, scale_wrt_gas=False)
        if i < pieces - 1:
            engine.step()  # inside the accumulation window: no update, counts the micro-step
