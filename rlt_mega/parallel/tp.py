"""Tensor parallelism: a plan (module-name pattern -> megatron-core layer kind) applied to a
single-device RLT.

Each matched ``nn.Linear`` / ``nn.Embedding`` is replaced by a megatron-core layer whose shard
is copied from the single-device weights, so a TP model equals the model built with the same
seed (the test checks logits and every gathered gradient against it). The model code reads
head counts from projection output sizes, so a column shard of q/k/v simply holds
``n_heads / tp`` (``n_kv_heads / tp``) whole heads: heads are contiguous blocks of rows and
GQA groups stay on one rank because both splits are contiguous.

Norms, ``recur_proj``, ``null_memory`` and ``z_init`` stay replicated (every TP rank computes
them on identical inputs, so their gradients agree without communication).

CPU/gloo constraints (docs/engines.md): ``use_cpu_initialization=True``, no sequence parallel,
``gather_output=False`` and ``input_is_parallel=True`` only, no megatron RNG tracker or
megatron checkpointing (the model uses torch.utils.checkpoint, non-reentrant).
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from rlt_mega.loss import IGNORE, Vocab
from rlt_mega.model.dense_decode import Decoder
from rlt_mega.parallel.dims import ParallelDims

# Module-name pattern -> layer kind. "column": output features split (gather_output=False);
# "row": input features split (input_is_parallel=True; output all-reduced); "vocab": embedding
# rows split; "vocab_head": lm_head as a column-parallel layer whose local output is a vocab
# shard (the loss is vocab_parallel_cross_entropy on it).
TP_TABLE: dict[str, str] = {
    "embed": "vocab",
    "blocks.*.attn.q": "column", "blocks.*.attn.k": "column", "blocks.*.attn.v": "column",
    "blocks.*.attn.o": "row",
    "blocks.*.mlp.gate": "column", "blocks.*.mlp.up": "column", "blocks.*.mlp.down": "row",
    "dec_blocks.*.attn.q": "column", "dec_blocks.*.attn.k": "column", "dec_blocks.*.attn.v": "column",
    "dec_blocks.*.attn.o": "row",
    "dec_blocks.*.mlp.gate": "column", "dec_blocks.*.mlp.up": "column", "dec_blocks.*.mlp.down": "row",
    "cross.*.attn.q": "column", "cross.*.attn.k": "column", "cross.*.attn.v": "column",
    "cross.*.attn.o": "row",
    "lm_head": "vocab_head",
}

# Which weight dimension each kind splits (for sharding here and gathering in gather.py).
SHARD_DIM = {"column": 0, "vocab_head": 0, "vocab": 0, "row": 1}


def tp_kind(name: str, table: dict[str, str] = TP_TABLE) -> Optional[str]:
    for pattern, kind in table.items():
        if fnmatch.fnmatchcase(name, pattern):
            return kind
    return None


def param_shard_dim(param_name: str, table: dict[str, str] = TP_TABLE) -> Optional[int]:
    """The dimension along which a parameter is split across TP ranks (None: replicated).
    A column layer's bias is split with its rows; a row layer's bias is replicated."""
    module, _, leaf = param_name.rpartition(".")
    kind = tp_kind(module, table)
    if kind is None:
        return None
    if leaf == "bias":
        return 0 if kind in ("column", "vocab_head") else None
    return SHARD_DIM[kind]


def _megatron_config(dims: ParallelDims, dtype: torch.dtype):
    from megatron.core import ModelParallelConfig

    return ModelParallelConfig(tensor_model_parallel_size=dims.tp, use_cpu_initialization=True,
                               perform_initialization=False, params_dtype=dtype, sequence_parallel=False,
                               gradient_accumulation_fusion=False)


def _no_init(_: torch.Tensor) -> None:  # weights are copied from the single-device model
    return None


def _flatten(x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """megatron's weight-gradient GEMM flattens only 3-D inputs; we feed it 2-D rows."""
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


# megatron's layers put "_extra_state": None into their state dicts (a hook for Transformer
# Engine); DeepSpeed's universal-checkpoint converter (checkpoint/ds_to_universal.py) copies every
# module-state entry as a tensor and fails on it. Our layers keep no extra state: torch's default
# get_extra_state leaves the entry out of what we save. megatron's set_extra_state (which ignores
# it) stays: its load pre-hook adds the entry to every state dict loaded, and without a setter a
# strict load would call it unexpected.
_NO_EXTRA_STATE = nn.Module.get_extra_state


def _make_layers():
    """The megatron layer adapters, defined lazily so importing this module does not import
    megatron-core (its import alone takes seconds)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    class ColumnLinear(ColumnParallelLinear):
        """ColumnParallelLinear returning a tensor (megatron returns (out, bias))."""

        get_extra_state = _NO_EXTRA_STATE

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out / tp)
            flat, lead = _flatten(x)
            out, _ = super().forward(flat)
            return out.reshape(*lead, out.shape[-1])

    class RowLinear(RowParallelLinear):
        """RowParallelLinear on an input already split by the column layer before it."""

        get_extra_state = _NO_EXTRA_STATE

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in / tp) -> (..., d_out)
            flat, lead = _flatten(x)
            out, _ = super().forward(flat)
            return out.reshape(*lead, out.shape[-1])

    class VocabEmbedding(VocabParallelEmbedding):
        pass

    return ColumnLinear, RowLinear, VocabEmbedding


def _shard(weight: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return weight.detach().chunk(size, dim=dim)[rank].clone()


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


InitFn = Callable[[str, tuple], torch.Tensor]  # (parameter name, full shape) -> full initial value


def _full(mod: nn.Module, name: str, leaf: str, init: Optional[InitFn]) -> torch.Tensor:
    """The whole (unsharded) weight or bias of a planned layer: its own, or for a layer still on
    the meta device, ``init``'s value (one layer's full tensor at a time)."""
    p = getattr(mod, leaf)
    if not p.is_meta:
        return p.detach()
    if init is None:
        raise ValueError(f"{name}.{leaf} is on the meta device: apply_tensor_parallel needs an init function")
    return init(f"{name}.{leaf}", tuple(p.shape))


def _shard_layer(name: str, mod: nn.Module, kind: str, dims: ParallelDims, init: Optional[InitFn],
                 layers) -> nn.Module:
    """The megatron-core layer of ``kind`` holding this rank's shard of ``mod``'s weights."""
    ColumnLinear, RowLinear, VocabEmbedding = layers
    dtype = next(mod.parameters()).dtype
    cfg = _megatron_config(dims, dtype)
    if kind == "vocab":
        assert isinstance(mod, nn.Embedding), f"TP table: {name} is {type(mod).__name__}, expected nn.Embedding"
        new = VocabEmbedding(mod.num_embeddings, mod.embedding_dim, init_method=_no_init, config=cfg,
                             tp_group=dims.tp_group)
        new.weight.copy_(_shard(_full(mod, name, "weight", init), 0, dims.tp_rank, dims.tp))
    else:
        assert isinstance(mod, nn.Linear), f"TP table: {name} is {type(mod).__name__}, expected nn.Linear"
        bias = mod.bias is not None
        if kind in ("column", "vocab_head"):
            new = ColumnLinear(mod.in_features, mod.out_features, config=cfg, init_method=_no_init, bias=bias,
                               gather_output=False, tp_group=dims.tp_group)
            new.weight.copy_(_shard(_full(mod, name, "weight", init), 0, dims.tp_rank, dims.tp))
            if bias:
                new.bias.copy_(_shard(_full(mod, name, "bias", init), 0, dims.tp_rank, dims.tp))
        else:
            new = RowLinear(mod.in_features, mod.out_features, config=cfg, init_method=_no_init, bias=bias,
                            input_is_parallel=True, skip_bias_add=False, tp_group=dims.tp_group)
            new.weight.copy_(_shard(_full(mod, name, "weight", init), 1, dims.tp_rank, dims.tp))
            if bias:
                new.bias.copy_(_full(mod, name, "bias", init))
    return new


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, dims: ParallelDims, table: dict[str, str] = TP_TABLE,
                          init: Optional[InitFn] = None) -> nn.Module:
    """Swaps the tabled layers of ``model`` (in place) for megatron-core layers holding this
    rank's shard of the current weights, or for layers on the meta device of ``init``'s values
    (then on the CPU). Returns the model. A no-op when tp == 1, and for layers swapped already."""
    if dims.tp == 1:
        return model
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    layers = _make_layers()
    # An lm_head tied to embed shares one Parameter; after sharding both hold the same vocab
    # rows (both split dim 0 into contiguous blocks), and we tie the shards again below.
    tied = getattr(model, "lm_head", None) is not None and getattr(model, "embed", None) is not None \
        and model.lm_head.weight is model.embed.weight
    targets = [(name, mod, tp_kind(name, table)) for name, mod in model.named_modules()]
    for name, mod, kind in targets:
        if kind is None or getattr(mod, "is_tp_shard", False):
            continue
        new = _shard_layer(name, mod, kind, dims, init, layers)
        new.is_tp_shard = True
        new.to(mod.weight.device if not mod.weight.is_meta else "cpu")
        # megatron marks shards only when it initialises them itself (perform_initialization);
        # DeepSpeed's gradient norm counts a parameter on every TP rank only when it is marked.
        # (A column layer's bias is marked by megatron already.)
        set_tensor_model_parallel_attributes(new.weight, True, SHARD_DIM[kind], 1)
        for p in new.parameters():
            p.requires_grad_(True)
        _replace(model, name, new)
    if tied:
        model.lm_head.weight = model.embed.weight
    # The decoder step (model/decoder.py) reads these shards' weights directly and calls the sum
    # over the tensor-parallel ranks where megatron's layers communicate: after each row-parallel
    # product (o, cross o, down) and on the input gradient of each column-parallel one (q/k/v,
    # cross q, gate/up). The sharded model gets a decoder built with it, as it got its layers.
    if hasattr(model, "decoder"):
        model.decoder = Decoder(all_reduce=tp_all_reduce(dims), static=model.decoder.static)
    if hasattr(model, "checkpoint_shards"):
        model.checkpoint_shards = CheckpointShards(dims.tp_group, dims.tp, dims.tp_rank)
    return model


def tp_all_reduce(dims: ParallelDims):
    """In-place sum over the tensor-parallel group (no autograd)."""
    group = dims.tp_group

    def all_reduce(x: torch.Tensor) -> None:
        torch.distributed.all_reduce(x, group=group)

    return all_reduce


class CheckpointShards:
    """Where a checkpointed encoder block keeps its input under tensor parallelism: the block's
    input is the same on every TP rank, so each rank keeps 1/tp of it (flattened, the last
    shard padded) and the recompute all-gathers it again (megatron's
    ``distribute_saved_activations``); the encoder's saved activations shrink tp times for one
    all-gather per block in the forward, one in the recompute and one of the input gradient.
    Gradients are bit for bit those of the whole input: the input gradient is the same on every
    TP rank (as _GatherVocab's), each keeps its slice and the all-gather puts them together.
    The first block's input is the caller's (the embeddings, which the decoder reads too, or
    what the stage received) and stays whole: its gradient sums the block's and the caller's
    other uses in autograd's order, which a shard would change."""

    def __init__(self, group, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def keep(self, full: torch.Tensor) -> torch.Tensor:
        """A tensor every TP rank holds whole -> this rank's shard (a new tensor)."""
        return _KeepShard.apply(full, self)

    def join(self, shard: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The shards of the TP ranks -> the whole tensor of ``shape``."""
        return _JoinShards.apply(shard, self, shape)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        flat = full.reshape(-1)
        n = -(-flat.numel() // self.size)
        part = flat[self.rank * n:(self.rank + 1) * n]
        return F.pad(part, (0, n - part.numel())) if part.numel() < n else part.clone()

    def gather(self, shard: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        out = torch.empty(shard.numel() * self.size, dtype=shard.dtype, device=shard.device)
        torch.distributed.all_gather(list(out.chunk(self.size)), shard.contiguous(), group=self.group)
        return out[:shape.numel()].view(shape)


class _KeepShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full: torch.Tensor, shards: CheckpointShards) -> torch.Tensor:
        ctx.shards, ctx.shape = shards, full.shape
        return shards.slice(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.shards.gather(grad, ctx.shape), None


class _JoinShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor, shards: CheckpointShards, shape: torch.Size) -> torch.Tensor:
        ctx.shards = shards
        return shards.gather(shard, shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.shards.slice(grad), None, None


# ------------------------------------------------------------------------------------------
# The loss and the logits of a vocab-parallel head
# ------------------------------------------------------------------------------------------

def token_losses(logits: torch.Tensor, targets: torch.Tensor, tp: int) -> torch.Tensor:
    """Per-token cross-entropy: logits (..., V / tp) fp32 vocab shard, targets (...) with
    IGNORE for positions without a target -> (...) fp32, zero where ignored.

    Under TP the logits are consumed in place by megatron's vocab_parallel_cross_entropy: do
    not reuse them afterwards."""
    mask = targets != IGNORE
    if tp == 1:
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none",
                                 ignore_index=IGNORE).view(targets.shape)
        return losses
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    losses = vocab_parallel_cross_entropy(logits, targets.masked_fill(~mask, 0))
    return losses * mask


def gather_vocab(logits: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """(..., V / tp) vocab shard -> (..., V) on every TP rank (no autograd)."""
    if dims.tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(dims.tp)]
    torch.distributed.all_gather(parts, logits.contiguous(), group=dims.tp_group)
    return torch.cat(parts, dim=-1)


class _GatherVocab(torch.autograd.Function):
    """All-gather of vocab shards along the last dimension; backward keeps this rank's slice of
    the incoming gradient. Right when every TP rank computes the same function of the full
    logits (the gradient of each full row is then the same on every rank), which is how the
    GRPO loss uses it: megatron's gather_from_tensor_model_parallel_region, without its CUDA
    assumptions."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group, size: int, rank: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(size)]
        torch.distributed.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo = ctx.rank * ctx.width
        return grad[..., lo:lo + ctx.width].contiguous(), None, None, None


def gather_vocab_grad(logits: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """(..., V / tp) vocab shard -> (..., V), differentiable (see _GatherVocab)."""
    if dims.tp == 1:
        return logits
    return _GatherVocab.apply(logits, dims.tp_group, dims.tp, dims.tp_rank)


class ShardedVocab(Vocab):
    """The loss contract's vocabulary operations (rlt_mega/loss.py) on this rank's vocab shard
    (..., V / tp) of a tensor-parallel head: the cross-entropy by megatron's
    vocab_parallel_cross_entropy on the shard, without gathering the logits; whole rows, when a
    loss needs them, by a differentiable all-gather."""

    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_vocab_grad(logits, self.dims)

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_losses(logits, targets, self.dims.tp).sum()  # (b, T) -> ()
