"""The Recurrent Looped Transformer (docs/design.md, "The model") on one device.

Encoder (causal, all known tokens at once)::

    h^0 = embed[x];  h^i = block_i(h^{i-1});  m = memory_norm(h^L)

Decoder (recurrent in t)::

    u = embed[x_t] + recur_proj(recur_norm(z_{t-1}))        z_{-1} = z_init
    for i in 0..L-1:
        u = u + SelfAttn_i(attn_norm_i(u))      over the decoder's own K/V of positions <= t
        u = u + Cross_i(cross_norm_i(u))        over {null_memory} + {m_s : s < vis(t)}
        u = u + MLP_i(mlp_norm_i(u))
    z_t = u;  logits_t = lm_head(final_norm(z_t))

The pieces are public so that schedules can compose them: ``encode`` (one batch, or a chunk
with an encoder cache), ``memory_kv``, ``head``, and ``decoder``: the one decoder step every
schedule runs (model/dense_decode.py's ``Decoder``: the dense schedule's decode with full BPTT,
a pipeline stage's positions, the rollout's and the replay's steps). ``forward`` is the dense
schedule: the encoder in one causal batch, the decoder position by position, full BPTT. Every
method that touches blocks takes an optional ``layers`` range so a pipeline stage runs only its
own. The decoder written plainly with these modules, the executable reference the tests compare
the step with, is rlt_mega/reference.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlt_mega.config import CheckpointingConfig, ModelConfig
from rlt_mega.model.baselines import DenseLM, dense_param_counts
from rlt_mega.model.cache import KVCache, MemoryKV
from rlt_mega.model.documents import Documents
from rlt_mega.model.init import ModelBase, block_param_count
from rlt_mega.model.dense_decode import Decoder
from rlt_mega.model.layers import Block, CrossBlock, RMSNorm, Rotary

if TYPE_CHECKING:  # the schedule's rows are passed in (a layout the model reads); model/ never imports them
    from rlt_mega.schedule.dense import DenseRows


def vis(t: int, C: int) -> int:
    """Number of memory positions visible to the decoder at position t: C * floor((t+1)/C).
    A function of the position alone (never of where a prompt ends)."""
    return C * ((t + 1) // C)


class RLT(ModelBase):
    def __init__(self, cfg: ModelConfig, decoder: Optional[Decoder] = None) -> None:
        """decoder: how the decoder step runs (its reduce over shards, its capture-ready form);
        parallel/ passes one for a sharded model (default: one device, eager)."""
        super().__init__()
        self.cfg = cfg
        d, L, Dh = cfg.d_model, cfg.n_layers, cfg.head_dim
        self.embed = nn.Embedding(cfg.vocab_size, d)

        def block() -> Block:
            return Block(d, cfg.n_heads, cfg.n_kv_heads, Dh, cfg.ffn_hidden, cfg.norm_eps, cfg.qkv_bias)

        self.blocks = nn.ModuleList(block() for _ in range(L))
        # share_weights=False gives the decoder its own copies (an ablation, same code path).
        self.dec_blocks = None if cfg.share_weights else nn.ModuleList(block() for _ in range(L))
        self.cross = nn.ModuleList(CrossBlock(d, cfg.n_heads, cfg.n_kv_heads, Dh, cfg.norm_eps) for _ in range(L))
        self.memory_norm = RMSNorm(d, cfg.norm_eps)
        self.null_memory = nn.Parameter(torch.empty(d))
        self.recur_norm = RMSNorm(d, cfg.norm_eps)
        self.recur_proj = nn.Linear(d, d, bias=False)
        self.z_init = nn.Parameter(torch.empty(d))
        self.final_norm = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(Dh, cfg.max_seq_len, cfg.rope_theta)
        self.checkpointing = CheckpointingConfig()
        # Where a checkpointed encoder block keeps its input: whole here; a sharded model is given
        # (keep, join) that keeps this rank's part of it and joins the parts for the recompute.
        self.checkpoint_shards = None
        self.decoder = Decoder() if decoder is None else decoder
        if self.null_memory.device.type != "meta":
            self.init_weights()

    # ------------------------------------------------------------------ set-up
    def decoder_block(self, i: int) -> Block:
        return self.blocks[i] if self.dec_blocks is None else self.dec_blocks[i]

    def _layers(self, layers: Optional[Sequence[int]]) -> Sequence[int]:
        return range(self.cfg.n_layers) if layers is None else layers

    # ------------------------------------------------------------------ encoder
    def encoder_layer(self, i: int, h: torch.Tensor, start: int, cache: Optional[KVCache],
                      documents: Optional[Documents] = None) -> torch.Tensor:
        """h: (B, n, d) at positions [start, start + n) through block i (``Block.causal``): with a
        cache (sampling / replay) also over the cached prefix; with documents (packed rows, or a
        batch's prompt pack, schedule/prompt_pack.py) in the layout's own positions."""
        return self.blocks[i].causal(h, self.rotary, start, cache, i, documents)

    def encode(self, h: torch.Tensor, start: int = 0, cache: Optional[KVCache] = None,
               layers: Optional[Sequence[int]] = None, documents: Optional[Documents] = None) -> torch.Tensor:
        """Runs encoder layers over h (B, n, d) (the embeddings at the first stage)."""
        if cache is not None and torch.is_grad_enabled() and h.requires_grad:
            raise RuntimeError("encoder caches are for the no-grad schedules (rollout, replay); "
                               "the dense schedule encodes the whole sequence in one batch")
        if documents is not None and (cache is not None or start != 0 or documents.shape != tuple(h.shape[:2])):
            raise ValueError(f"packed documents {documents.shape} are for the dense schedule over whole rows "
                             f"(start 0, no cache), got h {tuple(h.shape[:2])} at start {start}")
        first = h
        for i in self._layers(layers):
            if not (self.checkpointing.encoder and torch.is_grad_enabled()):
                h = self.encoder_layer(i, h, start, cache, documents)
            elif self.checkpoint_shards is None or h is first:  # the caller holds the first input
                h = checkpoint(self.encoder_layer, i, h, start, cache, documents, use_reentrant=False,
                               preserve_rng_state=False)  # the model draws no random numbers
            else:  # the block's input kept as this rank's shard, joined again for the recompute
                h = checkpoint(self._encoder_layer_from_shard, i, self.checkpoint_shards.keep(h), h.shape, start,
                               cache, documents, use_reentrant=False, preserve_rng_state=False)
        return h

    def _encoder_layer_from_shard(self, i: int, shard: torch.Tensor, shape: torch.Size, start: int,
                                  cache: Optional[KVCache], documents: Optional[Documents]) -> torch.Tensor:
        return self.encoder_layer(i, self.checkpoint_shards.join(shard, shape), start, cache, documents)

    # ------------------------------------------------------------------ memory and decoder
    def memory_kv(self, m: torch.Tensor, layers: Optional[Sequence[int]] = None) -> MemoryKV:
        """Dense schedule: cross K/V of {null} + m (B, T, d) for every layer, with autograd (the
        decoder's autograd Function takes them as inputs and returns their gradients)."""
        mem = MemoryKV(self.cfg.n_layers, capacity=1 + m.shape[1])
        slots = torch.cat([self.null_memory.to(m.dtype).expand(m.shape[0], 1, -1), m], dim=1)
        for i in self._layers(layers):
            mem.set(i, *self.cross[i].attn.kv(slots))
        return mem

    def initial_state(self, batch_size: int) -> torch.Tensor:
        return self.z_init.expand(batch_size, -1)

    # ------------------------------------------------------------------ dense schedule
    def decode_dense(self, emb: torch.Tensor, mem: MemoryKV, z0: Optional[torch.Tensor] = None,
                     documents: Optional[Documents] = None, rows: Optional[DenseRows] = None) -> torch.Tensor:
        """Decoder over every position of emb (B, T, d), full BPTT -> z (B, T, d): the decoder
        step (``self.decoder``, model/dense_decode.py) position by position. documents: packed
        rows (model/documents.py); rows: the positions each row needs (schedule/dense.py)."""
        return self.decoder.dense(self, emb, mem, z0, rows, documents)

    def dense_memory(self, emb: torch.Tensor, documents: Optional[Documents] = None,
                     rows: Optional[DenseRows] = None) -> torch.Tensor:
        """The dense schedule's memory m = memory_norm(encoder(emb)), (B, T, d). With rows whose
        groups share prefixes (the learner) each group's prefix is encoded once and each row's
        own tokens after it (schedule/prompt_pack.py); m is then 0 past row b's rows.lengths[b]
        positions, which its decoder never reads."""
        pack = None if rows is None else rows.encoder_pack(emb.shape[1], emb.device, documents)
        if pack is None:
            return self.memory_norm(self.encode(emb, documents=documents))
        return pack.unpack(self.memory_norm(self.encode(pack.pack(emb), documents=pack)))

    def forward(self, tokens: torch.Tensor, documents: Optional[Documents] = None,
                rows: Optional[DenseRows] = None, hidden: bool = False) -> torch.Tensor:
        """The dense schedule: tokens (B, T) -> logits (B, T, V), fp32; logits_t is the
        distribution of x_{t+1}. ``documents``: the rows are packed documents, each computed
        as if alone in its row (model/documents.py). ``rows`` (schedule/dense.py): row b's
        logits are those of its completion positions [P_b - 1, rows.lengths[b]) when
        ``rows.compact`` (0 elsewhere: not computed), of [0, rows.lengths[b]) otherwise.
        ``hidden``: the head's input z (B, T, d) instead (an engine's chunked head, loss.Logits)."""
        emb = self.embed(tokens)
        m = self.dense_memory(emb, documents, rows)
        z = self.decode_dense(emb, self.memory_kv(m), documents=documents, rows=rows)
        if hidden:
            return z
        return self.head(z) if rows is None else rows.head(self.head, z)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Closed-form parameter counts by group (tested against the real module), for every
    model.arch (the baselines: model/baselines.py)."""
    if cfg.arch != "rlt":
        return dense_param_counts(cfg)
    d, V, L, Dh = cfg.d_model, cfg.vocab_size, cfg.n_layers, cfg.head_dim
    q_out, kv_out = cfg.n_heads * Dh, cfg.n_kv_heads * Dh
    block = block_param_count(cfg)
    cross = d + d * q_out + 2 * d * kv_out + q_out * d
    counts = {
        "embed": V * d,
        "lm_head": 0 if cfg.tie_embeddings else V * d,
        "blocks": L * block,
        "decoder_blocks": 0 if cfg.share_weights else L * block,
        "cross": L * cross,
        "recurrence": d + d * d + d,  # recur_norm, recur_proj, z_init
        "memory": d + d,  # memory_norm, null_memory
        "final_norm": d,
    }
    counts["total"] = sum(counts.values())
    return counts


def model_class(cfg: ModelConfig) -> type:
    """The module of model.arch: RLT, or model/baselines.py's DenseLM for dense and looped."""
    return RLT if cfg.arch == "rlt" else DenseLM


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: Optional[int] = None) -> nn.Module:
    """Builds the model of model.arch (an RLT, or a dense/looped baseline); on the meta device
    nothing is allocated (sizes only). ``seed``: the layout-independent initialisation of
    ``init_weights`` (None: a seed from torch's global generator)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    if device.type == "meta":
        return model
    if seed is not None:
        torch.manual_seed(seed)  # as before the per-parameter seeds: callers may rely on the global state
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight  # to_empty unties
    model.init_weights(seed)
    return model.to(device)
