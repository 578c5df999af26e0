"""CUDA graphs of the decoder step (``train.cuda_graphs``): a wrapper applied from outside the model
(``install_cuda_graphs``), over the step's capture-ready form (model/layout.py ``StaticStep``).

On a GPU the decoder is launch-bound: ~90 kernels per layer and position, each a few
microseconds of launch for less work (docs/cost_model.md: ~33 ms of launches against ~14 ms of
GPU work per position at L = 48). The capture-ready form of the step (model/decoder.py,
``static=True``) has no shape or Python value that depends on t, so one position's forward and
one position's backward are captured once as graphs and replayed T times per sequence, with t
advanced on the device (``t.fill_``: a kernel argument, no host synchronisation).

:class:`CapturedRun` owns everything the graphs touch, at fixed addresses, across steps: the
static DecoderRun's slab, the prepared weights (copied in place from the current parameters at
every forward), the embeddings, the outputs z (with z_{-1} in row 0), the output gradients and
the recurrence's carried gradient. A graph's inputs are read from those buffers by index inside
the graph. The deferred weight-gradient flushes (a few large GEMMs every W positions) run eagerly
between replays. Captured runs are cached per model by their shapes; one in use (a forward whose
backward has not run yet) is never handed out twice.

Every layout (the planner ranks tensor- and pipeline-parallel ones first). Under tensor
parallelism the stack's all-reduces run inside the captured bodies (NCCL collectives capture;
tools/gpu/cuda_graphs.py --world-of-one checks a captured step with them against the eager one
on a one-rank NCCL group). Under pipeline parallelism a stage does not run the dense loop: its
positions arrive over the wire, so each micro-batch is a :class:`CapturedStageRun` (one
position's forward, recomputation and backward captured; the sends and receives between the
replays, outside the graphs). Packed documents (per-row restarts) and a GRPO batch's row plan
run the eager step (the same function).

Without CUDA the same object runs with the captured bodies called directly (``capture=False``),
which the unit tests use to check the orchestration against the module path on a CPU; the
capture itself is checked by tools/gpu/cuda_graphs.py on a GPU.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from rlt_mega.model.decoder import DecoderRun
from rlt_mega.model.stack import DecoderStack, StackSpec, WeightGrads
from rlt_mega.model.dense_decode import Decoder


class _Body:
    """A position's computation: replayed from a CUDA graph, or called directly."""

    def __init__(self, fn: Callable[[], None], capture: bool, pool=None) -> None:
        self.fn, self.graph = fn, None
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the graph (allocator, cuBLAS workspaces)
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                fn()

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class CapturedRun:
    """A static DecoderRun whose per-position steps are captured (see the module docstring).

    stack: built from private copies of the weights (:meth:`load_weights` refreshes them);
    memory_like: per layer, memory K/V of the shapes to come; checkpoint: k, recompute segments of
    k positions before their backward from the inputs (z and the embeddings: this object's
    buffers), None: keep everything."""

    def __init__(self, stack: DecoderStack, spec: StackSpec, weights, batch: int, capacity: int,
                 memory_like, checkpoint, capture: bool) -> None:
        self.stack, self.spec, self.B, self.T, self.checkpoint = stack, spec, batch, capacity, checkpoint
        checkpointed = checkpoint is not None
        self.run = DecoderRun(stack, batch, capacity, memory_like, grads=WeightGrads(spec, weights),
                              checkpoint=checkpoint, static=True, keep_inputs=False)
        self.busy = False
        device, d = stack.device, stack.d
        self.e = torch.zeros(capacity, batch, d, dtype=stack.stream_dtype, device=device)
        self.zs = torch.zeros(capacity + 1, batch, d, dtype=stack.stream_dtype, device=device)  # row 0: z_{-1}
        self.gz = torch.zeros(capacity, batch, d, dtype=stack.stream_dtype, device=device)
        self.carry = torch.zeros(batch, d, dtype=stack.stream_dtype, device=device)
        pool = torch.cuda.graph_pool_handle() if capture else None
        self.forward_body = _Body(lambda: self._forward("checkpoint" if checkpointed else "save"), capture, pool)
        self.recompute_body = _Body(self._recompute, capture, pool) if checkpointed else None
        self.backward_body = _Body(self._backward, capture, pool)
        self.run.reset_grads()  # the warm-up ran the bodies once

    # ------------------------------------------------------------------ captured bodies
    def _forward(self, mode: str) -> None:
        pos = self.run.position
        pos.update()
        x = self.zs.index_select(0, pos.t1).squeeze(0)  # z_{t-1}
        e = self.e.index_select(0, pos.t1).squeeze(0)
        y = self.run.step_forward(pos, x, e, mode)
        self.zs.index_copy_(0, pos.t1 + 1, y.unsqueeze(0))

    def _recompute(self) -> None:
        pos = self.run.position
        pos.update()
        x = self.zs.index_select(0, pos.t1).squeeze(0)
        e = self.e.index_select(0, pos.t1).squeeze(0)
        self.run.step_forward(pos, x, e, "recompute")

    def _backward(self) -> None:
        pos = self.run.position
        pos.update()
        gy = self.gz.index_select(0, pos.t1).squeeze(0) + self.carry
        self.carry.copy_(self.run.step_backward(pos, gy))

    # ------------------------------------------------------------------ a sequence
    def load(self, weights, emb: torch.Tensor, z0: torch.Tensor, memory) -> None:
        """The current fused weights, embeddings (B, T, d), z_{-1} (B, d) and memory K/V into the
        captured buffers."""
        named = dict(zip(self.spec.keys, weights))
        for i, gemms in self.stack.layers.items():
            for name in ("qkv", "o", "cross_q", "cross_o", "gate_up", "down"):
                getattr(gemms, name).load(named[(i, name)].detach())
            if gemms.qkv.bias is not None:
                gemms.qkv.bias.copy_(named[(i, "qkv_bias")].detach())
        if self.stack.recur is not None:
            self.stack.recur.load(named[(-1, "recur")].detach())
        self.e.copy_(emb.detach().transpose(0, 1))
        self.zs[0].copy_(z0.detach())
        self.run.load_memory(memory)

    def forward(self) -> torch.Tensor:
        """Every position -> z (T, B, d), a new tensor."""
        for t in range(self.T):
            self.run.position.t.fill_(t)
            self.forward_body()
        return self.zs[1:].clone()

    def backward(self, grad_z: torch.Tensor, weights) -> tuple:
        """grad_z (B, T, d) -> (grad of the embeddings, of z_{-1}, memory K/V grads, weight grads)."""
        run = self.run
        run.grads = WeightGrads(self.spec, weights)
        run.reset_grads()
        self.gz.copy_(grad_z.transpose(0, 1))
        self.carry.zero_()
        k = self.checkpoint
        for t in reversed(range(self.T)):
            if k is not None and (t + 1 == self.T or (t + 1) % k == 0):  # t's segment again, in order
                for u in range(t - t % k, t + 1):
                    run.position.t.fill_(u)
                    self.recompute_body()
            run.position.t.fill_(t)
            self.backward_body()
            if t % run.chunk == 0:
                run.flush(t, min(t + run.chunk, self.T))
        memory = [g for pair in run.memory_grads() for g in pair]
        return run.input_grads(), self.carry.clone(), memory, run.grads.grads()


class CapturedStageRun:
    """A pipeline stage's micro-batch (parallel/stage.py) on the capture-ready step: the same
    interface as a :class:`DecoderRun` (``forward(t, x, e, mode)``, ``backward(t, gy)``,
    ``memory_grads``, ``input_grads``), with one position's forward, its recomputation and its
    backward captured as graphs (called directly without CUDA) and replayed for every t. The
    sends and receives stay outside: the stage copies what arrived into this object's input
    buffers and sends a copy of its outputs. Under tensor parallelism the stack's all-reduces are
    inside the captured bodies (NCCL collectives capture). The weight-gradient flushes run eagerly
    between replays, into the round's accumulators ``grads``. Captured once per micro-batch and
    round: the round's stack (its weights' addresses) is fixed, and the capture's cost (three
    positions) is small against the T positions it replays."""

    def __init__(self, stack: DecoderStack, batch: int, capacity: int, memory, grads: WeightGrads,
                 checkpoint, capture: bool) -> None:
        self.T, self.checkpoint = capacity, checkpoint
        self.run = DecoderRun(stack, batch, capacity, memory, grads=grads, checkpoint=checkpoint, static=True,
                              keep_inputs=False)
        device, d, dtype = stack.device, stack.d, stack.stream_dtype
        self.xs = torch.zeros(capacity, batch, d, dtype=dtype, device=device)  # the stage's inputs (kept)
        self.e = torch.zeros(capacity, batch, d, dtype=dtype, device=device) if stack.spec.with_input else None
        self.y = torch.zeros(batch, d, dtype=dtype, device=device)
        self.gy = torch.zeros(batch, d, dtype=dtype, device=device)
        self.gx = torch.zeros(batch, d, dtype=dtype, device=device)
        self.z0_grad = None  # (no packed documents on this form)
        self.mode = "save" if checkpoint is None else "checkpoint"
        pool = torch.cuda.graph_pool_handle() if capture else None
        self.forward_body = _Body(lambda: self._forward(self.mode), capture, pool)
        self.recompute_body = _Body(lambda: self._forward("recompute"), capture, pool) if checkpoint else None
        self.backward_body = _Body(self._backward, capture, pool)
        self.run.reset_grads()  # the warm-up ran the bodies once

    def _forward(self, mode: str) -> None:
        pos = self.run.position
        pos.update()
        x = self.xs.index_select(0, pos.t1).squeeze(0)
        e = None if self.e is None else self.e.index_select(0, pos.t1).squeeze(0)
        self.y.copy_(self.run.step_forward(pos, x, e, mode))

    def _backward(self) -> None:
        pos = self.run.position
        pos.update()
        self.gx.copy_(self.run.step_backward(pos, self.gy))

    def forward(self, t: int, x: torch.Tensor, e, mode: str) -> torch.Tensor:
        if mode != self.mode:
            raise ValueError(f"a captured stage run of mode {self.mode!r} asked for {mode!r}")
        self.xs[t].copy_(x)
        if self.e is not None:
            self.e[t].copy_(e)
        self.run.position.t.fill_(t)
        self.forward_body()
        return self.y.clone()

    def backward(self, t: int, gy: torch.Tensor) -> torch.Tensor:
        k = self.checkpoint
        if k is not None and (t + 1 == self.T or (t + 1) % k == 0):  # t's segment again, in order
            for u in range(t - t % k, t + 1):
                self.run.position.t.fill_(u)
                self.recompute_body()
        self.run.position.t.fill_(t)
        self.gy.copy_(gy)
        self.backward_body()
        if t % self.run.chunk == 0:
            self.run.flush(t, min(t + self.run.chunk, self.T))
        return self.gx.clone()

    def memory_grads(self):
        return self.run.memory_grads()

    def input_grads(self) -> torch.Tensor:
        return self.run.input_grads()


class GraphedDecode(torch.autograd.Function):
    """The dense schedule's autograd Function (model/dense_decode.py ``DenseDecode``) on a CapturedRun."""

    @staticmethod
    def forward(ctx, captured: CapturedRun, num_memory: int, emb: torch.Tensor, z0: torch.Tensor,
                *tensors: torch.Tensor) -> torch.Tensor:
        mem_flat, weights = tensors[:num_memory], tensors[num_memory:]
        captured.busy = True
        captured.load(weights, emb, z0, list(zip(mem_flat[0::2], mem_flat[1::2])))
        zs = captured.forward()
        ctx.captured, ctx.weights = captured, [w.detach() for w in weights]
        # free again when this graph is (after its backward, or never backwarded; a retained
        # graph keeps it for its next backward)
        weakref.finalize(ctx, setattr, captured, "busy", False)
        return zs.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad_z: torch.Tensor):
        grad_emb, grad_z0, memory, weights = ctx.captured.backward(grad_z, ctx.weights)
        return (None, None, grad_emb, grad_z0, *memory, *weights)


class GraphCache:
    """Captured runs of one model, by shape; a run stays busy from its forward to its backward."""

    def __init__(self) -> None:
        self.runs: dict[tuple, list[CapturedRun]] = {}

    def get(self, key: tuple, build: Callable[[], CapturedRun]) -> CapturedRun:
        for run in self.runs.get(key, []):
            if not run.busy:
                return run
        run = build()
        self.runs.setdefault(key, []).append(run)
        return run


class GraphedDecoder(Decoder):
    """The model's decoder with the dense schedule's positions captured as CUDA graphs: the
    capture-ready form of the same step (every row at every position: a GRPO batch's row plan is
    not followed, the padded schedule computes the same function), its captured runs cached by
    shape. The rollout and the pipeline's positions run the eager step as before."""

    def __init__(self, all_reduce=None, capture: bool = True) -> None:
        super().__init__(all_reduce=all_reduce, static=True)
        self.graphs = GraphCache()
        self.capture = capture  # False: the bodies are called directly (the CPU's tests)
        self.eager = Decoder(all_reduce=all_reduce)  # packed documents: the eager step (the same function)

    def dense(self, model, emb, mem, z0=None, rows=None, documents=None):
        if documents is not None:  # each row's documents restart z: the eager form's per-row resets
            return self.eager.dense(model, emb, mem, z0, rows, documents)
        return super().dense(model, emb, mem, z0, rows, documents)

    def stage_run(self, stack: DecoderStack, batch: int, capacity: int, memory, grads: WeightGrads, checkpoint
                  ) -> CapturedStageRun:
        """A pipeline stage's micro-batch with its positions captured (parallel/stage.py)."""
        return CapturedStageRun(stack, batch, capacity, memory, grads, checkpoint,
                                capture=self.capture and stack.device.type == "cuda")

    def _dense_grad(self, model, emb, z0, memory, flat_memory, spec, weights, checkpoint, compute, plan_rows,
                    documents):
        B, T, _ = emb.shape
        key = (B, T, emb.dtype, compute, checkpoint, tuple(spec.keys), tuple(tuple(w.shape) for w in weights),
               tuple(tuple(k.shape) for k, _ in memory))

        def build() -> CapturedRun:
            private = [w.detach().clone() for w in weights]  # the graphs read these; refreshed per forward
            stack = self.stack(model, spec, private, B, True, emb.dtype, compute)
            return CapturedRun(stack, spec, private, B, T, memory, checkpoint, capture=self.capture and emb.is_cuda)

        captured = self.graphs.get(key, build)
        return GraphedDecode.apply(captured, len(flat_memory), emb, z0, *flat_memory, *weights)


def install_cuda_graphs(model) -> None:
    """train.cuda_graphs: the model's dense schedule on captured CUDA graphs of its decoder step
    (the model must be on a CUDA device; its tensor-parallel reduce, if any, is kept)."""
    device = model.null_memory.device
    if device.type != "cuda":
        raise ValueError(f"train.cuda_graphs=true needs the model on a CUDA device, not {device}: set "
                         "train.cuda_graphs=false (CUDA graphs are a GPU feature; on a CPU the decoder runs eagerly)")
    model.decoder = GraphedDecoder(all_reduce=model.decoder.all_reduce)
