"""Reassembling full (single-device layout) tensors from TP shards and pipeline stages.

Used by the distributed tests (gathered gradients and parameters against a single-process
reference) and usable for a layout-independent export: ``gather_full(local, dims)`` turns
this rank's ``{name: shard}`` into ``{name: full tensor}`` on every rank of the tp x pp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.tp import param_shard_dim


def gather_tp(named: dict[str, torch.Tensor], dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Concatenates TP shards along each parameter's shard dimension (replicated ones as is)."""
    if dims.tp == 1:
        return dict(named)
    out = {}
    for name in sorted(named):  # the same order on every TP rank
        t = named[name].contiguous()
        dim = param_shard_dim(name)
        if dim is None:
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(dims.tp)]
        dist.all_gather(parts, t, group=dims.tp_group)
        out[name] = torch.cat(parts, dim=dim)
    return out


def gather_pp(named: dict[str, torch.Tensor], dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Merges the stages' dictionaries (CPU tensors); a replicated name keeps the first
    stage's copy."""
    if dims.pp == 1:
        return dict(named)
    mine = {k: v.detach().cpu() for k, v in named.items()}
    everyone: list = [None] * dims.pp
    dist.all_gather_object(everyone, mine, group=dims.pp_group)
    out: dict[str, torch.Tensor] = {}
    for part in everyone:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def gather_full(named: dict[str, torch.Tensor], dims: ParallelDims) -> dict[str, torch.Tensor]:
    return gather_pp({k: v.cpu() for k, v in gather_tp(named, dims).items()}, dims)
