"""The module GRPO samples, replays and evaluates with under ZeRO-3.

ZeRO-3 partitions every parameter over the data-parallel group and gathers it with a
collective at each submodule call; replicas that sample different numbers of positions would
then wait in different collectives. So sampling runs on a plain copy of this rank's stage and
TP shard (built once, outside DeepSpeed's hooks), refreshed from the partitions by one gather
of every parameter: a collective over the data-parallel group, which every rank calls at the
same point. Its memory is one more model shard per rank (what a hybrid engine pays to
generate from a ZeRO-3 model). Under model.lora the copy carries the same adapters
(parallel/sharding.py ``adapt_for_rank``) with the gathered base and adapter values, so it
merges W + s B A exactly as the learner does."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rlt_mega.config import ModelConfig
from rlt_mega.parallel.build import build_stage
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.sharding import adapt_for_rank, shard_for_rank


class SamplingCopy:
    def __init__(self, module: nn.Module, dims: ParallelDims, model_cfg: ModelConfig) -> None:
        self.module, self.dims, self.model_cfg = module, dims, model_cfg  # module: DeepSpeed's (partitioned)
        self._copy: Optional[nn.Module] = None

    def refresh(self) -> nn.Module:
        """The copy with the current parameters (collective over the data-parallel group)."""
        import deepspeed

        if self._copy is None:
            copy_ = shard_for_rank(build_stage(self.model_cfg, self.dims, seed=0), self.dims)  # values copied below
            if self.model_cfg.lora.enabled:  # the same adapters (model.lora): the same merged weights, by name
                adapt_for_rank(copy_, self.dims, seed=0)
            # requires_grad stays as on the engine's parameters (no gradient is ever computed
            # here): some kernels (F.rms_norm) take another path for a weight without it, and
            # samples must not depend on the ZeRO stage.
            self._copy = copy_.to(next(self.module.parameters()).dtype)
        mine = dict(self._copy.named_parameters())
        params = list(self.module.named_parameters())
        with torch.no_grad(), deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            for name, p in params:
                mine[name].copy_(p)
        return self._copy
