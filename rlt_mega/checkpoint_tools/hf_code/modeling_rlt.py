"""A Recurrent Looped Transformer (RLT) for Hugging Face ``transformers``: torch and
transformers only, written into every export by ``rlt-mega export`` so that

    AutoModelForCausalLM.from_pretrained(EXPORT, trust_remote_code=True)

builds ``RLTForCausalLM`` (a ``PreTrainedModel`` with ``GenerationMixin``) without rlt_mega
installed. Parameter names are rlt_mega's, so the export's safetensors load as they are.

The model (rlt_mega's DESIGN, section 1), per position t::

    encoder (causal, all known tokens in one batch):  m = memory_norm(blocks(embed[x]))
    decoder (recurrent):  u = embed[x_t] + recur_proj(recur_norm(z_{t-1})),  z_{-1} = z_init
        for each layer i: u += SelfAttn_i(u) over the decoder's own K/V of positions <= t
                          u += Cross_i(u) over {null_memory} + {m_s : s < vis(t)}
                          u += MLP_i(u)
        z_t = u;  logits_t = lm_head(final_norm(z_t))
    vis(t) = C * floor((t + 1) / C)            C = config.memory_block

Encoder block i and decoder block i share their weights (``share_weights``; otherwise the
decoder has its own ``dec_blocks``). Visibility is a function of the position alone.

Two schedules of that one function (they differ by floating-point rounding only):

- ``forward`` without a cache is the dense schedule: the encoder over every token in one
  causal batch, then the decoder position by position (the training schedule; logits of
  every position, a loss when ``labels`` are given). With ``use_cache`` it also returns the
  state it ends in, from which decoding can go on.
- With a cache (``RLTCache``; ``generate()`` starts from an empty one) it is rlt_mega's rollout
  schedule with deferred memory: a call encodes only the memory its decoder steps may see.
  After a prompt of P tokens that is [0, C * floor(P / C)); afterwards each memory block of C
  tokens is encoded once, in one call, when it completes (at the step t with t + 1 = k * C,
  the first one that sees it), attending to the encoder K/V cache of every earlier position.
  ``generate(use_cache=False)`` runs the dense schedule over the whole sequence at every step.

Checked with transformers 4.57 and 5.24 (the cache is passed as ``cache`` in 5, as
``past_key_values`` in 4; both are accepted). Beam search works (``reorder_cache``);
assisted decoding does not (a recurrent state cannot be cropped).

Padding: ``attention_mask`` (B, S) may mark pad columns (left padding from a batched
``generate``, or right padding). A row's positions count its real tokens only (HF's
``cumsum(mask) - 1``); a pad column neither advances the row's recurrent state z nor is visible
to anything, so each row computes what it computes alone. With padding the rows' memory
blocks complete at different columns, and the encoder runs on whatever columns some row needs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_rlt import RLTConfig

# transformers 5 names the output's cache "cache", 4 "past_key_values"
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

try:  # transformers >= 5 initialises after loading; these skip the tensors that were loaded
    from transformers import initialization as _init
except ImportError:  # pragma: no cover - transformers 4
    _init = nn.init


def memory_visible(pos: torch.Tensor, C: int) -> torch.Tensor:
    """vis(t) = C * floor((t + 1) / C): memory positions visible at position(s) ``pos``."""
    return C * torch.div(pos + 1, C, rounding_mode="floor")


class RMSNorm(nn.Module):
    """RMSNorm with the statistics in fp32 (fp64 for fp64), cast back, then the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float64 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout (as Llama/Qwen2). x: (B, h, n, Dh); cos, sin: (B, 1, n, Dh)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention. q: (B, h, n, Dh); k, v: (B, h_kv, S, Dh) (GQA: query head j reads kv
    head j // (h / h_kv)); allowed: (B, n, S) bool, never all False in a row -> (B, h, n, Dh)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])


class SelfAttention(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(d, n_heads * head_dim, bias=bias)
        self.k = nn.Linear(d, n_kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(d, n_kv_heads * head_dim, bias=bias)
        self.o = nn.Linear(n_heads * head_dim, d, bias=False)
        self.o._residual_out = True

    def heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """x: (B, n, d) -> (B, heads, n, Dh)."""
        B, n, _ = x.shape
        return proj(x).view(B, n, -1, self.head_dim).transpose(1, 2)

    def out(self, a: torch.Tensor) -> torch.Tensor:
        """a: (B, h, n, Dh) -> (B, n, d)."""
        B, _, n, _ = a.shape
        return self.o(a.transpose(1, 2).reshape(B, n, -1))


class CrossAttention(SelfAttention):
    """The decoder's attention into the memory: no bias and no RoPE (the memory carries its
    position through the encoder; the null slot has none)."""

    def __init__(self, d: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__(d, n_heads, n_kv_heads, head_dim, bias=False)


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        self.down._residual_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """A shared block: pre-norm self-attention and SwiGLU."""

    def __init__(self, config: RLTConfig) -> None:
        super().__init__()
        d, Dh = config.d_model, config.head_dim
        self.attn_norm = RMSNorm(d, config.norm_eps)
        self.attn = SelfAttention(d, config.n_heads, config.n_kv_heads, Dh, config.qkv_bias)
        self.mlp_norm = RMSNorm(d, config.norm_eps)
        self.mlp = SwiGLU(d, config.ffn_hidden)


class CrossBlock(nn.Module):
    def __init__(self, config: RLTConfig) -> None:
        super().__init__()
        self.cross_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = CrossAttention(config.d_model, config.n_heads, config.n_kv_heads, config.head_dim)


class RLTCache(Cache):
    """The state between calls, in columns (the layout ``generate()`` keeps: column j is the
    j-th token passed, pad or not), all tensors batch-first:

    - ``mask`` (B, S) bool and ``pos`` (B, S) long of every column (a pad column carries its
      row's previous position), ``count`` (B,) real tokens per row;
    - ``pending`` (B, S - encoded, d): embeddings of the columns the encoder has not run on;
    - ``enc_k/enc_v[i]`` (B, h_kv, encoded, Dh): the encoder's self-attention K/V;
    - ``mem_k/mem_v[i]`` (B, h_kv, 1 + encoded, Dh): the committed memory's cross-attention
      K/V, slot 0 the null memory, slot 1 + j column j;
    - ``dec_k/dec_v[i]`` (B, h_kv, S, Dh): the decoder's self-attention K/V;
    - ``z`` (B, d): each row's decoder state after its last real token (z_init before any).

    A ``transformers`` ``Cache`` so that ``generate()`` carries it from step to step; it
    does not hold per-layer ``CacheLayer`` objects (the RLT's state is not one K/V per layer),
    and ``get_seq_length`` counts columns."""

    def __init__(self, config: RLTConfig) -> None:
        try:
            super().__init__(layers=[])  # transformers >= 5: a Cache is a list of layers
        except TypeError:  # pragma: no cover - transformers 4
            super().__init__()
        L = config.n_layers
        self.num_columns = 0
        self.encoded = 0
        self.encoder_calls: list[tuple[int, int]] = []  # (start, end) columns of each encoder call
        self.mask: Optional[torch.Tensor] = None
        self.pos: Optional[torch.Tensor] = None
        self.count: Optional[torch.Tensor] = None
        self.pending: Optional[torch.Tensor] = None
        self.z: Optional[torch.Tensor] = None
        self.enc_k: list = [None] * L
        self.enc_v: list = [None] * L
        self.mem_k: list = [None] * L
        self.mem_v: list = [None] * L
        self.dec_k: list = [None] * L
        self.dec_v: list = [None] * L

    def __bool__(self) -> bool:
        return True  # it holds no CacheLayer objects (len 0); still a cache, never "empty"

    # what generate() asks of a cache
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.num_columns

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1  # grows without a bound (model.max_seq_len bounds the positions)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False  # a recurrent state cannot be rolled back

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("an RLT's recurrent state cannot be cropped (assisted decoding is not supported)")

    def _map_tensors(self, fn) -> None:
        """Replaces every batch-first tensor held by ``fn`` of it."""
        for name in ("mask", "pos", "count", "pending", "z"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))
        for name in ("enc_k", "enc_v", "mem_k", "mem_v", "dec_k", "dec_v"):
            setattr(self, name, [None if t is None else fn(t) for t in getattr(self, name)])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b becomes row beam_idx[b]."""
        self._map_tensors(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_tensors(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_tensors(lambda t: t.repeat_interleave(repeats, dim=0))


class RLTPreTrainedModel(PreTrainedModel):
    config_class = RLTConfig
    base_model_prefix = "rlt"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    # one device: the decoder reads every layer at every position (device_map="auto" must not split it)
    _no_split_modules = ["RLTForCausalLM"]
    _supports_cache_class = True

    def _init_weights(self, module: nn.Module) -> None:
        """rlt_mega's initialisation, for weights an export does not provide (an export
        provides all of them; training from scratch belongs to rlt_mega)."""
        cfg = self.config
        if isinstance(module, nn.Linear):
            std = cfg.init_std / math.sqrt(4 * cfg.n_layers) if getattr(module, "_residual_out", False) \
                else cfg.init_std
            _init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                _init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            _init.normal_(module.weight, mean=0.0, std=cfg.embed_init_std)
        elif isinstance(module, RMSNorm):
            _init.ones_(module.weight)
        elif isinstance(module, RLTForCausalLM):
            _init.normal_(module.null_memory, mean=0.0, std=1.0)
            _init.normal_(module.z_init, mean=0.0, std=1.0)


class RLTForCausalLM(RLTPreTrainedModel, GenerationMixin):
    def __init__(self, config: RLTConfig) -> None:
        super().__init__(config)
        d, L = config.d_model, config.n_layers
        self.embed = nn.Embedding(config.vocab_size, d)
        self.blocks = nn.ModuleList(Block(config) for _ in range(L))
        self.dec_blocks = None if config.share_weights else nn.ModuleList(Block(config) for _ in range(L))
        self.cross = nn.ModuleList(CrossBlock(config) for _ in range(L))
        self.memory_norm = RMSNorm(d, config.norm_eps)
        self.null_memory = nn.Parameter(torch.zeros(d))
        self.recur_norm = RMSNorm(d, config.norm_eps)
        self.recur_proj = nn.Linear(d, d, bias=False)
        self.recur_proj._residual_out = True
        self.z_init = nn.Parameter(torch.zeros(d))
        self.final_norm = RMSNorm(d, config.norm_eps)
        # Tied: the head reads embed.weight (the export stores it once, as rlt_mega does).
        self.lm_head = None if config.tie_embeddings else nn.Linear(d, config.vocab_size, bias=False)
        self._rope: dict = {}
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    def get_output_embeddings(self) -> Optional[nn.Linear]:
        return self.lm_head

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own RLTCache (generate() must not give it a DynamicCache)

    def decoder_block(self, i: int) -> Block:
        return self.blocks[i] if self.dec_blocks is None else self.dec_blocks[i]

    # ------------------------------------------------------------------ pieces
    def _rope_tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (max_seq_len, Dh): computed in float64, rounded once to fp32 (kept
        in fp64 for fp64), then to ``dtype``, as rlt_mega does."""
        key = (device, dtype)
        if key not in self._rope:
            cfg = self.config
            Dh = cfg.head_dim
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, Dh, 2, dtype=torch.float64, device=device) / Dh))
            t = torch.arange(cfg.max_seq_len, dtype=torch.float64, device=device)
            emb = torch.outer(t, inv_freq).repeat(1, 2)
            table = dtype if dtype == torch.float64 else torch.float32
            self._rope[key] = (emb.cos().to(table).to(dtype), emb.sin().to(table).to(dtype))
        return self._rope[key]

    def _rope_at(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos (B, n) -> cos, sin (B, 1, n, Dh); pad columns (position -1) read position 0."""
        cos, sin = self._rope_tables(pos.device, dtype)
        idx = pos.clamp(min=0)
        return cos[idx][:, None], sin[idx][:, None]

    def _head(self, z: torch.Tensor) -> torch.Tensor:
        """z (..., d) -> logits (..., V) in fp32 (fp64 for fp64)."""
        h = self.final_norm(z)
        logits = F.linear(h, self.embed.weight) if self.lm_head is None else self.lm_head(h)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _memory_kv(self, i: int, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.cross[i].attn
        return attn.heads(attn.k, m), attn.heads(attn.v, m)

    def _start(self, state: RLTCache, batch_size: int, like: torch.Tensor) -> None:
        """A fresh state: z_init, and the null memory slot of every layer."""
        d = self.config.d_model
        state.mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=like.device)
        state.pos = torch.zeros(batch_size, 0, dtype=torch.long, device=like.device)
        state.count = torch.zeros(batch_size, dtype=torch.long, device=like.device)
        state.pending = like.new_zeros(batch_size, 0, d)
        state.z = self.z_init.to(like.dtype).expand(batch_size, d)
        null = self.null_memory.to(like.dtype).expand(batch_size, 1, d)
        for i in range(self.config.n_layers):
            state.mem_k[i], state.mem_v[i] = self._memory_kv(i, null)

    def _append(self, state: RLTCache, emb: torch.Tensor, mask: torch.Tensor) -> None:
        """Adds n columns: emb (B, n, d), mask (B, n) bool. Positions count real tokens."""
        pos = state.count[:, None] + torch.cumsum(mask.long(), dim=1) - 1  # (B, n); pads repeat the last
        state.mask = torch.cat([state.mask, mask], dim=1)
        state.pos = torch.cat([state.pos, pos], dim=1)
        state.count = state.count + mask.long().sum(1)
        state.pending = torch.cat([state.pending, emb], dim=1)
        state.num_columns += emb.shape[1]
        top = int(state.pos.max()) if state.pos.numel() else -1
        if top >= self.config.max_seq_len:
            raise ValueError(f"position {top} is past max_position_embeddings={self.config.max_seq_len} "
                             "(the model's max_seq_len)")

    def _columns_needed(self, state: RLTCache) -> int:
        """Columns of memory the last column's decoder step may see in some row: one past the
        last column j with mask_j and pos_j < vis(pos of the row's last column). (A host
        synchronisation per call: this module is the reference, not the fast sampler.)"""
        last = state.pos[:, -1]  # (B,)
        seen = state.mask & (state.pos < memory_visible(last, self.config.memory_block)[:, None])  # (B, S)
        cols = torch.nonzero(seen.any(0))
        return int(cols.max()) + 1 if cols.numel() else 0

    def _encode(self, state: RLTCache, end: int) -> None:
        """The encoder over the pending columns [encoded, end) in one call, attending to the
        cached K/V of every earlier column; commits their memory K/V."""
        start = state.encoded
        if end <= start:
            return
        n = end - start
        h = state.pending[:, :n]  # (B, n, d)
        cos, sin = self._rope_at(state.pos[:, start:end], h.dtype)
        # query column start + r sees key column j <= start + r that is real (or is itself)
        q_col = torch.arange(start, end, device=h.device)[:, None]
        k_col = torch.arange(end, device=h.device)[None, :]
        causal = k_col <= q_col  # (n, end)
        allowed = causal[None] & (state.mask[:, None, :end] | (k_col == q_col)[None])  # (B, n, end)
        for i, blk in enumerate(self.blocks):
            x = blk.attn_norm(h)
            q = rotate(blk.attn.heads(blk.attn.q, x), cos, sin)
            k = rotate(blk.attn.heads(blk.attn.k, x), cos, sin)
            v = blk.attn.heads(blk.attn.v, x)
            if state.enc_k[i] is not None:
                k, v = torch.cat([state.enc_k[i], k], dim=2), torch.cat([state.enc_v[i], v], dim=2)
            state.enc_k[i], state.enc_v[i] = k, v
            h = h + blk.attn.out(attend(q, k, v, allowed))
            h = h + blk.mlp(blk.mlp_norm(h))
        m = self.memory_norm(h)
        for i in range(self.config.n_layers):
            mk, mv = self._memory_kv(i, m)
            state.mem_k[i] = torch.cat([state.mem_k[i], mk], dim=2)
            state.mem_v[i] = torch.cat([state.mem_v[i], mv], dim=2)
        state.encoded = end
        state.pending = state.pending[:, n:]
        state.encoder_calls.append((start, end))

    def _decode_step(self, state: RLTCache, e: torch.Tensor, t: int) -> torch.Tensor:
        """The decoder at column t: e (B, d) its embedding -> z_t (B, d). Updates the row's
        state z only where column t is real."""
        u = (e + self.recur_proj(self.recur_norm(state.z)))[:, None]  # (B, 1, d)
        pos = state.pos[:, t:t + 1]  # (B, 1)
        cos, sin = self._rope_at(pos, u.dtype)
        cols = torch.arange(t + 1, device=u.device)
        self_allowed = (state.mask[:, :t + 1] | (cols == t)[None])[:, None]  # (B, 1, t + 1)
        E = state.encoded
        memory = state.mask[:, :E] & (state.pos[:, :E] < memory_visible(pos, self.config.memory_block))
        null = torch.ones_like(memory[:, :1])
        mem_allowed = torch.cat([null, memory], dim=1)[:, None]  # (B, 1, 1 + E): the null slot always
        for i in range(self.config.n_layers):
            blk, cb = self.decoder_block(i), self.cross[i]
            x = blk.attn_norm(u)
            q = rotate(blk.attn.heads(blk.attn.q, x), cos, sin)
            k = rotate(blk.attn.heads(blk.attn.k, x), cos, sin)
            v = blk.attn.heads(blk.attn.v, x)
            if state.dec_k[i] is not None:
                k, v = torch.cat([state.dec_k[i], k], dim=2), torch.cat([state.dec_v[i], v], dim=2)
            state.dec_k[i], state.dec_v[i] = k, v
            u = u + blk.attn.out(attend(q, k, v, self_allowed))
            cq = cb.attn.heads(cb.attn.q, cb.cross_norm(u))
            u = u + cb.attn.out(attend(cq, state.mem_k[i], state.mem_v[i], mem_allowed))
            u = u + blk.mlp(blk.mlp_norm(u))
        z = u[:, 0]
        state.z = torch.where(state.mask[:, t:t + 1], z, state.z)
        return z

    def _run(self, state: RLTCache, emb: torch.Tensor, mask: torch.Tensor, dense: bool) -> torch.Tensor:
        """Appends the columns emb (B, n, d) and runs them -> z (B, n, d)."""
        first = state.num_columns
        self._append(state, emb, mask)
        # dense: every known token in one encoder batch; rollout: only the memory these steps see
        self._encode(state, state.num_columns if dense else self._columns_needed(state))
        zs = [self._decode_step(state, emb[:, r], first + r) for r in range(emb.shape[1])]
        return torch.stack(zs, dim=1)

    # ------------------------------------------------------------------ the HF interface
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[RLTCache] = None, past_key_values: Optional[RLTCache] = None,
                use_cache: Optional[bool] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, logits_to_keep: int = 0,
                return_dict: Optional[bool] = None, **kwargs) -> CausalLMOutputWithPast | tuple:
        """input_ids (B, n): the next n columns (after those in the cache, if one is given;
        without one, the dense schedule); attention_mask (B, past + n) or (B, n): 0 marks pad
        columns. -> logits (B, n, V) fp32
        (the last ``logits_to_keep`` columns when > 0): logits[:, j] is the distribution of the
        token after column j. ``labels`` (B, n): the mean cross-entropy of labels[:, 1:]
        (-100 ignored), as every HF causal LM."""
        state = cache if cache is not None else past_key_values
        if state is not None and not isinstance(state, RLTCache):
            if state.get_seq_length() != 0:
                raise TypeError(f"an RLT keeps its own RLTCache; got a filled {type(state).__name__}")
            state = None  # an empty cache of another kind, made by a caller: replaced
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        emb = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        B, n = emb.shape[:2]
        past = 0 if state is None else state.num_columns
        mask = self._new_mask(attention_mask, B, past, n, emb.device)
        dense = state is None
        if dense:
            state = RLTCache(self.config)
        if state.mask is None:
            self._start(state, B, emb)
        z = self._run(state, emb, mask, dense)
        if logits_to_keep:
            z = z[:, -logits_to_keep:]
        logits = self._head(z)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        kept = state if use_cache else None
        if return_dict is False:
            out = (logits, kept) if use_cache else (logits,)
            return (loss,) + out if loss is not None else out
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: kept})

    @staticmethod
    def _new_mask(attention_mask: Optional[torch.Tensor], B: int, past: int, n: int, device) -> torch.Tensor:
        """The (B, n) bool mask of the new columns."""
        if attention_mask is None:
            return torch.ones(B, n, dtype=torch.bool, device=device)
        if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] not in (n, past + n):
            raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)}: expected a 2-D (batch, columns) "
                             f"mask of ({B}, {past + n}) (every column so far) or ({B}, {n}) (the new ones)")
        return attention_mask[:, -n:].to(device=device, dtype=torch.bool)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, cache: Optional[RLTCache] = None,
                                      past_key_values: Optional[RLTCache] = None,
                                      attention_mask: Optional[torch.Tensor] = None, use_cache: bool = True,
                                      inputs_embeds: Optional[torch.Tensor] = None, **kwargs) -> dict:
        """generate()'s step inputs: the columns the cache has not seen (all of them without a
        cache: the dense schedule over the whole sequence, each step)."""
        if inputs_embeds is not None:
            raise ValueError("RLT generates from input_ids (the decoder embeds every new token itself)")
        state = cache if cache is not None else past_key_values
        if not isinstance(state, RLTCache):
            state = None
        if state is None and use_cache:
            state = RLTCache(self.config)  # an empty cache: the forward runs the rollout schedule
        elif state is not None and state.num_columns > 0:
            input_ids = input_ids[:, state.num_columns:]
        inputs = {"input_ids": input_ids, "cache": state, "attention_mask": attention_mask, "use_cache": use_cache}
        if "logits_to_keep" in kwargs:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs

    @staticmethod
    def _reorder_cache(cache: RLTCache, beam_idx: torch.LongTensor) -> RLTCache:
        """Beam search in transformers 4 (5 calls ``cache.reorder_cache``)."""
        cache.reorder_cache(beam_idx)
        return cache
