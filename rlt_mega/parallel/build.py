"""This rank's part of a fresh model, built without the rest of it.

The model is created on the meta device (no memory), pruned to the rank's pipeline stage, its
tensor-parallel layers swapped for megatron-core layers holding the rank's shard, and only
then given storage: every parameter takes ``model.init.initial_value``, a function of (seed,
parameter name) alone. So a rank holds its own shard plus, while a layer is being sharded, that
one layer's full weight (the embedding, V x d, is the largest), instead of the whole fp32
model (about 14 GB at rlt_48x48), and the distributed model still equals, parameter for
parameter, ``build_model(cfg, seed=seed)`` on one process in every layout (the distributed
tests compare them).
"""

from __future__ import annotations

import torch
from torch import nn

from rlt_mega.config import ModelConfig
from rlt_mega.model.init import initial_value
from rlt_mega.model.rlt import RLT, build_model
from rlt_mega.parallel.stage import prune_to_stage
from rlt_mega.parallel.tp import apply_tensor_parallel


@torch.no_grad()
def build_stage(cfg: ModelConfig, dims, seed: int) -> RLT:
    """This rank's pipeline stage with its tensor-parallel shard, initialised, on the CPU
    (dims: parallel.dims.ParallelDims)."""
    model = build_model(cfg, "meta")
    if dims.pp > 1:
        prune_to_stage(model, dims.layers, dims.is_first_stage, dims.is_last_stage)
    init = lambda name, shape: initial_value(cfg, name, shape, seed)  # noqa: E731
    apply_tensor_parallel(model, dims, init=init)
    materialise(model, init)
    return model


def materialise(model: nn.Module, init) -> None:
    """Gives every parameter still on the meta device storage on the CPU and ``init``'s value,
    keeping shared parameters shared (a tied lm_head on the stage that also embeds)."""
    done: dict[int, nn.Parameter] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for mod in model.modules():
        for leaf, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                value = init(names[id(p)], tuple(p.shape))
                done[id(p)] = nn.Parameter(value.to(p.dtype), requires_grad=p.requires_grad)
            mod._parameters[leaf] = done[id(p)]
    for name, b in model.named_buffers():
        if b.is_meta:  # pragma: no cover - the RLT registers no buffers
            raise ValueError(f"buffer {name} is on the meta device: build_stage cannot initialise it")
