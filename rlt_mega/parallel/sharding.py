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


def adapt_for_rank(model: RLT, dims: ParallelDims, seed: int) -> RLT:
    """This rank's part of the model (``shard_for_rank``'s, in place) with model.lora's adapters
    (model/lora.py), the base frozen: under tensor parallelism each adapter is split like its
    layer (column-parallel: A replicated, B split with W's rows; row-parallel: the transpose), the
    replicated factor's gradient summed over the shards as megatron does for a replicated norm."""
    from rlt_mega.model.dense_decode import replicator
    from rlt_mega.model.lora import adapters, apply_lora
    from rlt_mega.parallel.tp import SHARD_DIM, tp_kind

    def split(name: str):
        kind = tp_kind(name) if dims.tp > 1 else None
        return None if kind is None else (SHARD_DIM[kind], dims.tp_rank, dims.tp)

    apply_lora(model, model.cfg.lora, seed, split, replicator(model.decoder.all_reduce))
    if dims.tp > 1:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for _, a in adapters(model):  # the split factor counts once per shard in the gradient norm
            split_factor = a.lora_B if a.shard_dim == 0 else a.lora_A
            set_tensor_model_parallel_attributes(split_factor, True, a.shard_dim, 1)
    return model
