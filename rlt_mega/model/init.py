"""Parameter initialisation and closed-form block sizes shared by every model.arch (the RLT,
model/rlt.py, and the baselines, model/baselines.py): each parameter's initial value is a
function of (seed, parameter name) alone, so every layout builds the same model."""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch
from torch import nn

from rlt_mega.config import CheckpointingConfig, ModelConfig


def block_param_count(cfg: ModelConfig) -> int:
    """One shared block: attn_norm, q/k/v(+biases)/o, mlp_norm, gate/up/down."""
    d, Dh = cfg.d_model, cfg.head_dim
    q_out, kv_out = cfg.n_heads * Dh, cfg.n_kv_heads * Dh
    attn = d * q_out + 2 * d * kv_out + q_out * d + (q_out + 2 * kv_out if cfg.qkv_bias else 0)
    return 2 * d + attn + 3 * d * cfg.ffn_hidden


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a hash of (seed, name), the same in every layout."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def initial_value(cfg: ModelConfig, name: str, shape: tuple, seed: int) -> torch.Tensor:
    """The initial value of parameter ``name`` (its global name, as on one process), fp32 on the
    CPU, drawn from its own generator (parameter_seed): N(0, init_std) for projections; the
    projections that write into the residual stream (o, down, cross o, recur_proj) scaled by
    1/sqrt(number of residual branches a token passes): 2 * 2L for an RLT (2L blocks), 2L for a
    dense model, 2RL for a looped one (GPT-2 / Megatron convention). Embeddings N(0, embed_init_std): 1.0 when untied, so the token is not drowned
    by the recurrence input (a departure from GPT-2's 0.02, measured in docs/stability.md). The
    null memory and z_init are N(0, 1): they live where normalised vectors live. A tied
    lm_head (a pipeline's last stage holds a copy) takes the embedding's value."""
    if cfg.tie_embeddings and name == "lm_head.weight":
        name = "embed.weight"
    out = torch.empty(shape, dtype=torch.float32)
    g = torch.Generator().manual_seed(parameter_seed(seed, name))
    std = cfg.init_std
    residual_out = ("attn.o", "mlp.down", "recur_proj")
    if name.endswith("norm.weight"):
        return out.fill_(1.0)
    if name.endswith(".bias"):
        return out.zero_()
    if name in ("null_memory", "z_init"):
        return out.normal_(0.0, 1.0, generator=g)
    if name == "embed.weight":
        return out.normal_(0.0, cfg.embed_init_std, generator=g)
    if any(name.endswith(s + ".weight") or name == s + ".weight" for s in residual_out):
        return out.normal_(0.0, std / math.sqrt(residual_branches(cfg)), generator=g)
    return out.normal_(0.0, std, generator=g)


def residual_branches(cfg: ModelConfig) -> int:
    """Residual branches (attention + MLP per block) a token's stream passes."""
    blocks = {"rlt": 2 * cfg.n_layers, "dense": cfg.n_layers, "looped": cfg.loops * cfg.n_layers}[cfg.arch]
    return 2 * blocks


class ModelBase(nn.Module):
    """What every model.arch shares (``cfg``, ``final_norm``, ``lm_head``): its initialisation,
    its head and its checkpointing setting (``train.checkpointing``; the baselines, which have no
    recurrent decoder, checkpoint each block application under its encoder or any decoder mode)."""

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None, generator: Optional[torch.Generator] = None) -> None:
        """Every parameter from :func:`initial_value`: a function of (seed, parameter name) alone,
        so any rank can build exactly the parameters of its own pipeline stage and tensor shard,
        and a distributed model starts equal to the single-process model of the same seed
        whatever the layout. ``seed`` None: one drawn from ``generator`` (or torch's global
        generator, so that ``torch.manual_seed(s); RLT(cfg)`` stays reproducible)."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        for name, p in self.named_parameters():
            p.copy_(initial_value(self.cfg, name, tuple(p.shape), seed))

    def set_checkpointing(self, cfg: CheckpointingConfig) -> None:
        self.checkpointing = cfg

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """z: (..., d) -> logits (..., V) in fp32 (fp64 for a float64 model)."""
        logits = self.lm_head(self.final_norm(z))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
