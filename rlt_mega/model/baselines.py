"""The two baselines an RLT is compared against, trained by the same code (model.arch):

``dense``   the Llama/Qwen2 layout: ``embed``, the L shared blocks, ``final_norm``, ``lm_head``.
            Parameter names are the RLT's (``blocks.i.attn.q.weight`` ...), so a Llama/Qwen2
            checkpoint imported by checkpoint_tools/hf_import.py trains as its dense self, and a
            dense model exports as a standard Llama/Qwen2 checkpoint (checkpoint_tools/hf_dense.py).
``looped``  the same L blocks applied R = model.loops times per token, weights shared across
            loops (Ouro, Huginn): R * L logical layers of L layers' parameters. Each (loop, layer)
            has its own keys and values (the loop-r input of layer i differs from the loop-r'
            one), so its K/V cache holds R * L layers, slot ``r * L + i``.

Both are parallel over positions: every logical layer is one causal batch over the sequence,
with no recurrence in time (the RLT's decoder is what is recurrent). So the "encoder" pieces of
the RLT (one block over a causal batch, with an optional K/V cache for incremental decoding)
are all they need.

Per token the dense model runs L blocks, the looped R * L, the RLT L encoder + L decoder blocks
(the decoder's with cross-attention): rlt_mega/cost/flops.py counts each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlt_mega.config import CheckpointingConfig, ConfigError, ModelConfig
from rlt_mega.model.cache import KVCache
from rlt_mega.model.init import ModelBase, block_param_count
from rlt_mega.model.layers import Block, RMSNorm, Rotary

if TYPE_CHECKING:  # the schedule's rows are passed in (a layout the model reads); model/ never imports them
    from rlt_mega.schedule.dense import DenseRows


class DenseLM(ModelBase):
    """``arch: dense`` (loops = 1) and ``arch: looped`` (loops = R). ``forward(tokens)`` is the
    training schedule; ``forward(tokens, cache, start)`` the incremental one (prefill, then one
    token at a time) of a plain K/V-cache decoder."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch not in ("dense", "looped"):
            raise ValueError(f"DenseLM builds model.arch dense or looped, not {cfg.arch!r} (model.rlt.RLT)")
        self.cfg = cfg
        d, Dh = cfg.d_model, cfg.head_dim
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.blocks = nn.ModuleList(
            Block(d, cfg.n_heads, cfg.n_kv_heads, Dh, cfg.ffn_hidden, cfg.norm_eps, cfg.qkv_bias)
            for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(Dh, cfg.max_seq_len, cfg.rope_theta)
        self.checkpointing = CheckpointingConfig()
        if self.embed.weight.device.type != "meta":
            self.init_weights()

    @property
    def loops(self) -> int:
        return self.cfg.loops

    @property
    def num_cache_layers(self) -> int:
        """K/V layers of a cache: one per (loop, layer)."""
        return self.cfg.loops * self.cfg.n_layers

    def _checkpointed(self) -> bool:
        ck = self.checkpointing
        return (ck.encoder or ck.decoder != "none") and torch.is_grad_enabled()

    def layer(self, i: int, h: torch.Tensor, start: int, cache: Optional[KVCache], slot: int) -> torch.Tensor:
        """Block i over h (B, n, d) at positions [start, start + n) (``Block.causal``); with a
        cache its K/V go to layer ``slot`` of the cache."""
        return self.blocks[i].causal(h, self.rotary, start, cache, slot)

    def hidden(self, tokens: torch.Tensor, cache: Optional[KVCache] = None, start: int = 0) -> torch.Tensor:
        """tokens (B, n) at positions [start, start + n) -> final hidden states (B, n, d)."""
        if cache is not None and torch.is_grad_enabled():
            raise RuntimeError("a K/V cache is for decoding without autograd (torch.no_grad()); training "
                               "runs forward(tokens) over the whole sequence")
        h = self.embed(tokens)
        L = self.cfg.n_layers
        for r in range(self.cfg.loops):
            for i in range(L):
                if self._checkpointed():
                    h = checkpoint(self.layer, i, h, start, None, 0, use_reentrant=False,
                                   preserve_rng_state=False)  # the model draws no random numbers
                else:
                    h = self.layer(i, h, start, cache, r * L + i)
        return h

    def new_cache(self, capacity: int) -> KVCache:
        """An empty K/V cache for ``capacity`` positions, one layer per (loop, layer)."""
        return KVCache(self.num_cache_layers, capacity)

    def forward(self, tokens: torch.Tensor, cache: Optional[KVCache] = None, start: int = 0,
                rows: Optional[DenseRows] = None, hidden: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), fp32; logits_t is the distribution of x_{t+1}
        (``hidden``: the head's input z (B, T, d), as RLT.forward's).
        ``rows`` (schedule/dense.py): with compaction the head runs at the
        completion positions only, as RLT.forward's (0 elsewhere); the blocks run every position
        (they are parallel over positions: nothing to skip but padding)."""
        z = self.hidden(tokens, cache, start)
        if hidden:
            return z
        return self.head(z) if rows is None else rows.head(self.head, z)


def dense_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Closed-form parameter counts of DenseLM(cfg) by group (the looped model has the dense
    model's parameters: its loops share them)."""
    d, V = cfg.d_model, cfg.vocab_size
    counts = {
        "embed": V * d,
        "lm_head": 0 if cfg.tie_embeddings else V * d,
        "blocks": cfg.n_layers * block_param_count(cfg),
        "final_norm": d,
    }
    counts["total"] = sum(counts.values())
    return counts


def require_rlt(cfg: ModelConfig, command: str) -> None:
    """The sampler, its replay and the row schedules are the RLT's (rollout/): the
    baselines train (pretrain, SFT) and export, and ``command`` refuses them by name."""
    if cfg.arch != "rlt":
        raise ConfigError(f"{command} runs the RLT sampler (rollout/, with exact replay), which model.arch="
                          f"{cfg.arch} does not have: pretrain and sft train the {cfg.arch} baseline; to sample "
                          "from it, export it (`rlt-mega export`: a dense model becomes a standard "
                          "Llama/Qwen2 checkpoint) and generate with transformers, or use model.arch=rlt")
