"""The dense schedule's decoder on the fused step: one autograd Function over the whole
sequence (model/decoder.py does the work).

Why one Function per sequence (not per step or per layer). The decoder's autograd graph would
otherwise hold T x L nodes whose backward order autograd must rediscover; the sequence's
backward is a fixed loop (decreasing t, the recurrence's gradient carried from step to step),
and the deferred weight gradients need one owner that sees every position. The Function's
inputs are the embeddings (B, T, d), z_{-1} (B, d), every layer's memory K/V (B, h_kv, 1 + S,
Dh) and the fused weights (model/kernels.py: differentiable expressions of the parameters, so
autograd carries their gradients on to q/k/v, the norm weights and recur_proj); its output is
z (B, T, d). Backward returns the gradient of each: the three BPTT paths (recurrence, decoder
K/V, encoder memory) are all inside it, none detached.

Checkpointing (train.checkpointing.decoder: "none", "every_k" with ``decoder_k``, "step" = k 1,
``segment_length``) is the run's: what is kept, what is recomputed and why every mode gives
bit-identical gradients is model/decoder.py's docstring.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from rlt_mega.model.decoder import DecoderRun, StepRunner
from rlt_mega.model.documents import Documents
from rlt_mega.model.stack import DecoderStack, StackSpec, WeightGrads, fused_weights
from rlt_mega.model.kernels import wide

if TYPE_CHECKING:  # the schedule's rows are passed in (a layout the model reads); model/ never imports them
    from rlt_mega.schedule.dense import DensePlan, DenseRows


class ReduceGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over the shards backward (megatron-core's
    copy_to_tensor_model_parallel_region, with the all-reduce supplied by parallel/)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, all_reduce: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.all_reduce = all_reduce
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        ctx.all_reduce(grad)
        return grad, None


def replicator(all_reduce: Optional[Callable[[torch.Tensor], None]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a replicated parameter enters a product with a sharded one (see model/kernels.py)."""
    if all_reduce is None:
        return lambda x: x
    return lambda x: ReduceGrad.apply(x, all_reduce)


def compute_dtype_of(param_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the products run in: the autocast dtype under autocast, else the parameters'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return param_dtype


@dataclass
class _DenseCall:
    """What the Function needs besides its tensor inputs."""

    decoder: "Decoder"
    model: object
    spec: StackSpec
    num_memory: int  # 2 x layers: k, v per layer
    checkpoint: Optional[int]  # k: keep the inputs only, recompute segments of k positions (None: keep all)
    compute_dtype: torch.dtype
    static: bool
    rows: Optional[DensePlan] = None  # which rows each position runs on (None: all)
    documents: Optional[Documents] = None  # packed rows with document resets (model/documents.py)


class DenseDecode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _DenseCall, emb: torch.Tensor, z0: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        B, T, d = emb.shape
        mem_flat, weights = tensors[:plan.num_memory], tensors[plan.num_memory:]
        memory = list(zip(mem_flat[0::2], mem_flat[1::2]))
        stack = plan.decoder.stack(plan.model, plan.spec, weights, B, True, emb.dtype, plan.compute_dtype)
        checkpointed = plan.checkpoint is not None
        # the accumulators are made by the backward (allocate=False: not alive until then); a
        # checkpointed run recomputes from the embeddings (emb: saved below anyway)
        run = DecoderRun(stack, B, T, memory, grads=WeightGrads(plan.spec, weights, allocate=False),
                         checkpoint=plan.checkpoint, static=plan.static, rows=plan.rows, documents=plan.documents,
                         z0=z0, embeddings=emb.detach().transpose(0, 1) if checkpointed else None)
        e = emb.detach().transpose(0, 1).contiguous()  # (T, B, d): one contiguous row block per position
        zs = _run_forward(run, e, z0.detach(), mode="checkpoint" if checkpointed else "save")
        ctx.plan, ctx.run, ctx.T = plan, run, T
        ctx.weights = [w.detach() for w in weights]
        # emb is saved only as a witness: autograd frees saved tensors after a backward that does
        # not retain the graph, which tells ``Decoder.release_spent`` that the run will not be read again
        ctx.save_for_backward(emb)
        plan.decoder.graphs_alive.append(weakref.ref(ctx))
        return zs.transpose(0, 1)  # (B, T, d)

    @staticmethod
    def backward(ctx, grad_z: torch.Tensor):
        ctx.saved_tensors  # noqa: B018  (raises on a second backward through a graph that was not retained)
        plan, run = ctx.plan, ctx.run
        run.grads = WeightGrads(plan.spec, ctx.weights)  # fresh accumulators: a second backward starts from zero
        run.reset_grads()
        gz = grad_z.transpose(0, 1)  # (T, B, d) view
        carry = None  # the gradient of z_{t} through the recurrence, from position t + 1
        for t in reversed(range(ctx.T)):  # (checkpointed: the run recomputes each segment before its backward)
            gy = gz[t] if carry is None else gz[t] + carry
            carry = run.backward(t, gy)
        mem_grads = [g for pair in run.memory_grads() for g in pair]
        input_grads = run.input_grads()
        if run.z0_grad is not None:  # the rows restarted from z_init at a packed document's start
            carry = carry + run.z0_grad
        run.release_scratch()  # the rings and K/V gradients: not through the encoder's backward
        weight_grads = run.grads.grads()
        # The run lives as long as the graph (until the loss is dropped: after the encoder's
        # backward and the optimizer step); the accumulators (a copy of the decoder's weights)
        # need not: from here on only autograd holds them, and frees each once it is consumed.
        run.grads = WeightGrads(plan.spec, ctx.weights, allocate=False)
        return (None, input_grads, carry, *mem_grads, *weight_grads)


def _run_forward(run: DecoderRun, e: torch.Tensor, z: torch.Tensor, mode: str) -> torch.Tensor:
    """Every position in order: e (T, B, d), z = z_{-1} (B, d) -> z_t for every t, (T, B, d)."""
    T = e.shape[0]
    zs = torch.empty_like(e) if z.dtype == e.dtype else torch.empty(e.shape, dtype=z.dtype, device=e.device)
    for t in range(T):
        z = run.forward(t, z, e[t], mode=mode)
        zs[t].copy_(z)
    return zs


class Decoder:
    """The RLT's decoder step as every schedule runs it: the dense schedule (``dense``: pretraining,
    SFT, evaluation, the learner), a pipeline stage's positions (parallel/stage.py) and the
    rollout and replay (rollout/executor.py) all build their products with ``stack`` and run
    model/decoder.py's step on them.

    all_reduce: the in-place sum over the shards where megatron's layers would
    communicate (after each row-parallel product, on the input gradient of each column-parallel
    one), given by whoever shards the model (None: one device). static: the
    capture-ready form of the dense schedule (t a device tensor, every shape the capacity's:
    what a graph capture records; a wrapper outside model/ captures it)."""

    def __init__(self, all_reduce: Optional[Callable[[torch.Tensor], None]] = None, static: bool = False) -> None:
        self.all_reduce, self.static = all_reduce, static
        self.graphs_alive: list = []  # weak references to the dense schedule's graphs (their autograd contexts)

    def release_spent(self) -> None:
        """Frees the runs (their buffers go back to the workspace pool) of graphs already backwarded
        without retain_graph. Their graph may outlive its backward (DeepSpeed 0.19's gradient hooks
        hold the last step's graph until the next backward), and a run held there would double the
        decoder's memory in the next step; called before each forward."""
        alive = []
        for ref in self.graphs_alive:
            ctx = ref()
            if ctx is None or ctx.run is None:
                continue
            try:
                ctx.saved_tensors  # noqa: B018
            except RuntimeError:  # backwarded, not retained: nothing will read the run again
                ctx.run = ctx.weights = None
                continue
            alive.append(ref)
        self.graphs_alive = alive

    def weights(self, model, layers, with_input: bool) -> tuple[StackSpec, list[torch.Tensor]]:
        """The fused weights of ``layers`` (and the recurrence input), differentiable expressions of
        the parameters (model/kernels.py)."""
        return fused_weights(model, layers, with_input, replicator(self.all_reduce))

    def stack(self, model, spec: StackSpec, tensors, rows: int, backward: bool, stream_dtype: torch.dtype,
              compute_dtype: torch.dtype, memory: bool = False) -> DecoderStack:
        """The prepared products of ``spec`` for batches of ``rows`` rows; memory: also the
        cross-attention's k/v products (the rollout's memory writes)."""
        cfg = model.cfg
        cross_kv = None
        if memory:
            cross_kv = {i: torch.cat([wide(model.cross[i].attn.k.weight), wide(model.cross[i].attn.v.weight)])
                        for i in spec.layers}  # (2 h_kv Dh, d): this rank's heads
        return DecoderStack(spec, tensors, stream_dtype=stream_dtype, compute_dtype=compute_dtype, rows=rows,
                          backward=backward, d_model=cfg.d_model, eps=cfg.norm_eps, memory_block=cfg.memory_block,
                          rotary=model.rotary, all_reduce=self.all_reduce, cross_kv=cross_kv)

    def runners(self, model, layers, with_input: bool, shapes: Sequence[tuple[int, int]], stream_dtype: torch.dtype,
                compute_dtype: torch.dtype) -> list[StepRunner]:
        """The rollout's and the replay's decoders, one per micro-batch of ``shapes`` (rows: the
        call's slots, capacity: positions), sharing products prepared once from the parameters as
        they are now (new ones for every call: nothing computed under other parameters is reused)."""
        with torch.no_grad():
            spec, weights = self.weights(model, layers, with_input)
            stack = self.stack(model, spec, weights, max(b for b, _ in shapes), False, stream_dtype, compute_dtype,
                               memory=True)
        return [StepRunner(stack, batch, capacity, model.null_memory) for batch, capacity in shapes]

    def reload(self, model, layers, with_input: bool, runners: Sequence[StepRunner]) -> None:
        """A weight switch inside a call (partial rollouts, rollout/executor.py): the runners'
        products prepared anew from the parameters as they are now, and the null memory's slot
        rewritten from them; the K/V states computed so far stay."""
        old = runners[0].stack
        with torch.no_grad():
            spec, weights = self.weights(model, layers, with_input)
            stack = self.stack(model, spec, weights, old.rows, False, old.stream_dtype, old.compute_dtype, memory=True)
        for runner in runners:
            runner.restack(stack, model.null_memory)

    def dense(self, model, emb: torch.Tensor, mem, z0: Optional[torch.Tensor] = None,
              rows: Optional[DenseRows] = None, documents: Optional[Documents] = None) -> torch.Tensor:
        """The dense schedule's decoder: emb (B, T, d), mem the memory K/V of ``RLT.memory_kv`` -> z
        (B, T, d), with full BPTT when anything requires grad.

        rows (schedule/dense.py): each position runs only on the rows still inside their
        sequence (z is 0 past row b's ``rows.lengths[b]`` positions) and a shared prefix's
        positions once per group; the same function where it is defined, and the same gradient.
        documents (model/documents.py): packed rows, each document computed as if alone in its
        row. The capture-ready form runs every row (rows ignored: the padded schedule, the same
        function at every position read)."""
        B, T, _ = emb.shape
        cfg = model.cfg
        if T > cfg.max_seq_len:
            raise ValueError(f"position {T - 1} is past model.max_seq_len={cfg.max_seq_len}: raise model.max_seq_len")
        self.release_spent()
        if documents is not None and documents.shape != (B, T):
            raise ValueError(f"packed documents of shape {documents.shape} for a batch of {(B, T)}")
        if documents is not None and self.static:
            raise ValueError("packed documents run the eager decoder step: the capture-ready form has one position "
                             "for every row")
        z0 = model.initial_state(B) if z0 is None else z0
        layers = range(cfg.n_layers)
        compute = compute_dtype_of(emb.dtype, emb.device)
        plan_rows = row_plan(rows, B, T, emb.device, self.static)
        memory = [(mem.k[i], mem.v[i]) for i in layers]
        spec, weights = self.weights(model, layers, True)
        needs_grad = torch.is_grad_enabled() and (emb.requires_grad or z0.requires_grad or
                                                  any(t.requires_grad for pair in memory for t in pair) or
                                                  any(w.requires_grad for w in weights))
        if not needs_grad:
            with torch.no_grad():
                stack = self.stack(model, spec, weights, B, False, emb.dtype, compute)
                run = DecoderRun(stack, B, T, memory, static=self.static, rows=plan_rows, documents=documents, z0=z0)
                return _run_forward(run, emb.transpose(0, 1).contiguous(), z0, mode="none").transpose(0, 1)
        flat_memory = [t for pair in memory for t in pair]
        return self._dense_grad(model, emb, z0, memory, flat_memory, spec, weights, segment_length(model.checkpointing),
                                compute, plan_rows, documents)

    def _dense_grad(self, model, emb, z0, memory, flat_memory, spec, weights, checkpoint: Optional[int],
                    compute: torch.dtype, plan_rows, documents):
        """The autograd Function over the sequence (a wrapper outside model/ may replace it)."""
        plan = _DenseCall(self, model, spec, 2 * len(memory), checkpoint, compute, self.static, plan_rows, documents)
        return DenseDecode.apply(plan, emb, z0, *flat_memory, *weights)


def segment_length(checkpointing) -> Optional[int]:
    """train.checkpointing -> the decoder run's segment length k (None: no recomputation):
    "step" is k = 1, "every_k" k = decoder_k."""
    if checkpointing.decoder == "none":
        return None
    return 1 if checkpointing.decoder == "step" else checkpointing.decoder_k


def row_plan(rows: Optional[DenseRows], B: int, T: int, device: torch.device, static: bool) -> Optional[DensePlan]:
    """The DensePlan of ``rows`` for a run of B x T (None: every row at every position, also for
    the capture-ready form, whose shapes are fixed)."""
    return None if rows is None or static else rows.plan(B, T, device)
