"""The buffers of a decoder run (model/decoder.py), as one pure function of shapes and mode.

The decoder allocates exactly what :func:`run_buffers` lists, and the planner
(cost/fused_memory.py) prices the same list: there is one copy of the arithmetic, so the
planner's buffer sizes equal the decoder's allocation by construction (tests/unit/test_costmodel.py
holds the two side by side anyway).

Modes. A run that will be backwarded keeps, per activation slot, everything its backward
and the deferred weight-gradient flush read (the normalised inputs of the norms with their
1/rms, the RoPE'd q/k, the two attention outputs, the cross query, gate/up and the SwiGLU
product). Without checkpointing (``checkpoint=None``) there is one slot per position. With
checkpointing every ``k`` positions (``checkpoint=k``; ``train.checkpointing.decoder=step`` is
k = 1) the forward keeps, per position, only the stage's input x (z_{t-1}, or the previous
stage's output) next to the K/V that every mode holds, and the backward recomputes each segment
of k positions (attention included) into a ring of :func:`ring_slots` slots just before the
segment's backward: the segment and the weight-gradient chunk that its positions belong to
must be there together (W + k - 1 positions at most, rounded up to whole chunks so that a chunk
is contiguous in the ring). With k = 1 the tensors that only a position's own backward reads
(``ONE_SLOT``) need one slot.

Dtypes are roles ("compute": the products' dtype; "stream": the residual stream's and the
messages'; "stat": the statistics', fp32 or fp64); the decoder maps them to torch dtypes, the
planner to bytes.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

from rlt_mega.model.workspace import aligned

# Rows per weight-gradient GEMM: enough to run it at this CPU's matmul peak (measured: 96 GFLOP/s
# at 512 rows, the same as a 2048^3 torch.mm).
WGRAD_ROWS = 512
# Positions per deferred K/V-gradient chunk: the direct part grows with it, the per-chunk GEMM's
# inner dimension too.
KV_CHUNK = 16

SAVED = ("qk", "cq", "gu", "f", "a1", "r1", "a2", "r2", "a3", "r3", "o1", "c")  # per layer and slot
ONE_SLOT = ("qk", "cq", "gu")  # read by the position's own backward only
RING = ("dqkv", "g2", "dcq", "g3", "dgu", "g4")  # per layer and ring slot: the products' dY
PURPOSES = ("saved", "inputs", "wgrad_ring", "kv_rows", "kv", "input_grads")


class Buffer(NamedTuple):
    """One buffer of a run: ``backward`` ones are the backward's scratch (allocated by the first
    backward); ``zero``: zeroed at allocation (it accumulates, or masked keys must read 0)."""

    name: str
    purpose: str
    shape: tuple
    role: str  # "compute" | "stream" | "stat"
    zero: bool = False
    backward: bool = False
    layer: Optional[int] = None  # the K/V gradients: one slab per layer, freed layer by layer


def wgrad_positions(batch: int, capacity: int) -> int:
    """W: positions per weight-gradient flush, a function of the batch size alone (capped at
    the capacity): the flushes, and their rounding, are the same in every checkpointing mode."""
    return max(1, min(capacity, math.ceil(WGRAD_ROWS / batch)))


def ring_slots(batch: int, capacity: int, checkpoint: Optional[int]) -> int:
    """Activation slots of a run: one per position without checkpointing; with segments of k
    positions, whole weight-gradient chunks covering what must be live at once: the segment being
    recomputed and backwarded and the chunk its positions flush. When k divides W (or W divides k)
    no segment straddles a chunk boundary and a chunk (a segment) is all of it; otherwise
    W + k - 1 positions. Capped at the capacity."""
    if checkpoint is None:
        return capacity
    W, k = wgrad_positions(batch, capacity), checkpoint
    if W % k == 0 or k % W == 0:  # segments inside chunks, or chunks inside segments: one of them
        return min(capacity, max(W, k))
    return min(capacity, W * math.ceil((W + k - 1) / W))


def run_buffers(layers: Sequence[int], batch: int, capacity: int, mem_capacity: int, d: int, head_dim: int,
                num_heads: int, num_kv_heads: int, ffn: int, *, grad: bool, with_input: bool,
                checkpoint: Optional[int] = None, static: bool = False, own_kv: bool = True,
                keep_inputs: bool = True) -> list[Buffer]:
    """Every buffer of a run of ``batch`` rows x ``capacity`` positions over ``layers`` (this
    rank's shard: heads and ffn already divided), memory of ``mem_capacity`` slots.

    grad: the run will be backwarded; with_input: it holds the recurrence input (the first
    stage); checkpoint: segment length k (None: keep every position); static: the capture-ready
    form (no deferred K/V rows); own_kv: the run holds its K/V (False: the rollout's K/V state);
    keep_inputs: a checkpointed run keeps its stage inputs itself (False: the caller does, as
    the captured run's z buffer)."""
    B, T, S, Dh, h, h_kv, F = batch, capacity, mem_capacity, head_dim, num_heads, num_kv_heads, ffn
    g, BH = (h // h_kv if h_kv else 0), B * h_kv
    slots = ring_slots(B, T, checkpoint)
    W = wgrad_positions(B, T)
    widths = {"a1": d, "r1": 1, "qk": (h + h_kv) * Dh, "o1": h * Dh, "a2": d, "r2": 1, "cq": h * Dh,
              "c": h * Dh, "a3": d, "r3": 1, "gu": 2 * F, "f": F,
              "dqkv": (h + 2 * h_kv) * Dh, "g2": d, "dcq": h * Dh, "g3": d, "dgu": 2 * F, "g4": d}
    roles = {"r1": "stat", "r2": "stat", "r3": "stat", "g2": "stream", "g3": "stream", "g4": "stream"}
    out: list[Buffer] = []
    for i in layers:
        if grad:  # a run without backward keeps nothing
            for n in SAVED:
                rows = 1 if (checkpoint == 1 and n in ONE_SLOT) else slots
                out.append(Buffer(f"{n}{i}", "saved", (rows, B, widths[n]), roles.get(n, "compute")))
        if own_kv:  # decoder K/V, keys transposed (KVState): (B, h_kv, Dh, cap), (B, h_kv, cap, Dh)
            out += [Buffer(f"kt{i}", "kv", (B, h_kv, Dh, T), "compute", zero=True),
                    Buffer(f"v{i}", "kv", (B, h_kv, T, Dh), "compute", zero=True),
                    Buffer(f"mkt{i}", "kv", (B, h_kv, Dh, S), "compute"),
                    Buffer(f"mv{i}", "kv", (B, h_kv, S, Dh), "compute")]
        if grad:
            out += [Buffer(f"{n}{i}", "wgrad_ring", (W, B, widths[n]), roles.get(n, "compute"), backward=True)
                    for n in RING]
            out += [Buffer(f"gkt{i}", "kv", (B, h_kv, Dh, T), "stat", zero=True, backward=True, layer=i),
                    Buffer(f"gv{i}", "kv", (B, h_kv, T, Dh), "stat", zero=True, backward=True, layer=i),
                    Buffer(f"gmkt{i}", "kv", (BH, Dh, S), "stat", zero=True, backward=True, layer=i),
                    Buffer(f"gmv{i}", "kv", (BH, S, Dh), "stat", zero=True, backward=True, layer=i)]
            if not static:  # the chunk's stored rows for the deferred K/V gradients (batch-major)
                Wkv = min(KV_CHUNK, T)
                for kind, n_keys in (("s", T), ("m", S)):
                    out += [Buffer(f"q{kind}{i}", "kv_rows", (BH, Wkv * g, Dh), "stat", backward=True),
                            Buffer(f"do{kind}{i}", "kv_rows", (BH, Wkv * g, Dh), "stat", backward=True),
                            Buffer(f"p{kind}{i}", "kv_rows", (BH, Wkv * g, n_keys), "stat", zero=True, backward=True),
                            Buffer(f"ds{kind}{i}", "kv_rows", (BH, Wkv * g, n_keys), "stat", zero=True,
                                   backward=True)]
    if with_input and grad:
        out += [Buffer("a0", "saved", (slots, B, d), "compute"), Buffer("r0", "saved", (slots, B, 1), "stat"),
                # u_t's gradient: recur's dY and the embedding's
                Buffer("du", "input_grads", (T, B, d), "stream", backward=True)]
    if grad and checkpoint is not None and keep_inputs:  # what a segment's recomputation starts from
        out.append(Buffer("x", "inputs", (T, B, d), "stream"))
    return out


def aligned_bytes(buf: Buffer, role_bytes: dict[str, int]) -> int:
    """The buffer's bytes in its slab (every buffer starts on a cache line)."""
    return aligned(math.prod(buf.shape) * role_bytes[buf.role])


def bytes_by_purpose(buffers: Sequence[Buffer], role_bytes: dict[str, int], backward: Optional[bool] = None
                     ) -> dict[str, int]:
    """Bytes of ``buffers`` by purpose (``backward``: only the scratch, or only the forward's slab)."""
    out = dict.fromkeys(PURPOSES, 0)
    for b in buffers:
        if backward is None or b.backward == backward:
            out[b.purpose] += aligned_bytes(b, role_bytes)
    return out
