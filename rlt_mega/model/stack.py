"""The decoder's weights as one stack and the keys and values it reads and writes: what a
model/decoder.py ``DecoderRun`` runs on. ``fused_weights`` gathers a stack's layers (the whole
model, or a pipeline stage's) into a flat list of differentiable tensors; ``DecoderStack`` holds
their products prepared for one forward (and backward) in the compute dtype; ``WeightGrads`` the
accumulators one backward shares; ``KVState`` the decoder's and the memory's K/V per layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from rlt_mega.model.kernels import (LAYER_WEIGHTS, Gemm, LayerGemms, NormConstants, fuse_layer, fuse_recurrence,
                                    head_counts, rope_tables, stat_dtype)

AllReduce = Callable[[torch.Tensor], None]



@dataclass
class StackSpec:
    """What the fused weights of a stack are: the layers (global indices), whether it has the
    recurrence input, this rank's head counts, and the order of the flat tensor list."""

    layers: list[int]
    with_input: bool
    head_dim: int
    num_heads: int
    num_kv_heads: int
    keys: list[tuple[int, str]] = field(default_factory=list)  # (layer or -1, name) per tensor


def fused_weights(model, layers: Sequence[int], with_input: bool,
                  replicate: Callable[[torch.Tensor], torch.Tensor]) -> tuple[StackSpec, list[torch.Tensor]]:
    """The fused weights of ``layers`` of ``model`` (an RLT, or a pipeline stage of one, possibly
    sharded) as a flat list of differentiable tensors (fp32 at least) and their spec."""
    Dh = model.cfg.head_dim
    if not layers and not with_input:
        raise ValueError("a fused stack needs at least one layer or the recurrence input")
    h = h_kv = 0
    keys, tensors = [], []
    for i in layers:
        block, cross = model.decoder_block(i), model.cross[i]
        h, h_kv = head_counts(block, Dh)
        for name, w in fuse_layer(block, cross, Dh, replicate).items():
            if w is not None:
                keys.append((i, name))
                tensors.append(w)
    if with_input:
        keys.append((-1, "recur"))
        tensors.append(fuse_recurrence(model.recur_norm, model.recur_proj))
    return StackSpec(list(layers), with_input, Dh, h, h_kv, keys), tensors


class DecoderStack:
    """Prepared products of a stack for one forward (and backward), in the compute dtype.

    all_reduce: the in-place sum over the shards of a sharded layer (None: one device),
    given by whoever builds the stack from a sharded model (parallel/). cross_kv: per layer the
    cross-attention's k and v weights, (2 h_kv Dh, d): the rollout's memory writes (the dense
    schedule computes its memory K/V with autograd, ``RLT.memory_kv``)."""

    def __init__(self, spec: StackSpec, tensors: Sequence[torch.Tensor], *, stream_dtype: torch.dtype,
                 compute_dtype: torch.dtype, rows: int, backward: bool, d_model: int, eps: float,
                 memory_block: int, rotary, all_reduce: Optional[AllReduce] = None,
                 cross_kv: Optional[dict[int, torch.Tensor]] = None) -> None:
        self.spec, self.rows = spec, rows
        self.stream_dtype, self.compute_dtype = stream_dtype, compute_dtype
        self.stat_dtype = stat_dtype(stream_dtype)
        self.d, self.C, self.all_reduce = d_model, memory_block, all_reduce
        named = dict(zip(spec.keys, tensors))
        self.layers = {}
        for i in spec.layers:
            per = {n: named.get((i, n)) for n in (*LAYER_WEIGHTS, "qkv_bias")}
            self.layers[i] = LayerGemms.build(per, compute_dtype, rows, backward, spec.num_heads, spec.num_kv_heads)
        self.recur = Gemm(named[(-1, "recur")].detach().to(compute_dtype), rows, backward) if spec.with_input else None
        self.ffn = self.layers[spec.layers[0]].down.in_features if spec.layers else 0
        self.device = tensors[0].device
        self.norm = NormConstants(d_model, eps, stream_dtype, self.device)
        cos, sin = rotary.tables(self.device, compute_dtype)
        self.tables = rope_tables(cos, sin)  # (cos, sin_fwd, sin_bwd), (max_seq_len, Dh) each
        self.cos, self.sin_fwd, self.sin_bwd = self.tables
        self.max_seq_len = cos.shape[0]
        self.cross_kv = None if cross_kv is None else {i: Gemm(w.detach().to(compute_dtype), rows)
                                                       for i, w in cross_kv.items()}

    def memory_kv(self, m: torch.Tensor):
        """Per layer i: (i, k, v) of memory m (N, n, d) (memory_norm applied), k and v (N, n, h_kv,
        Dh) each: the cross-attention's k/v products (this rank's heads), autocast off."""
        N, n, d = m.shape
        x = m.reshape(N * n, d).to(self.compute_dtype)
        h_kv, Dh = self.spec.num_kv_heads, self.spec.head_dim
        with torch.autocast(device_type=m.device.type, enabled=False):
            for i in self.spec.layers:
                kv = self.cross_kv[i](x).view(N, n, 2, h_kv, Dh)
                yield i, kv[:, :, 0], kv[:, :, 1]


class WeightGrads:
    """Accumulators of the fused weights' gradients (each tensor's shape and dtype, fp32 at
    least), shared by every run of one backward (a pipeline round: all its micro-batches).

    allocate=False: none yet (a forward that only needs to know a backward will come: the
    accumulators, a copy of the decoder's weights, are not kept alive through the rest of the
    forward and are not zeroed twice)."""

    def __init__(self, spec: StackSpec, tensors: Sequence[torch.Tensor], allocate: bool = True) -> None:
        self.spec = spec
        self.acc = {key: torch.zeros(w.shape, dtype=w.dtype, device=w.device)
                    for key, w in zip(spec.keys, tensors)} if allocate else {}

    def grads(self) -> list[torch.Tensor]:
        return [self.acc[key] for key in self.spec.keys]


class KVState:
    """The keys and values a decoder step reads and writes, per layer of the stack: the decoder's
    own (keys stored transposed, ``kt4`` (B, h_kv, Dh, capacity), values ``v4`` (B, h_kv, capacity,
    Dh)) and the memory's (slot 0 the null memory, then position s at slot 1 + s: ``mkt4``
    (B, h_kv, Dh, S), ``mv4`` (B, h_kv, S, Dh)), with the (B h_kv, ...) views the attention products
    read (``kt``, ``v``, ``mkt``, ``mv``). Both attention products then read their right-hand side
    in the layout a GEMM wants (q @ K^T over (Dh, S) rows is 2-3x faster than over a transposed
    view at these sizes).

    A training run carves them from its slab; a rollout or replay (rollout/executor.py) holds one
    per micro-batch for the whole call, its rows the call's slots, and moves rows inside it when
    its batch changes."""

    def __init__(self, kt4: dict, v4: dict, mkt4: dict, mv4: dict) -> None:
        self.kt4, self.v4, self.mkt4, self.mv4 = kt4, v4, mkt4, mv4
        self.kt = {i: x.flatten(0, 1) for i, x in kt4.items()}
        self.v = {i: x.flatten(0, 1) for i, x in v4.items()}
        self.mkt = {i: x.flatten(0, 1) for i, x in mkt4.items()}
        self.mv = {i: x.flatten(0, 1) for i, x in mv4.items()}

    @classmethod
    def zeros(cls, layers: Sequence[int], batch: int, num_kv_heads: int, head_dim: int, capacity: int,
              mem_capacity: int, dtype: torch.dtype, device: torch.device) -> "KVState":
        def new(*shape):
            return {i: torch.zeros(*shape, dtype=dtype, device=device) for i in layers}

        B, h_kv, Dh = batch, num_kv_heads, head_dim
        return cls(new(B, h_kv, Dh, capacity), new(B, h_kv, capacity, Dh), new(B, h_kv, Dh, mem_capacity),
                   new(B, h_kv, mem_capacity, Dh))

    def tensors(self):
        """(name, layer, tensor, dimension of the positions) of every buffer (the row moves of the
        rollout's events)."""
        for name, bufs, dim in (("kt", self.kt4, 3), ("v", self.v4, 2), ("mkt", self.mkt4, 3), ("mv", self.mv4, 2)):
            for i, x in bufs.items():
                yield name, i, x, dim

    def write_memory(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor,
                     rows: Optional[torch.Tensor] = None) -> None:
        """Memory slots [start, start + m) <- k, v (n, m, h_kv, Dh): of rows [:n], or of ``rows`` (n,)."""
        m = k.shape[1]
        if rows is None:
            n = k.shape[0]
            self.mkt4[layer][:n, :, :, start:start + m].copy_(k.permute(0, 2, 3, 1))
            self.mv4[layer][:n, :, start:start + m].copy_(v.transpose(1, 2))
        else:
            self.mkt4[layer][rows, :, :, start:start + m] = k.permute(0, 2, 3, 1)
            self.mv4[layer][rows, :, start:start + m] = v.transpose(1, 2)
