"""The executable reference of the RLT's decoder: the specification (docs/design.md, "The model")
written plainly with the model's own modules and autograd, used only by tests and benchmarks.
Nothing in training, sampling or evaluation calls it.

- ``reference_forward(model, tokens, documents)``: the dense schedule (encoder in one causal batch,
  the decoder position by position, full BPTT through plain autograd: K/V kept in lists and
  concatenated per position, softmax attention written out, no custom backward), packed documents
  included (model/documents.py: RoPE, keys and memory of each row's own document, z reset at a
  document's start). Every row runs every position (the padded schedule).
- ``ReferenceDecoder``: the same step without autograd over the rollout's K/V state
  (model/decoder.py ``KVState``), for the rollout and replay (rollout/executor.py); it runs the
  modules themselves, so it runs megatron-core's tensor-parallel layers too (their communication
  inside). The benchmarks' reference arm (tools/bench/rollout_parallel.py) samples with it.

The one decoder step (model/decoder.py) computes the same function with fused products, a
hand-written backward and deferred gradients; the tests compare the two (float64 to 1e-12, fp32
to 1e-5).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from rlt_mega.model.stack import KVState
from rlt_mega.model.documents import Documents
from rlt_mega.model.layers import Rotary
from rlt_mega.model.layout import Step


def vis(t: int, C: int) -> int:
    """Memory positions visible to the decoder at position t: C * floor((t + 1) / C)."""
    return C * ((t + 1) // C)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
    """q (B, h, 1, Dh), k and v (B, h_kv, S, Dh) -> (B, h, 1, Dh): softmax(q k^T / sqrt(Dh)) v, in
    q's dtype with the softmax in fp32 (fp64), GQA by repeating K/V. visible (B, S) bool: the keys
    each row may see (None: all)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1).to(q.dtype), v.repeat_interleave(g, dim=1).to(q.dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, h, 1, S)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        if visible is not None:
            scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1).to(q.dtype) @ v


def _rope(rotary: Rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (B, h, 1, Dh) with row b at positions[b]."""
    cos, sin = rotary.tables(x.device, x.dtype)
    cos, sin = cos[positions][:, None, None], sin[positions][:, None, None]
    return Rotary.rotate(x, cos, sin)


def _layer(model, i: int, u: torch.Tensor, positions: torch.Tensor, keys, values, mem_k, mem_v,
           self_visible: Optional[torch.Tensor], mem_visible: Optional[torch.Tensor], write) -> torch.Tensor:
    """Decoder layer i on u (B, 1, d), row b at positions[b]. ``write(k, v)`` stores this
    position's K/V (B, h_kv, 1, Dh) and ``keys()``/``values()`` return the keys to attend to
    (B, h_kv, S, Dh); mem_k, mem_v (B, h_kv, S', Dh): the memory slots to attend to."""
    blk, cb = model.decoder_block(i), model.cross[i]
    q, k, v = blk.attn.qkv(blk.attn_norm(u))  # q (B, h, 1, Dh); k, v (B, h_kv, 1, Dh)
    q, k = _rope(model.rotary, q, positions), _rope(model.rotary, k, positions)
    write(k, v)
    u = u + blk.attn.out(attention(q, keys(), values(), self_visible))
    cq = cb.attn.query(cb.cross_norm(u))
    u = u + cb.attn.out(attention(cq, mem_k, mem_v, mem_visible))
    return u + blk.mlp(blk.mlp_norm(u))


def reference_decode(model, emb: torch.Tensor, m: torch.Tensor, documents: Optional[Documents] = None
                     ) -> torch.Tensor:
    """The decoder over every position: emb (B, T, d) the embeddings, m (B, T, d) the memory ->
    z (B, T, d), with autograd through every path (recurrence, decoder K/V, memory)."""
    B, T, _ = emb.shape
    cfg = model.cfg
    C = cfg.memory_block
    slots = torch.cat([model.null_memory.to(m.dtype).expand(B, 1, -1), m], dim=1)  # (B, 1 + T, d)
    mem = {i: model.cross[i].attn.kv(slots) for i in range(cfg.n_layers)}
    ks: dict[int, list] = {i: [] for i in range(cfg.n_layers)}
    vs: dict[int, list] = {i: [] for i in range(cfg.n_layers)}
    z = model.z_init.expand(B, -1)
    zs = []
    for t in range(T):
        if documents is None:
            positions = torch.full((B,), t, dtype=torch.long, device=emb.device)
            self_visible, n_mem, mem_visible = None, 1 + vis(t, C), None
        else:
            if t > 0:
                z = torch.where(documents.starts[:, t, None], model.z_init.to(z.dtype), z)
            positions = documents.positions[:, t]
            self_visible = documents.attend[:, t, :t + 1]
            n_mem = min(2 + t, 1 + T)
            mem_visible = documents.memory(C)[:, t, :n_mem]
        u = (emb[:, t] + model.recur_proj(model.recur_norm(z))).unsqueeze(1)
        for i in range(cfg.n_layers):
            u = _layer(model, i, u, positions, lambda i=i: torch.cat(ks[i], dim=2),
                       lambda i=i: torch.cat(vs[i], dim=2), mem[i][0][:, :, :n_mem], mem[i][1][:, :, :n_mem],
                       self_visible, mem_visible, lambda k, v, i=i: (ks[i].append(k), vs[i].append(v)))
        z = u.squeeze(1)
        zs.append(z)
    return torch.stack(zs, dim=1)


def reference_forward(model, tokens: torch.Tensor, documents: Optional[Documents] = None) -> torch.Tensor:
    """The dense schedule written plainly: tokens (B, T) -> logits (B, T, V) fp32."""
    emb = model.embed(tokens)
    m = model.memory_norm(model.encode(emb, documents=documents))
    return model.head(reference_decode(model, emb, m, documents))


# ------------------------------------------------------------------------------------------
# The no-grad step of the rollout and replay, on the modules
# ------------------------------------------------------------------------------------------

class ReferenceRunner:
    """The rollout's decoder over one micro-batch's K/V state (the interface of
    model/decoder.py's ``StepRunner``): the modules of ``layers``, plain attention over the
    state's keys (stored transposed, as the fused step stores them)."""

    def __init__(self, model, layers: Sequence[int], with_input: bool, batch: int, capacity: int,
                 dtype: torch.dtype) -> None:
        cfg = model.cfg
        self.model, self.layers, self.with_input, self.batch = model, list(layers), with_input, batch
        h_kv = model.cross[self.layers[0]].attn.k.weight.shape[0] // cfg.head_dim  # this rank's heads
        device = model.null_memory.device
        self.state = KVState.zeros(self.layers, batch, h_kv, cfg.head_dim, capacity, 1 + capacity, dtype, device)
        self.dtype = dtype
        self.write_memory(model.null_memory.to(dtype).expand(batch, 1, -1), -1)

    def at(self, k: int, t: int, n: int) -> Step:
        C = self.model.cfg.memory_block
        return Step(t, 0, 0, None, None, None, t + 1, 1 + vis(t, C), batch=self.batch, rows=n)

    def rows(self, k: int, pos: torch.Tensor, num_keys: int) -> Step:
        C = self.model.cfg.memory_block
        return Step(k, 0, 0, None, None, None, num_keys, 1 + vis(num_keys - 1, C), batch=self.batch, rows=len(pos),
                    col=pos)

    @torch.no_grad()
    def write_memory(self, m: torch.Tensor, start: int, rows: Optional[torch.Tensor] = None) -> None:
        """Memory m (n, C, d) of positions [start, start + C), of rows [:n] or ``rows``."""
        for i in self.layers:
            k, v = self.model.cross[i].attn.kv(m)  # (n, h_kv, C, Dh)
            self.state.write_memory(i, 1 + start, k.transpose(1, 2), v.transpose(1, 2), rows)

    @torch.no_grad()
    def step(self, step: Step, x: torch.Tensor, e: Optional[torch.Tensor]) -> torch.Tensor:
        """x (n, d): z_{k-1} (with the input layer) or the previous stage's output; e (n, d) the
        embeddings -> (n, d)."""
        model, st, n = self.model, self.state, step.n
        if self.with_input:
            x = e + model.recur_proj(model.recur_norm(x))
        pos = step.col if isinstance(step.col, torch.Tensor) else torch.full((n,), step.col, device=x.device)
        keys = torch.arange(step.n_self, device=x.device)
        slots = torch.arange(step.n_mem, device=x.device)
        self_visible = keys[None, :] <= pos[:, None]
        C = model.cfg.memory_block
        mem_visible = slots[None, :] < 1 + C * torch.div(pos + 1, C, rounding_mode="floor")[:, None]
        rows = torch.arange(n, device=x.device)
        u = x.unsqueeze(1)
        for i in self.layers:
            def write(k, v, i=i):
                st.kt4[i][rows, :, :, pos] = k[:, :, 0].to(st.kt4[i].dtype)
                st.v4[i][rows, :, pos] = v[:, :, 0].to(st.v4[i].dtype)

            u = _layer(model, i, u, pos, lambda i=i: st.kt4[i][:n, :, :, :step.n_self].transpose(-1, -2),
                       lambda i=i: st.v4[i][:n, :, :step.n_self], st.mkt4[i][:n, :, :, :step.n_mem].transpose(-1, -2),
                       st.mv4[i][:n, :, :step.n_mem], self_visible, mem_visible, write)
        return u.squeeze(1)


class ReferenceDecoder:
    """The reference arm of the rollout: ``runners`` builds ReferenceRunners (the interface of
    model/dense_decode.py's ``Decoder.runners``)."""

    name = "reference"

    def runners(self, model, layers: Sequence[int], with_input: bool, shapes: Sequence[tuple[int, int]],
                stream_dtype: torch.dtype, compute_dtype: torch.dtype) -> list[ReferenceRunner]:
        return [ReferenceRunner(model, layers, with_input, batch, capacity, compute_dtype) for batch, capacity in shapes]

    def reload(self, model, layers: Sequence[int], with_input: bool, runners: Sequence[ReferenceRunner]) -> None:
        """A weight switch: the runners read the modules, so only the null memory's slot is rewritten."""
        for r in runners:
            r.write_memory(model.null_memory.to(r.dtype).expand(r.batch, 1, -1), -1)
