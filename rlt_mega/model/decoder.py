"""The fused decoder training step: explicit per-position forward and backward over
preallocated buffers, with deferred weight gradients.

A :class:`DecoderStack` holds a set of decoder layers (and, on the first pipeline stage, the
recurrence input ``u = embed[x_t] + recur_proj(recur_norm(z_{t-1}))``) as prepared products
(model/kernels.py). A :class:`DecoderRun` is one batch of sequences through it:

    run.forward(t, x, e)  -> y      position t, in increasing t; x: z_{t-1} (with the input
                                    layer) or the stage's input; e: embed[x_t]; y (B, d)
    run.backward(t, gy)   -> gx     in decreasing t; gy: the gradient of y; gx: of x
    run.memory_grads(), run.input_grads()     once every position is done

Why this shape. Every consumer runs positions one at a time: the dense schedule's autograd
Function (model/dense_decode.py) loops over the whole sequence; a pipeline stage
(parallel/stage.py) gets each position's output gradient over the wire and calls ``backward``
for it. One object with explicit per-position calls serves both, and the Function around it is
a loop, not a graph of T x L x ~50 nodes: per layer and position the forward is ~40 operators
and the backward ~50 (the module path: ~50 and ~120, each with autograd bookkeeping).

What backward keeps. The forward saves, per layer and position, only what the backward reads:
the normalised inputs and 1/rms of the three norms, the RoPE'd q, the attention outputs, the
cross query, gate/up and the SwiGLU product (the residual stream is never needed). Attention
probabilities are recomputed (one query row per head: cheaper than storing (T, B, h, T)).

Deferred weight gradients. The input gradients must be computed position by position (the
recurrence); the weight gradients need not. Each product's input X (saved anyway) and output
gradient dY (written into a ring of W positions) are kept, and every W positions one GEMM per
weight over the W x B rows, ``acc.addmm_(dY^T, X)``, adds them to the weight's accumulator
(cuDNN's RNNs do the same). W = ceil(512 / B) (rows enough to run that GEMM at the CPU's matmul
peak) depends on B alone, so the flushes, and their rounding, are the same in every
checkpointing mode. What it costs: the dY ring, W x B rows of (h + 2 h_kv) Dh + h Dh + 2F + 3d
values per layer (small_cpu, B=8: 26 MB for its 4 layers), and one fp32 accumulator per fused
weight (a copy of the decoder's weights).

Deferred K/V gradients, the same idea for attention. Position t's query adds to the gradient of
every key and value s <= t; done directly that is a (B h_kv, Dh, t+1) outer product written per
position, O(T) memory traffic per position for each of the self-attention and the memory. Only
the keys of the current chunk of ``KV_CHUNK`` positions are needed soon (a position's own K/V
gradient is complete when its backward runs, since every later position has run), so those are
added directly, and the rest (keys before the chunk, and the whole memory, whose gradient is only
needed at the end) is formed once per chunk as one batched GEMM over the chunk's stored score
gradients and probabilities.

Checkpointing. Without it ("save") the forward keeps, per layer and position, what the backward
and the weight-gradient flush read (above: the "saved" buffers). A checkpointed run (``checkpoint=k``: train.checkpointing.decoder=every_k
with decoder_k=k; "step" is k = 1) keeps per position only what cannot be recomputed from the
position before: the stage's input x (z_{t-1}, or the previous stage's output; the embeddings are
the caller's) and the decoder and memory K/V that attention reads. Before the backward of a segment
of k positions (``backward`` at the segment's last position) its forward, attention included, is
recomputed in order into a ring of activation slots (model/run_buffers.ring_slots: whole
weight-gradient chunks covering W + k - 1 positions, what must be live together), and the
deferred weight-gradient flush reads its inputs from that ring. The recomputation repeats the
forward's operations on the same values (the K/V it reads are the kept ones, rewritten by
nobody), and the flushes do not depend on the mode, so the gradients of every mode are the same,
bit for bit. Its cost: one more forward of the decoder per step (Megatron's full recomputation;
keeping the normalised inputs instead, as a selective scheme would, costs 3d + 2 h Dh values per
row, layer and position: at rlt_48x48's sizes more than the K/V themselves).

Memory. A run's buffers are one list, model/run_buffers.run_buffers (a pure function of shapes
and mode that the planner prices too: cost/fused_memory.py), in two parts: the forward's slab (what
the backward reads: the kept tensors, the stage inputs and the K/V), taken from the workspace pool
(model/workspace.py) and alive as long as the graph, and the backward's scratch (the weight-gradient
rings, the K/V gradients and rows, the embeddings' gradient: ``scratch_bytes()``), allocated by the
first backward and freed by ``release_scratch()``, which the dense schedule calls once its backward
has returned everything: the encoder's backward and the optimizer step run without it (a second
backward through the same graph allocates it again). The K/V gradients are one slab per layer,
freed by ``memory_grads`` as soon as that layer's copies are made. The weight-gradient
accumulators are the backward's too; it hands them to autograd and keeps no reference.

The capture-ready step (``static=True``). Nothing in a position's computation depends on t
through a shape or a Python value: t is a device tensor, K/V and saved tensors are written with
``index_copy_`` and read with ``index_select``, RoPE rows are looked up by index, both attentions
run over the full capacity under an additive mask built on the device, and the K/V gradients
accumulate directly over the full capacity (no chunks). So one position's forward (or backward)
can be captured once and replayed for every t (a capture wrapper outside model/). The eager
form (the default) slices exactly the visible keys with Python ints: fewer FLOPs, and no host
synchronisation either.

Rows and positions (eager form only). Per-row positions are ``Step.rows`` (the rollout), packed
documents ``Step.documents`` (model/layout.py). Rows (schedule/dense.py): A :class:`DensePlan` (the learner's
compaction and shared prompts) says which rows each position runs on; the step itself does not
change: the per-position tensors are rows [:n] of their buffers, the batch-major K/V a prefix of
the physical row order or gathered by index, and the run maps the caller's rows in and out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F

from rlt_mega.model.kernels import Gemm, LayerGemms, attend, attention_grads, rms_backward, rms_forward, rope
from rlt_mega.model.layout import StaticStep, Step
from rlt_mega.model.run_buffers import KV_CHUNK, PURPOSES, RING, SAVED, ring_slots, run_buffers, wgrad_positions
from rlt_mega.model.stack import DecoderStack, KVState, WeightGrads
from rlt_mega.model.workspace import Slab

if TYPE_CHECKING:  # the schedule's rows are passed in (a layout the model reads); model/ never imports them
    from rlt_mega.schedule.dense import DensePlan

def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in ``dtype``; without a dispatch when it already is (the per-position loop's common case)."""
    return x if x.dtype == dtype else x.to(dtype)


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------

_NOT_KEPT = dict.fromkeys(SAVED)  # (read only) a forward that keeps nothing of these


class DecoderRun:
    """One batch of B sequences through a stack, positions [0, capacity).

    memory: per layer of the stack, the memory K/V (B, h_kv, S, Dh) (slot 0 the null memory),
    any dtype, read only. grads: the accumulators of the deferred weight gradients (None: no
    backward). checkpoint: k, keep the stage inputs and recompute segments of k positions
    (None: keep everything); embeddings (T, B, d): e_t for the recomputation (the input layer);
    keep_inputs=False: the caller keeps the inputs (the captured run). static: the capture-ready form. rows: which rows each position
    runs on (schedule/dense.py; None: all of them); x, e, y and their gradients stay (B, d) in
    the caller's order, dead rows 0."""

    def __init__(self, stack: DecoderStack, batch: int, capacity: int,
                 memory: Optional[Sequence[tuple[torch.Tensor, torch.Tensor]]] = None, grads: Optional[WeightGrads] = None,
                 checkpoint: Optional[int] = None, static: bool = False, rows: Optional[DensePlan] = None,
                 state: Optional[KVState] = None, documents=None, z0: Optional[torch.Tensor] = None,
                 embeddings: Optional[torch.Tensor] = None, keep_inputs: bool = True) -> None:
        spec = stack.spec
        if rows is not None and (static or rows.B != batch or rows.T < capacity):
            raise ValueError(f"a row plan of {rows.B} rows x {rows.T} positions for a {'static ' if static else ''}"
                             f"run of {batch} x {capacity}: the capture-ready form runs every row, and the plan "
                             "must be the run's")
        if (state is None) == (memory is None):
            raise ValueError("a decoder run takes the memory K/V (the dense schedule) or a K/V state (the rollout)")
        if documents is not None and (static or rows is not None or (spec.with_input and z0 is None)):
            raise ValueError("packed documents run the eager form on every row, and need z_init (z0) to restart from")
        if checkpoint is not None and checkpoint < 1:
            raise ValueError(f"a checkpointed run recomputes segments of k >= 1 positions, not {checkpoint}")
        self.stack, self.B, self.capacity, self.grads, self.static = stack, batch, capacity, grads, static
        self.row_plan = rows
        B, d, Dh = batch, stack.d, spec.head_dim
        h, h_kv = spec.num_heads, spec.num_kv_heads
        self.h, self.h_kv, self.g = h, h_kv, (h // h_kv if h_kv else 0)
        grad = grads is not None
        # checkpoint: segments of k positions recomputed before their backward (model/run_buffers.py)
        self.checkpoint = checkpoint if grad else None
        self.slots = ring_slots(batch, capacity, self.checkpoint)
        self.chunk = wgrad_positions(batch, capacity)
        self.kv_chunk = min(KV_CHUNK, capacity)
        self.documents = documents
        self.z0 = None if z0 is None else z0.detach()  # z_init per row: where a packed document restarts
        self.z0_grad: Optional[torch.Tensor] = None  # its gradient from the restarts (added by the caller)
        self.embeddings = embeddings  # (T, B, d), any strides: e_t for a segment's recomputation
        if state is not None:
            S = next(iter(state.mkt4.values())).shape[-1] if state.mkt4 else 1
        else:
            S = memory[0][0].shape[2] if len(memory) else 1
        self.mem_capacity = S
        # the forward's buffers (what the backward reads: the kept tensors and the K/V), and the
        # backward's own scratch (the rings, K/V gradients and rows, the embeddings' gradient):
        # both from the one list the planner prices (model/run_buffers.py)
        buffers = run_buffers(spec.layers, B, capacity, S, d, Dh, h, h_kv, stack.ffn, grad=grad,
                              with_input=spec.with_input, checkpoint=self.checkpoint, static=static,
                              own_kv=state is None, keep_inputs=keep_inputs)
        dtypes = {"compute": stack.compute_dtype, "stream": stack.stream_dtype, "stat": stack.stat_dtype}
        slab, scratch = Slab(stack.device), Slab(stack.device)
        # the K/V gradients: a slab per layer, each freed once its memory gradient is out (memory_grads)
        kv_grads = {i: Slab(stack.device) for i in spec.layers}
        self._purpose = {b.name: b.purpose for b in buffers}
        for b in buffers:  # under a row plan the deferred K/V rows of the rows a position does not run stay 0
            into = slab if not b.backward else (scratch if b.layer is None else kv_grads[b.layer])
            into.add(b.name, b.shape, dtypes[b.role], b.zero or (rows is not None and b.purpose == "kv_rows"))
        self._scratch_sizes = {**scratch.sizes(), **{n: v for s in kv_grads.values() for n, v in s.sizes().items()}}
        self._sizes = {**slab.sizes(), **self._scratch_sizes}
        self.tensors = slab.allocate(self)
        self.buf = {i: ({n: self.tensors[f"{n}{i}"] for n in SAVED} if grad else {}) for i in spec.layers}
        self.xs = self.tensors.get("x")  # (T, B, d): the kept stage inputs of a checkpointed run
        self.state = state
        if state is None:
            self.state = KVState(*({i: self.tensors[f"{n}{i}"] for i in spec.layers} for n in ("kt", "v", "mkt", "mv")))
            self.load_memory(memory)
        self.a0 = self.r0 = None
        if spec.with_input and grad:
            self.a0, self.r0 = self.tensors["a0"], self.tensors["r0"]
        self._scratch = scratch if grad else None
        self._kv_grad_slabs = kv_grads
        self._scratch_names: tuple[str, ...] = ()
        self._kv_released = False  # memory_grads has freed the K/V gradients
        if grad and static:  # a captured step reads fixed addresses: the scratch lives as long as the run
            self._bind_scratch()
        self.position = None
        if static:
            self.position = StaticStep(capacity, S, self.slots, self.chunk, stack.C, stack.tables,
                                       stack.compute_dtype, stack.device, batch)

    def buffer_bytes(self) -> dict[str, int]:
        """This run's buffers by purpose, in bytes (the backward's scratch included, allocated
        or not): what the backward keeps ("saved": the activation slots and the attention
        outputs), what deferring costs ("wgrad_ring": the products' output gradients; "kv_rows":
        the rows of the deferred K/V gradients), the K/V with their gradients ("kv"), and the
        embeddings' gradient ("input_grads")."""
        out = dict.fromkeys(PURPOSES, 0)
        for name, nbytes in self._sizes.items():
            out[self._purpose[name]] += nbytes
        return out

    def scratch_bytes(self) -> int:
        """Bytes of the backward's scratch (part of :meth:`buffer_bytes`): allocated by the first
        backward, freed by :meth:`release_scratch`."""
        return sum(self._scratch_sizes.values())

    def _bind_scratch(self) -> None:
        """Allocates the backward's scratch (zeroed where it accumulates) and binds its views."""
        spec, B, Dh, cap = self.stack.spec, self.B, self.stack.spec.head_dim, self.capacity
        BH = B * self.h_kv
        tensors = self._scratch.allocate(self, pooled=False)
        for layer_slab in self._kv_grad_slabs.values():
            tensors.update(layer_slab.allocate(self, pooled=False))
        self._scratch_names = tuple(tensors)
        self._kv_released = False
        self.tensors.update(tensors)
        for i in spec.layers:
            self.buf[i].update({n: tensors[f"{n}{i}"] for n in RING})
        self.du = tensors["du"] if spec.with_input else None
        self.gkt4 = {i: tensors[f"gkt{i}"] for i in spec.layers}
        self.gv4 = {i: tensors[f"gv{i}"] for i in spec.layers}
        self.gkt = {i: self.gkt4[i].view(BH, Dh, cap) for i in spec.layers}
        self.gv = {i: self.gv4[i].view(BH, cap, Dh) for i in spec.layers}
        self.gmkt = {i: tensors[f"gmkt{i}"] for i in spec.layers}
        self.gmv = {i: tensors[f"gmv{i}"] for i in spec.layers}
        if not self.static:  # (kind, layer) -> the stored rows q, do, p, ds of the deferred K/V gradients
            self.kv_rows = {(kind, i): tuple(tensors[f"{n}{kind}{i}"] for n in ("q", "do", "p", "ds"))
                            for kind in "sm" for i in spec.layers}

    def release_scratch(self) -> None:
        """Frees the backward's scratch (after :meth:`memory_grads` and :meth:`input_grads`):
        the rest of the step (the encoder's backward, the optimizer) runs without it. A later
        backward through the same forward allocates it again."""
        if not self._scratch_names or self.static:
            return
        for name in self._scratch_names:
            self.tensors.pop(name, None)
        for i in self.stack.spec.layers:
            for n in RING:
                del self.buf[i][n]
        self.du = self.gkt4 = self.gv4 = self.gkt = self.gv = self.gmkt = self.gmv = self.kv_rows = None
        self._scratch_names = ()

    def load_memory(self, memory: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The memory K/V (B, h_kv, S, Dh) per layer, copied into the step's layout (once per batch)."""
        self.mem_meta = {}
        for i, (k, v) in zip(self.stack.spec.layers, memory):
            B, h_kv, S, Dh = k.shape
            self.mem_meta[i] = (k.shape, k.dtype)
            if self.row_plan is not None:  # the physical row order
                k, v = self.row_plan.to_physical(k.detach()), self.row_plan.to_physical(v.detach())
            self.state.mkt4[i].copy_(k.detach().transpose(-1, -2))
            self.state.mv4[i].copy_(v.detach())

    # ------------------------------------------------------------------ positions
    def at(self, t: int):
        """The step object of position t (static: the run's own, moved to t on the device)."""
        if self.static:
            self.position.t.fill_(t)
            self.position.update()
            return self.position
        s = self.stack
        slot, ring = t % self.slots, t % self.chunk
        if self.documents is not None:
            return Step.documents(t, self.documents, s.tables, s.C, self.h_kv, s.compute_dtype, batch=self.B,
                                  slot=slot, ring=ring)
        step = None if self.row_plan is None else self.row_plan.step(t)
        if step is None:
            return Step.at(t, s.tables, s.C, batch=self.B, slot=slot, ring=ring)
        return Step.at(t, s.tables, s.C, batch=self.B, slot=slot, ring=ring, rows=step.n, idx=step.idx)

    def reset_grads(self) -> None:
        """Zeroes the K/V gradient accumulators: each backward pass starts from zero (a second
        backward through the same forward gives the same gradients)."""
        self.z0_grad = None
        if not self._scratch_names or self._kv_released:
            self.release_scratch()
            self._bind_scratch()  # fresh: zeroed
            return
        for i in self.stack.spec.layers:
            for buf in (self.gkt4[i], self.gv4[i], self.gmkt[i], self.gmv[i]):
                buf.zero_()

    # ------------------------------------------------------------------ forward
    def forward(self, t: int, x: Optional[torch.Tensor], e: Optional[torch.Tensor] = None,
                mode: str = "save") -> Optional[torch.Tensor]:
        """Position t: x (B, d) in the stream dtype (z_{t-1} with the input layer), e (B, d)
        contiguous, the embedding of x_t (input layer only) -> y (B, d). mode: "save" (keep
        everything the backward reads), "checkpoint" (keep the K/V and the stage input x only),
        "recompute" (after "checkpoint", in the backward: position t again from the kept x into
        its ring slot, the K/V left as they are; x and e unused, returns None; ``backward`` runs
        it a segment at a time) or "none" (no backward: keep the K/V only)."""
        if mode == "checkpoint" and self.xs is not None:
            self.xs[t].copy_(x)
        if mode == "recompute":
            x = self.xs[t]
            e = None if self.embeddings is None else self.embeddings[t].contiguous()
        step = None if self.row_plan is None else self.row_plan.step(t)
        if step is None:
            y = self.step_forward(self.at(t), x, e, mode)
            return None if mode == "recompute" else y
        pos = self.at(t)
        if self.grads is not None and step.n < self.B and mode != "checkpoint":
            self._zero_idle_inputs(pos, step.n)
        if mode == "recompute":
            if step.n:
                self.step_forward(pos, step.gather(x), None if e is None else step.gather(e), mode)
            return None
        for fork in step.forks:  # the representative's K/V history into the group's other rows
            for i in self.stack.spec.layers:
                kt, v = self.state.kt4[i], self.state.v4[i]
                kt[fork.others, :, :, :fork.p] = kt[fork.rep, :, :, :fork.p]
                v[fork.others, :, :fork.p] = v[fork.rep, :, :fork.p]
        if step.n == 0:
            return x.new_zeros(self.B, x.shape[-1])
        y = self.step_forward(pos, step.gather(x), None if e is None else step.gather(e), mode)
        return step.outputs(y)

    def recompute(self, t0: int, t1: int) -> None:
        """Positions [t0, t1) of a checkpointed run again, in order, from the kept stage inputs
        into their ring slots (attention included: it reads the kept K/V)."""
        if self.stack.spec.with_input and self.embeddings is None:
            raise ValueError("a checkpointed run with the input layer recomputes from the embeddings: pass "
                             "embeddings= (T, B, d) to DecoderRun")
        for t in range(t0, t1):
            self.forward(t, None, None, mode="recompute")

    def _zero_idle_inputs(self, pos, n: int) -> None:
        """Under a row plan: rows [n:] of the products' inputs that the weight-gradient flush
        reads at this position are zeros (their output gradients are zero too, and 0 x whatever
        a reused buffer held could be NaN)."""
        for i in self.stack.spec.layers:
            b = self.buf[i]
            for name in ("a1", "o1", "a2", "c", "a3", "f"):
                b[name][pos.slot, n:].zero_()
        if self.stack.spec.with_input:
            self.a0[pos.slot, n:].zero_()

    def step_forward(self, pos, x: Optional[torch.Tensor], e: Optional[torch.Tensor], mode: str) -> torch.Tensor:
        stack = self.stack
        keep = mode in ("save", "recompute")
        with torch.autocast(device_type=stack.device.type, enabled=False):
            if stack.spec.with_input:
                if pos.reset is not None:  # a packed document starts here: its rows restart from z_init
                    x = torch.where(pos.reset[:, None], self.z0, x)
                a0 = self._norm(x, pos, self.a0 if keep else None, self.r0 if keep else None)
                x = stack.recur.add(a0, e)  # e_t + recur_proj(recur_norm(z_{t-1}))
            for i in stack.spec.layers:
                x = self._layer_forward(i, pos, x, mode)
        return x

    def _norm(self, x: torch.Tensor, pos, buf_a: Optional[torch.Tensor], buf_r: Optional[torch.Tensor]) -> torch.Tensor:
        """x / rms(x), kept with 1/rms in the position-indexed buffers when given."""
        a, r = rms_forward(x, self.stack.norm, self.stack.compute_dtype,
                           out=None if buf_a is None else pos.out(buf_a),
                           out_r=None if buf_r is None else pos.out(buf_r))
        if buf_a is not None:
            pos.keep(buf_r, r)
            pos.keep(buf_a, a)
        return a

    def _residual(self, gemm: Gemm, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + a @ w^T; for a row-parallel product the partial sums are all-reduced first."""
        if self.stack.all_reduce is None:
            return gemm.add(a, x)
        y = gemm(a)
        self.stack.all_reduce(y)
        return x + y

    def _layer_forward(self, i: int, pos, x: torch.Tensor, mode: str) -> torch.Tensor:
        w, B, Dh = self.stack.layers[i], pos.n, self.stack.spec.head_dim
        h, h_kv, g = self.h, self.h_kv, self.g
        keep = mode in ("save", "recompute")  # what the backward reads, into the position's slot
        b = self.buf[i] if keep else _NOT_KEPT
        # self-attention over the decoder's K/V of positions [0, t]
        a1 = self._norm(x, pos, b["a1"], b["r1"])
        qk, v = self._qk(w, pos, a1, b["qk"])
        if mode != "recompute":  # (recomputing: the same values are there already)
            pos.write_kv(self.state.kt4[i], self.state.v4[i], qk[:, h:], v)
        x = self._residual(w.o, self._attention(i, "s", pos, qk[:, :h].reshape(B * h_kv, g, Dh), keep), x)
        # cross-attention into {null} + the visible memory
        a2 = self._norm(x, pos, b["a2"], b["r2"])
        cq = pos.keep(b["cq"], w.cross_q(a2))  # (B, h Dh)
        x = self._residual(w.cross_o, self._attention(i, "m", pos, cq.view(B * h_kv, g, Dh), keep), x)
        # SwiGLU MLP
        a3 = self._norm(x, pos, b["a3"], b["r3"])
        return self._residual(w.down, self._mlp(w, pos, a3, b["gu"], b["f"]), x)

    def _qk(self, w: LayerGemms, pos, a1: torch.Tensor, buf: Optional[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q and k at the position, RoPE'd (q scaled) (B, h + h_kv, Dh), and v (B, h_kv, Dh)."""
        B, Dh, h, h_kv = pos.n, self.stack.spec.head_dim, self.h, self.h_kv
        qkv = w.qkv(a1)  # (B, (h + 2 h_kv) Dh)
        out = pos.out(buf)
        qk = rope(qkv[:, :(h + h_kv) * Dh].view(B, h + h_kv, Dh), pos.cos, pos.sin_fwd,
                  out=None if out is None else out.view(B, h + h_kv, Dh))
        pos.keep(buf, qk.view(B, -1))
        return qk, qkv[:, (h + h_kv) * Dh:].view(B, h_kv, Dh)

    def _mlp(self, w: LayerGemms, pos, a3: torch.Tensor, buf_gu: Optional[torch.Tensor],
             buf_f: Optional[torch.Tensor]) -> torch.Tensor:
        """silu(gate) * up of gate/up = gate_up(a3) -> (B, F), both kept in their slots when given."""
        gu = pos.keep(buf_gu, w.gate_up(a3))  # (B, 2F)
        ffn = gu.shape[1] // 2
        return pos.keep(buf_f, torch.mul(F.silu(gu[:, :ffn]), gu[:, ffn:], out=pos.out(buf_f)))

    def _attention(self, i: int, kind: str, pos, q: torch.Tensor, keep: bool) -> torch.Tensor:
        """Layer i's self ("s") or memory ("m") attention of q (B h_kv, g, Dh) -> (B, h Dh),
        kept per position when ``keep``."""
        buf = self.buf[i]["o1" if kind == "s" else "c"] if keep else None
        st = self.state
        keys_t, values = pos.self_keys(st.kt[i], st.v[i]) if kind == "s" else pos.mem_keys(st.mkt[i], st.mv[i])
        out = None if buf is None else pos.out(buf)
        y = attend(q, keys_t, values, pos.self_mask if kind == "s" else pos.mem_mask,
                   out=None if out is None else out.view(q.shape)).view(pos.n, -1)
        return y if buf is None else pos.keep(buf, y)

    # ------------------------------------------------------------------ backward
    def backward(self, t: int, gy: torch.Tensor) -> torch.Tensor:
        """Position t, after every later position: gy (B, d), the gradient of y -> the gradient
        of x (B, d) in the stream dtype. Reads position t's saved tensors: kept by the forward
        ("save"), or, checkpointed, recomputed here with the rest of t's segment of k positions
        when t is the segment's last. Flushes the deferred gradients when t is the first position
        of a chunk."""
        if not self._scratch_names:
            self._bind_scratch()
        if self.xs is not None and (t + 1 == self.capacity or (t + 1) % self.checkpoint == 0):
            self.recompute(t - t % self.checkpoint, t + 1)
        pos = self.at(t)
        step = None if self.row_plan is None else self.row_plan.step(t)
        if step is None:
            gx = self.step_backward(pos, gy)
        else:
            if step.n:
                gx = step.input_grads(self.step_backward(pos, step.output_grads(gy)))
            else:
                gx = torch.zeros_like(gy, dtype=self.stack.stream_dtype)
            if step.n < self.B:  # the other rows' output gradients are zeros in the flushes
                for i in self.stack.spec.layers:
                    for name in RING:
                        self.buf[i][name][pos.ring, step.n:].zero_()
                if self.stack.spec.with_input:
                    self.du[t, step.n:].zero_()
        if not self.static and t % self.kv_chunk == 0:
            self.flush_kv(t, min(t + self.kv_chunk, self.capacity))
        if step is not None and step.forks:
            self._join_forks(t, step)
        if t % self.chunk == 0:
            self.flush(t, min(t + self.chunk, self.capacity))
        return gx

    def _join_forks(self, t: int, step) -> None:
        """Backward of the forks at t: the group rows' gradients of the shared K/V history
        [0, t) sum into the representative's (this K/V chunk's deferred ones flushed first; the
        gradient of z_{t-1} sums through the outputs' readers, rows.RowStep)."""
        if t % self.kv_chunk:
            c0 = t - t % self.kv_chunk
            self.flush_kv(c0, min(c0 + self.kv_chunk, self.capacity))
        for fork in step.forks:
            for i in self.stack.spec.layers:
                gk, gv = self.gkt4[i], self.gv4[i]
                gk[fork.rep, :, :, :fork.p] += gk[fork.others, :, :, :fork.p].sum(0)
                gv[fork.rep, :, :fork.p] += gv[fork.others, :, :fork.p].sum(0)

    def step_backward(self, pos, gy: torch.Tensor) -> torch.Tensor:
        stack = self.stack
        layers = stack.spec.layers
        with torch.autocast(device_type=gy.device.type, enabled=False):
            g = gy
            if layers:  # the top layer's output gradient is the down product's dY: kept in its ring
                top = self.buf[layers[-1]]["g4"]
                g = pos.keep_ring(top, gy) if pos.static else pos.rows_of(top[pos.ring]).copy_(gy)
            for n in range(len(layers) - 1, -1, -1):
                into = None
                if n > 0:
                    into = self.buf[layers[n - 1]]["g4"]
                g = self._layer_backward(layers[n], pos, g, into)
            if not stack.spec.with_input:  # a later pipeline stage: what it sends back is in the stream dtype
                return g if g.dtype == stack.stream_dtype else g.to(stack.stream_dtype)
            # the recurrence input: u = e + recur(a0), a0 = z_{t-1} / rms; du is e's gradient too
            pos.put(self.du, pos.t, g)
            da0 = stack.recur.grad_input(_as(g, stack.compute_dtype))
            gx = rms_backward(da0, pos.load(self.a0), pos.load(self.r0), stack.norm, None).to(stack.stream_dtype)
            if pos.reset is not None:  # the restarted rows' gradient is z_init's, not z_{t-1}'s
                restart = pos.reset[:, None]
                g0 = torch.where(restart, gx, torch.zeros((), dtype=gx.dtype, device=gx.device))
                self.z0_grad = g0 if self.z0_grad is None else self.z0_grad + g0
                gx = gx.masked_fill(restart, 0)
            return gx

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The input gradient of a column-parallel product, summed over the shards."""
        if self.stack.all_reduce is not None:
            self.stack.all_reduce(x)
        return x

    def _layer_backward(self, i: int, pos, g4: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
        """g4: the gradient of layer i's output (in its ring slot) -> the gradient of its input,
        computed into ``into``'s ring slot when given (the layer below's g4)."""
        stack, w, b = self.stack, self.stack.layers[i], self.buf[i]
        B, Dh, h, h_kv, g = pos.n, stack.spec.head_dim, self.h, self.h_kv, self.g
        BH, cd, nc = B * h_kv, stack.compute_dtype, stack.norm
        # MLP: x4 = x3 + down(silu(gate) * up), gate/up = gate_up(a3)
        df = w.down.grad_input(_as(g4, cd))  # (B, F)
        gu = pos.load(b["gu"])
        ffn = gu.shape[1] // 2
        gate, up = gu[:, :ffn], gu[:, ffn:]
        dgu = pos.out_ring(b["dgu"])
        if dgu is None:
            dgu = pos.keep_ring(b["dgu"], torch.cat([torch.ops.aten.silu_backward(df * up, gate), df * F.silu(gate)], 1))
        else:
            torch.ops.aten.silu_backward.grad_input(df * up, gate, grad_input=dgu[:, :ffn])
            torch.mul(df, F.silu(gate), out=dgu[:, ffn:])
        da3 = self._reduce(w.gate_up.grad_input(dgu))
        g3 = pos.keep_ring(b["g3"], rms_backward(da3, pos.load(b["a3"]), pos.load(b["r3"]), nc, g4,
                                                 out=pos.out_ring(b["g3"])))
        # cross-attention: x3 = x2 + cross_o(attend(cross_q(a2), memory))
        dc = w.cross_o.grad_input(_as(g3, cd)).view(BH, g, Dh)
        cq = pos.load(b["cq"]).view(BH, g, Dh)
        dcq = self._attention_backward(i, "m", pos, cq, dc, pos.out_ring(b["dcq"]))
        dcq = pos.keep_ring(b["dcq"], dcq.view(B, h * Dh))
        da2 = self._reduce(w.cross_q.grad_input(dcq))
        g2 = pos.keep_ring(b["g2"], rms_backward(da2, pos.load(b["a2"]), pos.load(b["r2"]), nc, g3,
                                                 out=pos.out_ring(b["g2"])))
        # self-attention: x2 = x1 + o(attend(q, K/V of [0, t]))
        do1 = w.o.grad_input(_as(g2, cd)).view(BH, g, Dh)
        qk = pos.load(b["qk"]).view(B, h + h_kv, Dh)
        dq = self._attention_backward(i, "s", pos, qk[:, :h].reshape(BH, g, Dh), do1, None)
        dk_t, dv_t = pos.kv_grad(self.gkt4[i], self.gv4[i])  # complete: every later position has added its part
        dqk = torch.cat([dq.view(B, h, Dh), _as(dk_t, cd)], dim=1)  # (B, h + h_kv, Dh)
        dqkv = pos.out_ring(b["dqkv"])
        if dqkv is None:
            dqkv = pos.keep_ring(b["dqkv"], torch.cat([rope(dqk, pos.cos, pos.sin_bwd).view(B, -1),
                                                       _as(dv_t, cd).reshape(B, -1)], dim=1))
        else:
            rope(dqk, pos.cos, pos.sin_bwd, out=dqkv[:, :(h + h_kv) * Dh].view(B, h + h_kv, Dh))
            dqkv[:, (h + h_kv) * Dh:].view(B, h_kv, Dh).copy_(dv_t)
        da1 = self._reduce(w.qkv.grad_input(dqkv))
        g1 = rms_backward(da1, pos.load(b["a1"]), pos.load(b["r1"]), nc, g2,
                          out=None if into is None else pos.out_ring(into))
        return g1 if into is None else pos.keep_ring(into, g1)

    def _attention_backward(self, i: int, kind: str, pos, q: torch.Tensor, grad_out: torch.Tensor,
                            out: Optional[torch.Tensor]) -> torch.Tensor:
        """Backward of layer i's self ("s") or memory ("m") attention at pos -> the gradient of
        q (B h_kv, g, Dh). The K/V gradients: the static form adds them directly over the full
        capacity; the eager form adds those of the current K/V chunk's keys directly and keeps
        the rest for :meth:`flush_kv`."""
        if kind == "s":
            keys_t, values = pos.self_keys(self.state.kt[i], self.state.v[i])
            gk, gv, mask = self.gkt[i], self.gv[i], pos.self_mask
        else:
            keys_t, values = pos.mem_keys(self.state.mkt[i], self.state.mv[i])
            gk, gv, mask = self.gmkt[i], self.gmv[i], pos.mem_mask
        probs, grad_s, grad_q = attention_grads(q, keys_t, values, grad_out, mask,
                                                out=None if out is None else out.view(q.shape))
        acc = gk.dtype
        qa, ga = _as(q, acc), _as(grad_out, acc)
        if pos.static:  # every key, masked ones with zero probability and score gradient
            gk.baddbmm_(qa.transpose(1, 2), grad_s)
            gv.baddbmm_(probs.transpose(1, 2), ga)
            return grad_q
        n, g = keys_t.shape[-1], self.g
        c0 = pos.t - pos.t % self.kv_chunk  # the K/V chunk's first position
        lo = c0 if kind == "s" else n  # keys added directly: [c0, n) for self, none for the memory
        if pos.idx is not None:  # rows by index (rows.py): every key added directly
            lo = 0
        if n > lo:
            if g == 1 and pos.idx is None:  # one query row per key/value head: a rank-1 update, one kernel
                pos.batch_rows(gk)[:, :, lo:n].addcmul_(qa.transpose(1, 2), grad_s[:, :, lo:n])  # (B h_kv, Dh, 1) x (B h_kv, 1, n)
                pos.batch_rows(gv)[:, lo:n].addcmul_(probs[:, :, lo:n].transpose(1, 2), ga)  # (B h_kv, n, 1) x (B h_kv, 1, Dh)
            else:
                pos.add_rows(gk[:, :, lo:n], torch.bmm(qa.transpose(1, 2), grad_s[:, :, lo:n]))
                pos.add_rows(gv[:, lo:n], torch.bmm(probs[:, :, lo:n].transpose(1, 2), ga))
        if lo > 0:  # the rest: this position's rows, for the chunk's GEMM
            r, rows = (pos.t - c0) * g, q.shape[0]  # rows: the active rows' B h_kv (a prefix)
            rq, rdo, rp, rds = self.kv_rows[kind, i]
            rq[:rows, r:r + g].copy_(qa)
            rdo[:rows, r:r + g].copy_(ga)
            rp[:rows, r:r + g, :lo].copy_(probs[:, :, :lo])
            rds[:rows, r:r + g, :lo].copy_(grad_s[:, :, :lo])
        return grad_q

    # ------------------------------------------------------------------ deferred gradients
    def flush_kv(self, t0: int, t1: int) -> None:
        """The deferred K/V gradients of the chunk [t0, t1): for each layer, the self keys
        before t0 and the memory's keys, one batched GEMM each from the stored rows (of the
        chunk's active rows, a prefix of the physical order under a row plan)."""
        rows, bh = (t1 - t0) * self.g, self.chunk_rows(t0, t1) * self.h_kv
        # the memory slots the chunk's positions read: [0, 1 + vis(t1 - 1)), or with packed
        # documents every slot up to t1 (Step.documents: masked per row)
        mem_reach = 1 + t1 if self.documents is not None else 1 + self.stack.C * (t1 // self.stack.C)
        for i in self.stack.spec.layers:
            for kind, gk, gv, n in (("s", self.gkt[i], self.gv[i], t0), ("m", self.gmkt[i], self.gmv[i], mem_reach)):
                n = min(n, gk.shape[-1])
                if n == 0 or bh == 0:
                    continue
                rq, rdo, rp, rds = self.kv_rows[kind, i]
                q, do, p, ds = rq[:bh, :rows], rdo[:bh, :rows], rp[:bh, :rows, :n], rds[:bh, :rows, :n]
                gk[:bh, :, :n].add_(torch.bmm(q.transpose(1, 2), ds))  # (B h_kv, Dh, n)
                gv[:bh, :n].add_(torch.bmm(p.transpose(1, 2), do))  # (B h_kv, n, Dh)
                p.zero_()  # rows of a later chunk (fewer visible memory slots) must not see these
                ds.zero_()

    def chunk_rows(self, t0: int, t1: int) -> int:
        """The most rows any position of [t0, t1) runs on (B without a row plan): the flushes'
        GEMMs cover rows [:m] of each position (the rest of them never ran there)."""
        if self.row_plan is None:
            return self.B
        return max(self.B if s is None else s.n for s in map(self.row_plan.step, range(t0, t1)))

    def flush(self, t0: int, t1: int) -> None:
        """Adds the weight gradients of positions [t0, t1) (one chunk) to the accumulators: one
        GEMM per weight over their (t1 - t0) x m rows (m = ``chunk_rows``: B without a row plan;
        under one, rows [n_t:m] of position t hold zero output gradients)."""
        acc = self.grads.acc
        n, m = t1 - t0, self.chunk_rows(t0, t1)
        rows = n * m
        s0 = t0 % self.slots  # a chunk is contiguous in the slots (a multiple of it, or all) and starts the ring
        if rows == 0:
            return

        def add(key, dy: torch.Tensor, x: torch.Tensor) -> None:
            a = acc[key]
            if m < self.B:  # (n, m, .) of (n, B, .): a copy, far cheaper than the GEMM's rows it saves
                dy, x = dy[:, :m], x[:, :m]
            dy, x = dy.reshape(rows, -1), x.reshape(rows, -1)
            a.addmm_(dy.t().to(a.dtype), x.to(a.dtype))  # (out, in) += dY^T X

        for i in self.stack.spec.layers:
            b = self.buf[i]
            saved = {name: b[name][s0:s0 + n] for name in ("a1", "a2", "a3", "o1", "c", "f")}
            ring = {name: b[name][:n] for name in RING}
            add((i, "qkv"), ring["dqkv"], saved["a1"])
            if (i, "qkv_bias") in acc:
                bias = acc[(i, "qkv_bias")]
                bias.add_(ring["dqkv"][:, :m].reshape(rows, -1).sum(0, dtype=bias.dtype))
            add((i, "o"), ring["g2"], saved["o1"])
            add((i, "cross_q"), ring["dcq"], saved["a2"])
            add((i, "cross_o"), ring["g3"], saved["c"])
            add((i, "gate_up"), ring["dgu"], saved["a3"])
            add((i, "down"), ring["g4"], saved["f"])
        if self.stack.spec.with_input:
            add((-1, "recur"), self.du[t0:t1], self.a0[s0:s0 + n])

    # ------------------------------------------------------------------ results
    def memory_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: the gradients of the memory K/V given at construction, in their shapes
        (B, h_kv, S, Dh) and dtypes (new tensors). Once every position's backward has run:
        each layer's K/V gradients are freed as soon as its copies are made (the eager form;
        the captured one keeps its addresses), so the copies never all sit beside them; a
        later backward allocates them again."""
        out = []
        for i in self.stack.spec.layers:
            (B, h_kv, S, Dh), dtype = self.mem_meta[i]
            gk = self.gmkt[i].view(B, h_kv, Dh, S).transpose(-1, -2).to(dtype, copy=True)
            gv = self.gmv[i].view(B, h_kv, S, Dh).to(dtype, copy=True)
            if self.row_plan is not None:
                gk, gv = self.row_plan.to_caller(gk), self.row_plan.to_caller(gv)
            out.append((gk, gv))
            if not self.static:
                for name in ("gkt", "gv", "gmkt", "gmv"):
                    self.tensors.pop(f"{name}{i}")
                for views in (self.gkt4, self.gv4, self.gkt, self.gv, self.gmkt, self.gmv):
                    del views[i]
                self._kv_released = True
        return out

    def input_grads(self) -> torch.Tensor:
        """With the input layer: the gradient of every position's embedding, (B, capacity, d)
        (a new tensor)."""
        if self.row_plan is None:
            return self.du.transpose(0, 1).clone()
        out = torch.zeros(self.B, self.capacity, self.du.shape[-1], dtype=self.du.dtype, device=self.du.device)
        for t in range(self.capacity):  # position t's rows [:n] are its active rows, in their order
            step = self.row_plan.step(t)
            if step is None:
                out[:, t].copy_(self.du[t])
            elif step.n:
                out[:, t].index_copy_(0, step.caller, self.du[t, :step.n])
        return out


# ------------------------------------------------------------------------------------------
# The rollout's and the replay's decoder
# ------------------------------------------------------------------------------------------

class StepRunner:
    """The decoder of one micro-batch of a rollout or replay (rollout/executor.py): the K/V state
    of ``batch`` rows (the call's slots: the executor moves rows inside it when its batch changes)
    and the step's forward without saving anything for backward, on the stack's products.

    null_memory (d,): written into slot 0 of every row's memory once (every row's is the same)."""

    def __init__(self, stack: DecoderStack, batch: int, capacity: int, null_memory: torch.Tensor) -> None:
        spec = stack.spec
        self.stack, self.batch = stack, batch
        self.state = KVState.zeros(spec.layers, batch, spec.num_kv_heads, spec.head_dim, capacity, 1 + capacity,
                                   stack.compute_dtype, stack.device)
        self.run = DecoderRun(stack, batch, capacity, state=self.state)
        self.write_memory(null_memory.detach().to(stack.compute_dtype).expand(batch, 1, -1), -1)

    def restack(self, stack: DecoderStack, null_memory: torch.Tensor) -> None:
        """New products (the same spec and shapes, other parameters) for the steps to come; the
        null memory's slot rewritten from ``null_memory``, the state kept."""
        self.stack = self.run.stack = stack
        self.write_memory(null_memory.detach().to(stack.compute_dtype).expand(self.batch, 1, -1), -1)

    def at(self, k: int, t: int, n: int) -> Step:
        """Step k with its n rows (the prefix of the state's rows) all at position t."""
        return Step.at(t, self.stack.tables, self.stack.C, batch=self.batch, rows=n)

    def rows(self, k: int, pos: torch.Tensor, num_keys: int) -> Step:
        """Step k with row b of the prefix at position pos[b] ((n,) on the device)."""
        s = self.stack
        return Step.rows(k, pos, num_keys, s.tables, s.C, s.spec.num_kv_heads, s.compute_dtype, batch=self.batch)

    @torch.no_grad()
    def write_memory(self, m: torch.Tensor, start: int, rows: Optional[torch.Tensor] = None) -> None:
        """Memory m (n, C, d) (memory_norm applied) of positions [start, start + C): of rows [:n],
        or of ``rows`` (n,)."""
        for i, k, v in self.stack.memory_kv(m):
            self.state.write_memory(i, 1 + start, k, v, rows)

    @torch.no_grad()
    def step(self, step: Step, x: torch.Tensor, e: Optional[torch.Tensor]) -> torch.Tensor:
        """x (n, d) in the stream dtype: z_{k-1} (with the input layer) or the previous stage's
        output; e (n, d) the embeddings of x_t (input layer only) -> (n, d)."""
        return self.run.step_forward(step, x, e, "none")
