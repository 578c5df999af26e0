"""Reading what DeepSpeed holds: the full gradients and fp32 master weights of this rank's
parameters, through DeepSpeed's own accessors where it offers them (``safe_get_full_grad``,
``safe_get_full_fp32_param``) and through the one optimizer that it does not cover
(FP16_UnfusedOptimizer, bf16 without ZeRO), and the whole single-device state dict
gathered from every rank (checkpoints consolidate it; the tests compare it)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.gather import gather_tp


class DeepSpeedState:
    """``ds``: the DeepSpeed engine; ``zero_stage`` and ``bf16`` say which optimizer it runs."""

    def __init__(self, ds, dims: ParallelDims, zero_stage: int, bf16: bool) -> None:
        self.ds, self.dims, self.zero_stage, self.bf16 = ds, dims, zero_stage, bf16

    @property
    def _through_deepspeed(self) -> bool:
        """DeepSpeed keeps the gradient / fp32 master apart from the module's parameter."""
        return self.zero_stage > 0 or self.bf16

    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter gradient after a backward (complete over the
        data-parallel partitions)."""
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, p in self.ds.module.named_parameters():
            g = safe_get_full_grad(p) if self._through_deepspeed else p.grad
            if g is not None:
                out[name] = g.detach().float().clone()
        return out

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter: the fp32 master weights where DeepSpeed keeps
        them (a collective over the data-parallel group under ZeRO-3: call on every rank)."""
        from deepspeed.utils import safe_get_full_fp32_param

        masters = self._unfused_masters()
        out = {}
        for name, p in self.ds.module.named_parameters():
            if id(p) in masters:
                out[name] = masters[id(p)].detach().clone()
            elif self._through_deepspeed:
                out[name] = safe_get_full_fp32_param(p).detach().clone()
            else:
                out[name] = p.detach().clone()
        return out

    def _unfused_groups(self) -> Optional[tuple[list, list]]:
        """bf16 without ZeRO runs DeepSpeed's FP16_UnfusedOptimizer: full fp32 masters
        (``fp32_groups``) parallel to the model's parameters (``fp16_groups``), which
        safe_get_full_fp32_param does not see. None for every other optimizer."""
        opt = self.ds.optimizer
        if self.zero_stage > 0 or not (hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups")):
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
        names = {id(p): n for n, p in self.ds.module.named_parameters()}
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
