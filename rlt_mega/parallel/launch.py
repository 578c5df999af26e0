"""The layout of a run, for as long as it runs: validated before any process group exists (so
a layout that does not fit fails on every rank at once, with the message ``rlt-mega plan``
gives for it), then built: a :meth:`ParallelDims.single` layout for one process, or every
process group of a launched world; the groups are released when the run ends. The process's
kernels are made deterministic first (train.deterministic, rlt_mega/determinism.py), before any
CUDA or NCCL work."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Optional

import torch.distributed as dist

from rlt_mega.config import Config
from rlt_mega.determinism import configure as configure_determinism
from rlt_mega.parallel.dims import ParallelDims, resolve_layout
from rlt_mega.parallel.engine import EngineConfig


def needs_process_groups(cfg: Config) -> bool:
    """A launcher started several processes, or the config asks for tensor/pipeline
    parallelism or ZeRO (DeepSpeed, even on one process)."""
    p = cfg.parallel
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or p.tp > 1 or p.pp > 1 or p.zero_stage > 0


@contextmanager
def launch(cfg: Config, engine: Optional[EngineConfig] = None) -> Iterator[ParallelDims]:
    """``engine``: the step's shape the layout must fit (default: train.* as written; GRPO
    passes the one it derives)."""
    step = engine or EngineConfig.from_train(cfg.train)
    configure_determinism(cfg.train.deterministic)
    if not needs_process_groups(cfg):
        resolve_layout(cfg.parallel, cfg.model, 1, step)  # the rules of every layout, on a world of one
        yield ParallelDims.single(cfg.model, cfg.train.device)
        return
    dims = ParallelDims.build(cfg.parallel, cfg.model, cfg.train.device, step, cfg.train.deterministic)
    try:
        yield dims
    finally:
        dims.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
