"""One pipeline stage of an RLT, behind the small interface the ring schedule drives.

Stage s owns blocks and cross blocks ``layers = [a, b)``; stage 0 also owns ``embed`` and the
recurrence input (``recur_norm``, ``recur_proj``, ``z_init``), the last stage ``memory_norm``,
``final_norm`` and ``lm_head``. ``null_memory`` is replicated on every stage (each computes the
cross K/V of its own layers with ``model.memory_kv(m, layers)``) and its gradient is summed
over the pipeline group; a tied ``lm_head`` on the last stage is a second copy of ``embed``
whose gradient is summed with the first stage's, as Megatron does.

The interface (``j`` is a micro-batch, ``t`` a position; tensors in and out are what the
schedule sends and receives; the stage keeps its autograd graph between forward and backward)::

    start(batches, loss_scale, grad, loss)      per round
    enc_fwd(j, x) -> y      encoder layers; x None on stage 0 (embeds); y on the last stage is m
    mem_fwd(j, m)           cross K/V of my layers from the memory m (None on the last stage)
    dec_fwd(j, t, x) -> y   decoder layers at position t; on stage 0 x is z_{t-1} (None at t=0)
    loss_fwd(j) -> sum      last stage: head + the loss of micro-batch j (scaled for backward), a
                            loss of the logits (rlt_mega/loss.py, LogitsLoss)
    loss_bwd(j)             last stage
    dec_bwd(j, t, g) -> gx  g: gradient of y from the next stage (None where nothing was sent)
    mem_bwd(j) -> gm        gradient of m from my cross K/V
    enc_bwd(j, g) -> gx

Autograd cuts: each decoder step is backwarded on its own (its output gradient arrives over the
wire), so tensors that many steps read (the memory K/V, the embeddings, the head input) are
detached leaves whose gradients accumulate over the steps and are pushed into their producers
once. The decoder's K/V gradients need the steps of one micro-batch backwarded in decreasing t on
every stage; the reversed ring does exactly that.

The decoder: the stage's layers (and on stage 0 the recurrence input) are one prepared stack of
the model's decoder step (``model.decoder``, model/dense_decode.py; under tensor parallelism with
the reduce it was built with) per round, built at ``start`` from the current parameters; each
micro-batch is a run (model/decoder.py) whose ``forward``/``backward`` the decoder ops call
position by position, with no autograd graph per step. Its deferred weight gradients accumulate
over the round's micro-batches and reach the parameters in one autograd backward at ``finish``
(through the fused weights' expressions: the shadow parameters under ShadowGrads). With decoder
checkpointing each position is recomputed from what the run keeps just before its backward (the
same as on one process). Packed rows with document resets run the same step (model/layout.py):
stage 0 restarts their z from z_init, and the restarts' gradient reaches z_init.

A GRPO batch whose groups share prompts is encoded in its prompt pack (schedule/prompt_pack.py), as
on one process: stage 0 packs the embeddings, the encoder messages between stages are the packed
(1, total, d) activations and their gradients, and the last stage unpacks the memory to the row
layout (b, T, d) that every stage's cross K/V read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from rlt_mega.loss import DENSE_ROWS, Logits, LogitsLoss, Vocab
from rlt_mega.model.decoder import DecoderRun
from rlt_mega.model.stack import WeightGrads
from rlt_mega.model.documents import Documents
from rlt_mega.model.dense_decode import compute_dtype_of, row_plan, segment_length
from rlt_mega.model.rlt import RLT
from rlt_mega.parallel.cuda_graphs import GraphedDecoder
from rlt_mega.schedule.prompt_pack import PromptPack


def prune_to_stage(model: RLT, layers: range, is_first_stage: bool, is_last_stage: bool) -> RLT:
    """Removes (in place) everything stage ``layers`` does not own. Parameter names stay global
    (``blocks.5.attn.q.weight`` on the stage that owns layer 5), so checkpoints of different
    stages merge by name."""
    for i in range(model.cfg.n_layers):
        if i not in layers:
            model.blocks[i] = nn.Module()
            model.cross[i] = nn.Module()
            if model.dec_blocks is not None:
                model.dec_blocks[i] = nn.Module()
    if not is_first_stage:
        model.embed = None
        model.recur_norm = None
        model.recur_proj = None
        model.z_init = None
    if not is_last_stage:
        model.memory_norm = None
        model.final_norm = None
        model.lm_head = None
    return model


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.detach().requires_grad_(grad)


def _backward(outputs: list, grads: list) -> None:
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


@dataclass
class _MicroBatch:
    inputs: torch.Tensor  # (b, T) token ids
    batch: dict  # the loss's batch dict (inputs, and targets or what else the loss reads)
    emb: Optional[torch.Tensor] = None  # (b, T, d) stage 0: the embeddings, with graph
    enc_in: Optional[torch.Tensor] = None
    enc_out: Optional[torch.Tensor] = None
    m_in: Optional[torch.Tensor] = None  # the memory leaf my cross K/V read
    mem_out: list = field(default_factory=list)  # (k, v) with graph into m_in
    z_cut: dict = field(default_factory=dict)  # last stage: t -> leaf (b, 1, d) for the head
    loss: Optional[torch.Tensor] = None
    run: Optional[DecoderRun] = None  # the decoder's state for this micro-batch
    e: Optional[torch.Tensor] = None  # stage 0: the embeddings (T, b, d), contiguous rows
    z0: Optional[torch.Tensor] = None  # stage 0: z_{-1} (b, d) with its graph into z_init
    docs: Optional[Documents] = None  # packed rows with document resets (model/documents.py)
    pack: Optional[PromptPack] = None  # GRPO with shared prompts: the encoder's layout (schedule/prompt_pack.py)


class RLTStage:
    """The stage interface over a pruned (and possibly tensor-parallel) RLT."""

    def __init__(self, model: RLT, layers: range, is_first_stage: bool, is_last_stage: bool, vocab: Vocab) -> None:
        self.model, self.layers = model, layers
        self.is_first_stage, self.is_last_stage = is_first_stage, is_last_stage
        self.vocab = vocab  # how the loss reads the head's logits (a vocab shard under tensor parallelism)
        self.mbs: list[_MicroBatch] = []
        self.grad = True
        self.loss_scale = 1.0
        self.loss: Optional[LogitsLoss] = None  # this round's
        self.stack = None  # this round's prepared decoder stack
        self.fused_tensors: list = []  # its weights, with autograd into the parameters
        self.weight_grads: Optional[WeightGrads] = None

    # ------------------------------------------------------------------ shapes for receiving
    @property
    def dtype(self) -> torch.dtype:
        return self.model.null_memory.dtype

    def activation_shape(self, j: int, kind: str) -> tuple:
        """Shape of a message of ``kind`` for micro-batch j: "enc" for the encoder's activations
        and their gradients ((1, total, d) in a prompt pack, else (b, T, d)), "seq" (b, T, d) for
        the memory, "step" (b, 1, d) for a decoder position."""
        mb = self.mbs[j]
        b, T = mb.inputs.shape
        d = self.model.cfg.d_model
        if kind == "enc" and mb.pack is not None:
            return mb.pack.shape + (d,)
        return (b, T, d) if kind in ("enc", "seq") else (b, 1, d)

    # ------------------------------------------------------------------ round set-up
    def start(self, batches: list[dict], loss_scale: float, grad: bool, loss: LogitsLoss) -> None:
        """batches: the loss's batch dict of each micro-batch of this round (``inputs`` (b, T),
        one T per round); loss_scale multiplies the loss sum before backward (1 / global count
        times the data-parallel size, since DeepSpeed averages over data-parallel ranks)."""
        T = batches[0]["inputs"].shape[1]
        self.mbs = [_MicroBatch(b["inputs"], b, docs=Documents.of(b)) for b in batches]
        for mb in self.mbs:  # the same layout on every stage: a function of the batch's rows
            rows = mb.batch.get(DENSE_ROWS)
            mb.pack = None if rows is None else rows.encoder_pack(T, mb.inputs.device, mb.docs)
        self.loss_scale, self.grad, self.loss = loss_scale, grad, loss
        self._start_decoder(batches[0]["inputs"].shape[0])

    def _start_decoder(self, rows: int) -> None:
        """The round's decoder stack, from the parameters as they are now (shadows under ShadowGrads)."""
        model = self.model
        with torch.set_grad_enabled(self.grad):
            spec, tensors = model.decoder.weights(model, self.layers, self.is_first_stage)
        device = tensors[0].device
        self.stack = model.decoder.stack(model, spec, tensors, rows, self.grad, self.dtype,
                                         compute_dtype_of(self.dtype, device))
        self.fused_tensors = tensors if self.grad else []
        self.weight_grads = WeightGrads(spec, tensors) if self.grad else None

    def finish(self) -> None:
        """The end of the round: the fused decoder's weight gradients reach the parameters."""
        if self.weight_grads is not None:
            _backward(self.fused_tensors, self.weight_grads.grads())
        self.mbs, self.stack, self.fused_tensors, self.weight_grads = [], None, [], None

    # ------------------------------------------------------------------ forward
    def enc_fwd(self, j: int, x: Optional[torch.Tensor]) -> torch.Tensor:
        mb, model = self.mbs[j], self.model
        if self.is_first_stage:
            mb.emb = model.embed(mb.inputs)  # (b, T, d)
            x = mb.emb
            mb.e = mb.emb.detach().transpose(0, 1).contiguous()
        mb.enc_in = _leaf(x, self.grad)
        h = mb.enc_in
        if self.is_first_stage and mb.pack is not None:
            h = mb.pack.pack(h)  # (1, total, d); the embeddings' gradient comes back as (b, T, d)
        h = model.encode(h, layers=self.layers, documents=mb.docs if mb.pack is None else mb.pack)
        if self.is_last_stage:
            h = model.memory_norm(h)
            if mb.pack is not None:
                h = mb.pack.unpack(h)  # the memory in the row layout, (b, T, d)
        mb.enc_out = h
        return mb.enc_out

    def mem_fwd(self, j: int, m: Optional[torch.Tensor]) -> None:
        mb = self.mbs[j]
        mb.m_in = _leaf(mb.enc_out if self.is_last_stage else m, self.grad)
        dense = self.model.memory_kv(mb.m_in, layers=self.layers)
        mb.mem_out = [t for i in self.layers for t in (dense.k[i], dense.v[i])]
        b, T = mb.inputs.shape
        checkpoint = segment_length(self.model.checkpointing) if self.grad else None
        if self.is_first_stage:
            mb.z0 = self.model.initial_state(b)  # (b, d), graph into z_init
        rows = row_plan(mb.batch.get(DENSE_ROWS), b, T, mb.inputs.device, static=False)  # GRPO: schedule/dense.py
        memory = [(dense.k[i], dense.v[i]) for i in self.layers]
        if self.grad and isinstance(self.model.decoder, GraphedDecoder) and rows is None and mb.docs is None:
            # train.cuda_graphs: this micro-batch's positions captured (sends and receives outside)
            mb.run = self.model.decoder.stage_run(self.stack, b, T, memory, self.weight_grads, checkpoint)
            return
        mb.run = DecoderRun(self.stack, b, T, memory,
                          grads=self.weight_grads, checkpoint=checkpoint, rows=rows, documents=mb.docs,
                          embeddings=mb.e if self.is_first_stage and checkpoint is not None else None,
                          z0=mb.z0 if mb.docs is not None else None)

    def _fwd_mode(self) -> str:
        if not self.grad:
            return "none"
        return "save" if self.model.checkpointing.decoder == "none" else "checkpoint"

    def dec_fwd(self, j: int, t: int, x: Optional[torch.Tensor]) -> torch.Tensor:
        mb = self.mbs[j]
        if self.is_first_stage and t == 0:
            x = mb.z0.detach()
        else:
            x = x.detach().squeeze(1)  # (b, d)
        y = mb.run.forward(t, x, mb.e[t] if self.is_first_stage else None, mode=self._fwd_mode()).unsqueeze(1)
        if self.is_last_stage:
            mb.z_cut[t] = _leaf(y, self.grad)
        return y

    def dec_bwd(self, j: int, t: int, g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        mb = self.mbs[j]
        if self.is_last_stage:  # the head's gradient plus (t < T-1) the ring's, from stage 0 at t + 1
            head_grad = mb.z_cut.pop(t).grad
            g = head_grad if g is None else head_grad + g
        if g is None:
            g = torch.zeros(mb.inputs.shape[0], 1, self.model.cfg.d_model, dtype=self.dtype,
                            device=mb.inputs.device)
        gx = mb.run.backward(t, g.squeeze(1).to(self.dtype))
        if self.is_first_stage and t == 0:
            if mb.run.z0_grad is not None:  # the rows restarted from z_init at packed documents' starts
                gx = gx + mb.run.z0_grad
            _backward([mb.z0], [gx])  # into z_init
            return None
        return gx.unsqueeze(1)

    def loss_fwd(self, j: int) -> torch.Tensor:
        """Head over all positions at once (one GEMM shape, as the dense model does; a GRPO batch with
        compaction: over the positions its loss reads, DenseRows.head) -> the
        micro-batch's loss sum (fp32, no graph)."""
        mb = self.mbs[j]
        z = torch.cat([mb.z_cut[t] for t in range(len(mb.z_cut))], dim=1)  # (b, T, d)
        rows = mb.batch.get(DENSE_ROWS)
        chunk = self.model.checkpointing.head_chunk  # (loss.Logits: the head a chunk of positions at a time)
        logits = (Logits(z, self.model.head, chunk) if chunk else
                  self.model.head(z) if rows is None else rows.head(self.model.head, z))  # (b, T, V / tp) fp32
        total = self.loss.logits_loss(logits, mb.batch, self.vocab)
        if self.grad:
            mb.loss = total * self.loss_scale
        return total.detach()

    # ------------------------------------------------------------------ backward
    def loss_bwd(self, j: int) -> None:
        self.mbs[j].loss.backward()
        self.mbs[j].loss = None

    def mem_bwd(self, j: int) -> torch.Tensor:
        mb = self.mbs[j]
        _backward(mb.mem_out, [g for pair in mb.run.memory_grads() for g in pair])
        mb.mem_out = []
        if not self.is_first_stage:  # stage 0 still needs the embeddings' gradient (enc_bwd)
            mb.run = None
        g = mb.m_in.grad
        return torch.zeros_like(mb.m_in) if g is None else g

    def enc_bwd(self, j: int, g: torch.Tensor) -> Optional[torch.Tensor]:
        mb = self.mbs[j]
        _backward([mb.enc_out], [g])
        if self.is_first_stage:
            # Encoder-path gradient of the embeddings plus the decoder's, position by position.
            g_dec = mb.run.input_grads()  # (b, T, d)
            mb.run = None
            g_emb = g_dec if mb.enc_in.grad is None else mb.enc_in.grad + g_dec
            _backward([mb.emb], [g_emb])
            return None
        return mb.enc_in.grad
