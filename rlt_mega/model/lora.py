"""Low-rank adapters (``model.lora``): every target weight W of the model runs as the merged weight

    W' = W + s B A,   s = alpha / rank,   A (rank, in), B (out, rank), B = 0 at init,

the base W frozen (requires_grad False: not in the optimizer), only A and B trained.

One place. The adapter is a ``torch.nn.utils.parametrize`` parametrization of the target's
``weight``: whatever reads ``module.weight`` (the encoder's layers, ``kernels.fuse_layer`` and
``fuse_recurrence`` that build the decoder step's fused weights, the rollout's memory products,
rlt_mega/reference.py) reads the merged weight, an ordinary differentiable expression
(``torch.addmm(W, B, A, alpha=s)``), so nothing else changes:

- the decoder step (model/decoder.py, the sampler, the replay, the learner) runs products of the
  merged weight, built once per stack, i.e. once per parameter version: sampler and replay
  prepare the same products from the same parameters and stay ``torch.equal`` to mu, and the
  learner's log-probabilities are the sampler's (on-policy ratio exactly 1);
- the learner's backward gives the fused weights' deferred gradient dW (DenseDecode's output,
  accumulated over every position by the step), and autograd takes it through the fold and
  the addmm: dB = s dW A^T, dA = s B^T dW, two (out x in x rank) products per target and step,
  no per-position adapter GEMMs;
- one adapter per shared block: the encoder's and the decoder's uses of block i read the same
  parametrized weight, so its A and B get both gradients.

The merge runs in the base weight's dtype with autocast off (fp32 master weights: the merged
weight is rounded to the compute dtype once, where the base weight would be).

Names. Inside the model the parameters are those of ``parametrize`` (``blocks.0.attn.q.
parametrizations.weight.original`` for W, ``...weight.0.lora_A``); the checkpoint's files use the clean names
``blocks.0.attn.q.lora_A`` (parallel/adapter_files.py: ``adapter_state``, ``merged_state``). The
closed-form count of the adapters' parameters is the cost model's (cost/params.py)."""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from rlt_mega.config import LORA_TARGETS, LoraConfig


class LowRank(nn.Module):
    """The parametrization W -> W + s B A of one target weight (out, in) (this rank's shard of
    it on a sharded layer). ``replicate``: how the factor replicated across the shards
    enters the product (its gradient summed over them: model/dense_decode.py ``replicator``);
    ``shard_dim`` says which: 0 (a column-parallel layer: A replicated, B split with W's rows),
    1 (row-parallel: B replicated, A split with W's columns), None (one device)."""

    def __init__(self, out_features: int, in_features: int, rank: int, scale: float, dtype: torch.dtype,
                 device: torch.device, shard_dim: Optional[int] = None,
                 replicate: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        super().__init__()
        self.scale, self.shard_dim = scale, shard_dim
        self.replicate = replicate if replicate is not None and shard_dim is not None else _identity
        self.lora_A = nn.Parameter(torch.zeros(rank, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A.to(w.dtype), self.lora_B.to(w.dtype)
        if self.shard_dim == 0:
            a = self.replicate(a)
        elif self.shard_dim == 1:
            b = self.replicate(b)
        with torch.autocast(device_type=w.device.type, enabled=False):
            return torch.addmm(w, b, a, alpha=self.scale)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def target_of(name: str) -> Optional[str]:
    """The model.lora.targets name of module ``name`` (``blocks.3.attn.q`` -> "q",
    ``cross.0.attn.k`` -> "cross_k", ``recur_proj``), None for a module no target names."""
    parts = name.split(".")
    if name == "recur_proj":
        return "recur_proj"
    if len(parts) == 4 and parts[0] in ("blocks", "dec_blocks") and parts[2] in ("attn", "mlp"):
        return parts[3] if parts[3] in LORA_TARGETS else None
    if len(parts) == 4 and parts[0] == "cross" and parts[2] == "attn":
        return "cross_" + parts[3]
    return None


def targets(model: nn.Module, cfg: LoraConfig) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every module of ``model`` (an RLT or a pipeline stage of one) that
    model.lora.targets names, in the model's order."""
    wanted = set(cfg.targets)
    for name, module in model.named_modules():
        if target_of(name) in wanted and isinstance(getattr(module, "weight", None), torch.Tensor):
            yield name, module


def adapter_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/lora/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


# (dimension the module's weight is split along, this rank's index, the number of shards) of a
# module name, None for a weight held whole (given by parallel/sharding.py for a sharded model)
Split = Callable[[str], Optional[tuple[int, int, int]]]


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0, split: Optional[Split] = None,
               replicate: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> nn.Module:
    """Adds the adapters of ``cfg`` to ``model`` in place and freezes everything else. A starts
    as peft's (kaiming-uniform, bound 1/sqrt(in)), drawn whole from a generator seeded by (seed,
    the module's name) and cut to this rank's shard, so every layout starts from the adapters of
    one process; B = 0, so the model computes what the base does (bit for bit). ``split``,
    ``replicate``: a sharded layer's adapters (see :class:`LowRank`). Returns the model."""
    if not cfg.enabled:
        raise ValueError("apply_lora with model.lora.rank=0: there are no adapters to add")
    if any(parametrize.is_parametrized(m) for m in model.modules()):
        raise ValueError("the model already has adapters (or another parametrization): apply them once")
    model.requires_grad_(False)
    found = list(targets(model, cfg))
    if not found:
        raise ValueError(f"model.lora.targets={cfg.targets} names no module of this model")
    for name, module in found:
        w = module.weight
        out_f, in_f = w.shape
        dim, index, shards = (split(name) if split is not None else None) or (None, 0, 1)
        full_in = in_f * shards if dim == 1 else in_f
        adapter = LowRank(out_f, in_f, cfg.rank, cfg.scale, torch.promote_types(w.dtype, torch.float32), w.device,
                          dim, replicate)
        g = torch.Generator().manual_seed(adapter_seed(seed, name))
        bound = 1.0 / math.sqrt(full_in)
        with torch.no_grad():
            a = torch.rand(cfg.rank, full_in, generator=g, dtype=torch.float64) * (2 * bound) - bound
            adapter.lora_A.copy_(a[:, index * in_f:(index + 1) * in_f] if dim == 1 else a)
        parametrize.register_parametrization(module, "weight", adapter, unsafe=True)
        module.parametrizations.weight.original.requires_grad_(False)
    return model


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LowRank) for m in model.modules())


def adapters(model: nn.Module) -> Iterator[tuple[str, LowRank]]:
    """(target module's name, its LowRank) of every adapter of ``model``."""
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module, "weight"):
            for p in module.parametrizations.weight:
                if isinstance(p, LowRank):
                    yield name, p
