"""The dense schedule's decoder on the fused step: one autograd Function over the whole
sequence (model/fused_run.py does the work).

Why one Function per sequence (not per step or per layer). The decoder's autograd graph would
otherwise hold T x L nodes whose backward order autograd must rediscover; the sequence's
backward is a fixed loop (decreasing t, the recurrence's gradient carried from step to step),
and the deferred weight gradients need one owner that sees every position. The Function's
inputs are the embeddings (B, T, d), z_{-1} (B, d), every layer's memory K/V (B, h_kv, 1 + S,
Dh) and the fused weights (model/fused.py: differentiable expressions of the parameters, so
autograd carries their gradients on to q/k/v, the norm weights and recur_proj); its output is
z (B, T, d). Backward returns the gradient of each: the three BPTT paths (recurrence, decoder
K/V, encoder memory) are all inside it, none detached.

Checkpointing (train.checkpointing.decoder): "none" saves everything the backward reads;
"step" and "every_k" (one mode here) keep the per-position tensors only and recompute the rest
of each position just before its backward (what is kept and why: fused_run's docstring). The
recomputation repeats the same operations on the same values, and the deferred-gradient flushes
do not depend on the mode (fused_run.wgrad_positions, KV_CHUNK), so every mode gives
bit-identical gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlt_mega.model.cuda_graphs import CapturedRun, GraphCache, GraphedDecode
from rlt_mega.model.fused_rows import DenseRows, RowPlan
from rlt_mega.model.fused_run import FusedRun, FusedStack, StackSpec, WeightGrads, checkpoint_slots, fused_weights


class ReduceGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over the tensor-parallel ranks backward (megatron's
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
    """How a replicated parameter enters a product with a sharded one (see model/fused.py)."""
    if all_reduce is None:
        return lambda x: x
    return lambda x: ReduceGrad.apply(x, all_reduce)


def compute_dtype_of(param_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the products run in: the autocast dtype under autocast, else the parameters'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return param_dtype


def build_stack(model, spec: StackSpec, tensors, rows: int, backward: bool, stream_dtype: torch.dtype,
                compute_dtype: torch.dtype) -> FusedStack:
    cfg = model.cfg
    return FusedStack(spec, tensors, stream_dtype=stream_dtype, compute_dtype=compute_dtype, rows=rows,
                      backward=backward, d_model=cfg.d_model, eps=cfg.norm_eps, memory_block=cfg.memory_block,
                      rotary=model.rotary, all_reduce=getattr(model, "tp_all_reduce", None))


@dataclass
class _Plan:
    """What the Function needs besides its tensor inputs."""

    model: object
    spec: StackSpec
    num_memory: int  # 2 x layers: k, v per layer
    checkpointed: bool  # keep the per-position tensors only, recompute the rest before each backward
    compute_dtype: torch.dtype
    static: bool
    rows: Optional[RowPlan] = None  # which rows each position runs on (None: all)


class FusedDecode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, emb: torch.Tensor, z0: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        B, T, d = emb.shape
        mem_flat, weights = tensors[:plan.num_memory], tensors[plan.num_memory:]
        memory = list(zip(mem_flat[0::2], mem_flat[1::2]))
        stack = build_stack(plan.model, plan.spec, weights, B, True, emb.dtype, plan.compute_dtype)
        slots = checkpoint_slots(B, T) if plan.checkpointed else None
        # the accumulators are made by the backward (allocate=False: not alive until then)
        run = FusedRun(stack, B, T, memory, grads=WeightGrads(plan.spec, weights, allocate=False), slots=slots,
                       static=plan.static, rows=plan.rows)
        e = emb.detach().transpose(0, 1).contiguous()  # (T, B, d): one contiguous row block per position
        zs = _run_forward(run, e, z0.detach(), mode="checkpoint" if plan.checkpointed else "save")
        ctx.plan, ctx.run, ctx.T = plan, run, T
        ctx.weights = [w.detach() for w in weights]
        return zs.transpose(0, 1)  # (B, T, d)

    @staticmethod
    def backward(ctx, grad_z: torch.Tensor):
        plan, run = ctx.plan, ctx.run
        run.grads = WeightGrads(plan.spec, ctx.weights)  # fresh accumulators: a second backward starts from zero
        run.reset_grads()
        gz = grad_z.transpose(0, 1)  # (T, B, d) view
        carry = None  # the gradient of z_{t} through the recurrence, from position t + 1
        for t in reversed(range(ctx.T)):
            if plan.checkpointed:
                run.forward(t, None, None, mode="recompute")
            gy = gz[t] if carry is None else gz[t] + carry
            carry = run.backward(t, gy)
        mem_grads = [g for pair in run.memory_grads() for g in pair]
        input_grads = run.input_grads()
        run.release_scratch()  # the rings and K/V gradients: not through the encoder's backward
        weight_grads = run.grads.grads()
        # The run lives as long as the graph (until the loss is dropped: after the encoder's
        # backward and the optimizer step); the accumulators (a copy of the decoder's weights)
        # need not: from here on only autograd holds them, and frees each once it is consumed.
        run.grads = WeightGrads(plan.spec, ctx.weights, allocate=False)
        return (None, input_grads, carry, *mem_grads, *weight_grads)


def _run_forward(run: FusedRun, e: torch.Tensor, z: torch.Tensor, mode: str) -> torch.Tensor:
    """Every position in order: e (T, B, d), z = z_{-1} (B, d) -> z_t for every t, (T, B, d)."""
    T = e.shape[0]
    zs = torch.empty_like(e) if z.dtype == e.dtype else torch.empty(e.shape, dtype=z.dtype, device=e.device)
    for t in range(T):
        z = run.forward(t, z, e[t], mode=mode)
        zs[t].copy_(z)
    return zs


def decode_dense_fused(model, emb: torch.Tensor, mem, z0: Optional[torch.Tensor] = None,
                       rows: Optional[DenseRows] = None) -> torch.Tensor:
    """``RLT.decode_dense`` on the fused step: emb (B, T, d), mem a MemoryKV whose K/V come
    from ``RLT.memory_kv`` -> z (B, T, d), with full BPTT when anything requires grad.

    rows (the GRPO learner, model/fused_rows.py): each position runs only on the rows still
    inside their sequence (z is 0 past row b's ``rows.lengths[b]`` positions) and a shared
    prompt's positions once per group; the same function where it is defined, and the same
    gradient. The capture-ready form (CUDA graphs, static shapes) runs every row."""
    B, T, _ = emb.shape
    cfg = model.cfg
    if T > cfg.max_seq_len:
        raise ValueError(f"position {T - 1} is past model.max_seq_len={cfg.max_seq_len}: raise model.max_seq_len")
    z0 = model.initial_state(B) if z0 is None else z0
    layers = range(cfg.n_layers)
    all_reduce = getattr(model, "tp_all_reduce", None)
    compute = compute_dtype_of(emb.dtype, emb.device)
    static = bool(getattr(model, "static_decoder", False))
    plan_rows = row_plan(rows, B, T, emb.device, static)
    memory = [(mem.k[i], mem.v[i]) for i in layers]
    spec, weights = fused_weights(model, layers, True, replicator(all_reduce))
    needs_grad = torch.is_grad_enabled() and (emb.requires_grad or z0.requires_grad or
                                              any(t.requires_grad for pair in memory for t in pair) or
                                              any(w.requires_grad for w in weights))
    if not needs_grad:
        with torch.no_grad():
            stack = build_stack(model, spec, weights, B, False, emb.dtype, compute)
            run = FusedRun(stack, B, T, memory, grads=None, slots=1, static=static, rows=plan_rows)
            return _run_forward(run, emb.transpose(0, 1).contiguous(), z0, mode="none").transpose(0, 1)
    checkpointed = model.checkpointing.decoder != "none"
    flat_memory = [t for pair in memory for t in pair]
    if getattr(model, "cuda_graphs", False):
        captured = _captured_run(model, spec, weights, emb, memory, checkpointed, compute)
        return GraphedDecode.apply(captured, len(flat_memory), emb, z0, *flat_memory, *weights)
    plan = _Plan(model, spec, 2 * len(memory), checkpointed, compute, static, plan_rows)
    return FusedDecode.apply(plan, emb, z0, *flat_memory, *weights)


def row_plan(rows: Optional[DenseRows], B: int, T: int, device: torch.device, static: bool) -> Optional[RowPlan]:
    """The RowPlan of ``rows`` for a run of B x T (None: every row at every position, also for
    the capture-ready form, whose shapes are fixed)."""
    if rows is None or static:
        return None
    if rows.batch_size != B:
        raise ValueError(f"dense rows describe {rows.batch_size} rows, the batch has {B}: build them from the "
                         "batch's own rollouts (learner/objective.py, grpo_batch)")
    return RowPlan(rows, T, device)


def _captured_run(model, spec: StackSpec, weights, emb: torch.Tensor, memory, checkpointed: bool,
                  compute: torch.dtype):
    """The model's captured run for these shapes (model/cuda_graphs.py), built on first use."""
    B, T, _ = emb.shape
    key = (B, T, emb.dtype, compute, checkpointed, tuple(spec.keys), tuple(tuple(w.shape) for w in weights),
           tuple(tuple(k.shape) for k, _ in memory))
    if getattr(model, "_graph_cache", None) is None:
        model._graph_cache = GraphCache()

    def build() -> CapturedRun:
        private = [w.detach().clone() for w in weights]  # the graphs read these; refreshed per forward
        stack = build_stack(model, spec, private, B, True, emb.dtype, compute)
        return CapturedRun(stack, spec, private, B, T, memory, checkpointed, capture=emb.is_cuda)

    return model._graph_cache.get(key, build)
