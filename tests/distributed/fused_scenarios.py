"""Distributed scenarios of the decoder step (model/decoder.py), run on every rank by
tests/distributed/worker.py: the engine against a single-process run of the executable reference
(rlt_mega/reference.py: the modules and plain autograd), and proof that the decoder step ran (and
the reference did not) on every rank, under TP (megatron-core shards), PP (each stage on its own
layers) and ZeRO-3 (partitioned parameters)."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager

import torch


import rlt_mega.loss as loss_module
import rlt_mega.reference as reference
from rlt_mega.model import decoder as fused_run
from rlt_mega.parallel.gather import gather_full
from tests.distributed.scenarios import Reference, _close, _engine, global_batch, local_batches, make_cfg, max_diff


@contextmanager
def count_calls():
    """Counts the decoder step's positions, the reference's decoder layers and the chunks of a
    chunked head (train.checkpointing.head_chunk: loss.Logits checkpoints each) run inside."""
    counts = {"fused_positions": 0, "module_layers": 0, "head_chunks": 0}
    fused, module, chunk = fused_run.DecoderRun.step_forward, reference._layer, loss_module.checkpoint

    def chunk_spy(*args, **kwargs):
        counts["head_chunks"] += 1
        return chunk(*args, **kwargs)

    def fused_spy(self, *args, **kwargs):
        counts["fused_positions"] += 1
        return fused(self, *args, **kwargs)

    def module_spy(*args, **kwargs):
        counts["module_layers"] += 1
        return module(*args, **kwargs)

    fused_run.DecoderRun.step_forward, reference._layer, loss_module.checkpoint = fused_spy, module_spy, chunk_spy
    try:
        yield counts
    finally:
        fused_run.DecoderRun.step_forward, reference._layer, loss_module.checkpoint = fused, module, chunk


@contextmanager
def zero3_persistence(threshold):
    """DeepSpeed's stage3_param_persistence_threshold while building an engine (None: as is);
    0 partitions every parameter of the tiny model (else all stay whole and nothing is tested)."""
    from rlt_mega.parallel import zero

    original = zero.deepspeed_config

    def patched(*args, **kwargs):
        cfg = original(*args, **kwargs)
        if threshold is not None and "zero_optimization" in cfg:
            # nothing persists, nothing stays live between uses: every access must be gathered
            cfg["zero_optimization"].update(stage3_param_persistence_threshold=threshold,
                                            stage3_max_live_parameters=0, stage3_max_reuse_distance=0,
                                            stage3_prefetch_bucket_size=0)
        return cfg

    zero.deepspeed_config = patched
    try:
        yield
    finally:
        zero.deepspeed_config = original


def fused_vs_module(model=None, parallel=None, train=None, persistence_threshold=None) -> dict:
    """One backward of the engine (the decoder step) against the single-process reference on the
    combined batch: loss, every gathered gradient, and the call counts of both.
    ``persistence_threshold``: DeepSpeed's stage3_param_persistence_threshold (0 partitions every
    parameter of the tiny model under ZeRO-3)."""
    cfg = make_cfg(model or {}, parallel, train)
    with zero3_persistence(persistence_threshold):
        dims, engine = _engine(cfg)
    ref = Reference(cfg, plain=True)
    x, y = global_batch(cfg, 0, dims.dp)
    with count_calls() as ref_counts:
        ref_loss = ref.backward(x, y)
    with count_calls() as counts:
        loss, _, _ = engine.backward_step(local_batches(cfg, 0, dims))
    full = gather_full(engine.gradients(), dims)
    out = {"loss": loss, "ref_loss": ref_loss, **counts, "ref_module_layers": ref_counts["module_layers"],
           "ref_fused_positions": ref_counts["fused_positions"]}
    out["grad_diff"], out["grad_worst"] = max_diff(full, ref.grads())
    out["grad_scale"] = max(float(g.abs().max()) for g in ref.grads().values())
    _close(dims, engine)
    return out


def checkpointing_bit_identical(model=None, parallel=None, train=None) -> dict:
    """One backward of the engine with the decoder checkpointed "none", "step" and "every_k"
    (k = 3), and with the encoder checkpointed (under TP each rank keeping 1/tp of a block's
    input, parallel/tp.py CheckpointShards), the same batch: losses and every gathered gradient
    equal bit for bit. Flushes of 8 rows (W = 2 positions at B = 4) make the recomputation ring
    (4 slots at k = 3) shorter than the sequence. Also the bytes the checkpointed encoder keeps
    (MemTracker) against the planner's, and the head chunked by 5 positions (under TP the
    vocab-parallel cross-entropy of each chunk, under PP on the last stage): its loss and
    gradients against the whole head's, to rounding (loss.Logits says why not bit for bit)."""
    from rlt_mega.model import run_buffers

    results, chunks = {}, 0
    rows = run_buffers.WGRAD_ROWS
    run_buffers.WGRAD_ROWS = 8
    try:
        for run, decoder, k, encoder, head in (("none", "none", 4, False, 0), ("step", "step", 1, False, 0),
                                               ("every_k", "every_k", 3, False, 0), ("encoder", "none", 4, True, 0),
                                               ("head", "none", 4, False, 5)):
            cfg = make_cfg(model or {}, parallel, {**(train or {}), "checkpointing": {
                "decoder": decoder, "decoder_k": k, "encoder": encoder, "head_chunk": head}})
            dims, engine = _engine(cfg)
            with count_calls() as counts:
                loss, _, _ = engine.backward_step(local_batches(cfg, 0, dims))
            full = {n: g.detach().clone() for n, g in gather_full(engine.gradients(), dims).items()}
            results[run] = (float(loss), full, counts["fused_positions"])
            chunks += counts["head_chunks"]
            last = dims.is_last_stage  # (the head and the loss run on the last stage)
            if encoder:
                kept = encoder_kept_bytes(cfg, dims, engine.module)
            _close(dims, engine)
    finally:
        run_buffers.WGRAD_ROWS = rows
    base_loss, base, base_positions = results["none"]
    out = {"compared": len(base), "fused_positions": base_positions, "encoder_kept": kept,
           "scale": max(float(g.abs().max()) for g in base.values())}
    for run in ("step", "every_k", "encoder", "head"):
        loss, grads, positions = results[run]
        out[run] = {"loss_equal": loss == base_loss, "names_equal": sorted(grads) == sorted(base),
                    "unequal": [n for n in base if n not in grads or not grads[n].equal(base[n])],
                    "more_positions": positions > base_positions}  # the recomputation ran
    loss, grads, _ = results["head"]
    out["head"].update(loss_diff=abs(loss - base_loss), chunks=chunks, last_stage=last, grad_diff=max(
        float((grads[n] - base[n]).abs().max()) for n in base if n in grads))
    return out


def encoder_kept_bytes(cfg, dims, model) -> dict | None:
    """The bytes per row a checkpointed encoder forward leaves alive besides its output and its
    input (MemTracker, the difference between B and 2 B rows: what does not grow with the rows
    cancels) on a one-stage layout; the planner's (cost/memory.py), whose count includes the
    first block's input, the caller's; and the whole blocks' inputs."""
    from rlt_mega.cost.layout import Layout
    from rlt_mega.cost.measure import _PeakTracker
    from rlt_mega.cost.memory import activation_per_token

    if dims.pp > 1:
        return None

    class Encode(torch.nn.Module):  # MemTracker follows modules from one root call
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, h):
            return self.model.encode(h)

    def settled(tracker) -> int:
        """The tracked bytes alive once gloo's worker thread has let go of the tensors of the
        collectives it finished (the recompute's all-gather output: it drops its hold a moment
        after the caller returns, later under load): five equal readings 10 ms apart."""
        readings: list = []
        for _ in range(500):
            readings.append(tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"])
            if len(readings) >= 5 and len(set(readings[-5:])) == 1:
                break
            time.sleep(0.01)
        return readings[-1]

    def kept(rows: int) -> int:
        x, _ = global_batch(cfg, 0, 2)
        h = model.embed(x[:rows]).detach().requires_grad_(True)
        # The garbage of an earlier call (the checkpoints' reference cycles) is collected before,
        # not during, the tracked call: a collection inside it would subtract that call's bytes.
        gc.collect()
        gc.disable()
        try:
            tracker = _PeakTracker()
            tracker.track_external(model, h)
            with tracker:
                before = settled(tracker)
                out = Encode()(h)
                after = settled(tracker)
        finally:
            gc.enable()
        return after - before - out.numel() * out.element_size()

    B, T, d = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.d_model
    per_token = activation_per_token(cfg.model, Layout.from_config(cfg, dims.world_size), 0)["encoder"]
    first = T * d * 4  # a row of the first block's input (fp32), held by the caller
    kept(B)  # a warm-up: what the first encode creates and keeps (lazy tables) is not per row
    return {"measured": (kept(2 * B) - kept(B)) / B + first, "predicted": per_token * T,
            "whole": cfg.model.n_layers * first, "first": first}


def graphs_vs_module(model=None, parallel=None, train=None) -> dict:
    """train.cuda_graphs=true in a parallel layout on the CPU: the engine with its decoder on the
    capture-ready step (parallel/cuda_graphs.py; the bodies called directly: no CUDA here; under
    PP each stage's micro-batches are CapturedStageRuns, under TP the all-reduces run inside the
    bodies) against the single-process reference."""
    from rlt_mega.parallel import cuda_graphs, distributed

    def install(model):  # install_cuda_graphs without its CUDA check
        model.decoder = cuda_graphs.GraphedDecoder(all_reduce=model.decoder.all_reduce, capture=False)

    captured = {"stage_runs": 0}
    stage_run = cuda_graphs.GraphedDecoder.stage_run

    def counted(self, *args, **kwargs):
        captured["stage_runs"] += 1
        return stage_run(self, *args, **kwargs)

    original = distributed.install_cuda_graphs
    distributed.install_cuda_graphs, cuda_graphs.GraphedDecoder.stage_run = install, counted
    try:
        out = fused_vs_module(model, parallel, {**(train or {}), "cuda_graphs": True})
    finally:
        distributed.install_cuda_graphs, cuda_graphs.GraphedDecoder.stage_run = original, stage_run
    return {**out, **captured}
