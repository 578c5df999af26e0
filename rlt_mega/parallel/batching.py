"""How the distributed engine turns a step's batches into what its schedules run: pipeline
micro-batches (a batch cut into row blocks where the loss allows it), rounds of M in flight
for the decoder ring, and the padding that makes the shapes agree where they must.

A step is ``train.grad_accum`` batches of ``train.micro_batch_size`` rows (the loss's batch
dicts). ``parallel.micro_batches`` (M) pipeline micro-batches run in flight at once;
parallel.dims.micro_batch_plan says how the batches become them: whole (M <= grad_accum, in
grad_accum / M rounds) or each cut into M / grad_accum pieces (one round).

Padding appends tokens after the end of a sequence: everything is causal, so no earlier
position changes; padded targets are IGNORE, and a loss reads only its own positions
(rlt_mega/loss.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlt_mega.loss import DENSE_ROWS, DOC_STARTS, IGNORE, Logits, LogitsLoss
from rlt_mega.model.documents import Documents
from rlt_mega.parallel.dims import ParallelDims


def forward_kwargs(batch: dict) -> dict:
    """The model's keyword arguments for a batch: ``documents`` where the batch is packed with
    resets, ``rows`` where a batch says which rows the dense decoder runs
    (schedule/dense.py), nothing otherwise (so a plain batch calls any model as before)."""
    documents = Documents.of(batch)
    kwargs = {} if documents is None else {"documents": documents}
    if batch.get(DENSE_ROWS) is not None:
        kwargs["rows"] = batch[DENSE_ROWS]
    return kwargs


def dense_logits(call, module: torch.nn.Module, batch: dict) -> torch.Tensor | Logits:
    """What a loss reads of one batch: the dense schedule's logits (b, T, V_local) fp32 from ``call``
    (the model, or the DeepSpeed engine around it); under train.checkpointing.head_chunk its
    head's input z and ``module``'s head (loss.Logits), which the loss applies a chunk of
    positions at a time."""
    chunk = module.checkpointing.head_chunk
    if not chunk:
        return call(batch["inputs"], **forward_kwargs(batch))
    return Logits(call(batch["inputs"], hidden=True, **forward_kwargs(batch)), module.head, chunk)  # z (b, T, d)


def pad_to(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """(b, T) -> (b, length), right-padded with ``value``."""
    if x.shape[1] == length:
        return x
    return F.pad(x, (0, length - x.shape[1]), value=value)


def pad_batch(batch: dict, length: int) -> dict:
    """The batch with ``inputs`` (and ``targets`` and ``doc_starts``, where it has them)
    right-padded to ``length`` positions: pad token 0, target IGNORE. A new dict; the caller's is unchanged."""
    out = {**batch, "inputs": pad_to(batch["inputs"], length, 0)}
    if torch.is_tensor(batch.get("targets")):
        out["targets"] = pad_to(batch["targets"], length, IGNORE)
    if torch.is_tensor(batch.get(DOC_STARTS)):  # packed documents: the padding continues each row's last
        out[DOC_STARTS] = pad_to(batch[DOC_STARTS], length, False)  # document (no new start)
    return out


def pipeline_batches(batches: list[dict], loss: LogitsLoss, num_pieces: int, device: torch.device) -> list[dict]:
    """The step's batches as pipeline micro-batches on ``device``: each cut into ``num_pieces``
    row blocks by ``loss.split`` (a loss that keeps its batches whole returns them as given;
    its caller formed the pipeline micro-batches)."""
    out = []
    for batch in batches:
        for piece in loss.split(batch, num_pieces):
            out.append({k: v.to(device) if torch.is_tensor(v) else v for k, v in piece.items()})
    return out


def same_length_over_dp(batches: list[dict], dims: ParallelDims) -> list[dict]:
    """Pads each micro-batch to the longest of its index over the data-parallel ranks.

    ZeRO-3 gathers a partitioned parameter with a collective over the data-parallel group at
    each submodule call, and the decoder calls its blocks once per position: every rank must
    run the same number of positions. A collective over the data-parallel group."""
    lengths = torch.tensor([b["inputs"].shape[1] for b in batches], dtype=torch.long, device=dims.device)
    dims.all_reduce(lengths, op="max", axis="dp")
    return [pad_batch(b, int(T)) for b, T in zip(batches, lengths.tolist())]


def rounds(batches: list[dict], num_in_flight: int) -> list[list[dict]]:
    """Pipeline micro-batches grouped into rounds of ``num_in_flight`` (M); the ring runs one
    length per round, so each round is padded to its longest."""
    out = []
    for i in range(0, len(batches), num_in_flight):
        round_ = batches[i:i + num_in_flight]
        longest = max(b["inputs"].shape[1] for b in round_)
        out.append([pad_batch(b, longest) for b in round_])
    return out
