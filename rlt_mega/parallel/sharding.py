"""This rank's part of the model: the single-device RLT cut to its pipeline stage (stage.py)
with its tensor-parallel shard (tp.py), on the rank's device."""

from __future__ import annotations

from rlt_mega.model.rlt import RLT
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.stage import prune_to_stage
from rlt_mega.parallel.tp import apply_tensor_parallel


def shard_for_rank(model: RLT, dims: ParallelDims) -> RLT:
    """The full single-device model (or, from an export, only this rank's stage) -> this rank's
    pipeline stage with its tensor-parallel shard, on the rank's device (in place). On the
    single-process layout: the model itself, moved to the device."""
    if dims.pp > 1:  # idempotent: a stage read from an export is pruned already
        prune_to_stage(model, dims.layers, dims.is_first_stage, dims.is_last_stage)
    apply_tensor_parallel(model, dims)
    return model.to(dims.device)
