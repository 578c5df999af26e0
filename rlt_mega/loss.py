"""The loss contract between the engines (parallel/) and the losses (learner/, the trainers):
a leaf module both import, so that no import runs back up the layering.

A loss is a function of the dense schedule's logits (Megatron's ``forward_step -> (output,
loss_fn)`` contract): the engine owns where the logits come from (the whole model on one
device; a vocab shard under tensor parallelism; the last stage under pipeline parallelism),
the loss only what is done with them. Every engine runs every :class:`LogitsLoss` on every
layout.

Normalisation is explicit and has one home, the engine: ``logits_loss`` returns the SUM of
the batch's per-token (or per-sequence) losses and ``count`` the batch's share of what the
step is normalised by; the engine divides the step's summed loss by the step's summed count
over every batch and every data-parallel rank. A loss that averages per sequence (a count of
sequences, not tokens) fits the same contract without touching an engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # target id that carries no loss (padding, prompt tokens in SFT)
# A packed batch's (B, T) bool document starts (data.reset_at_document): written by the data
# path, read by the model (model/documents.py), padded and cut with the rows by the engines.
DOC_STARTS = "doc_starts"
# A learner batch's rows (schedule/dense.py DenseRows: each row's length, prompt and group):
# written by the learner, read by the model's dense schedule as the layout it runs.
DENSE_ROWS = "dense_rows"


def shift(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed window (B, T + 1) -> inputs (B, T), targets (B, T)."""
    return window[:, :-1], window[:, 1:]


def count_tokens(targets: torch.Tensor) -> int:
    return int((targets != IGNORE).sum())


class Vocab:
    """How a loss reads logits whose last dimension is the whole vocabulary (one device, or a
    model without tensor parallelism). parallel/tp.py's ``ShardedVocab`` is the same interface
    over a vocab shard (..., V / tp)."""

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V_local) -> (..., V), differentiably; the identity here."""
        return logits

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """logits (B, T, V) fp32, targets (B, T) -> summed cross-entropy over non-IGNORE targets."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                               reduction="sum")


WHOLE_VOCAB = Vocab()


class LogitsLoss:
    """A loss of the dense schedule's logits.

    ``logits_loss(logits, batch, vocab)``: logits (b, T, V_local) fp32 of the tokens
    ``batch["inputs"]`` (b, T0 <= T: a pipeline round pads its batches to one length with tokens
    whose logits the loss must not read); ``vocab`` (:class:`Vocab`) gathers a vocab shard into
    whole rows or computes the token cross-entropy on the shard. Returns the SUM of the
    batch's losses (a 0-dim tensor with the graph).

    ``count(batch)``: the batch's share of the normaliser (summed by the engine over the step's
    batches and the data-parallel ranks).

    ``split(batch, num_pieces)``: the batch as the engine's pipeline micro-batches when its plan
    cuts every batch into ``num_pieces`` row blocks (parallel.dims.micro_batch_plan). By default
    a loss keeps its batches whole: the caller formed them as they must be computed (a GRPO
    batch is one rollout batch, replayed as it was sampled)."""

    def logits_loss(self, logits: torch.Tensor, batch: dict, vocab: Vocab) -> torch.Tensor:
        raise NotImplementedError

    def count(self, batch: dict) -> float:
        raise NotImplementedError

    def split(self, batch: dict, num_pieces: int) -> list[dict]:
        return [batch]


class TokenCrossEntropy(LogitsLoss):
    """Next-token cross-entropy of language modelling (pretraining, SFT): batches
    ``{"inputs": (b, T), "targets": (b, T)}``, targets IGNORE where there is none; normalised
    by the number of target tokens. Rows are independent, so the engine may cut a batch."""

    def logits_loss(self, logits: torch.Tensor, batch: dict, vocab: Vocab) -> torch.Tensor:
        return vocab.cross_entropy_sum(logits, batch["targets"])

    def count(self, batch: dict) -> float:
        return count_tokens(batch["targets"])

    def split(self, batch: dict, num_pieces: int) -> list[dict]:
        """Row blocks (fewer than num_pieces when the batch has fewer rows, e.g. the last eval batch)."""
        if num_pieces == 1:
            return [batch]
        # every per-row tensor (inputs, targets, a packed batch's doc_starts) cut the same way
        keys = [k for k, v in batch.items() if torch.is_tensor(v) and v.shape[:1] == batch["inputs"].shape[:1]]
        return [dict(zip(keys, rows)) for rows in zip(*(batch[k].chunk(num_pieces) for k in keys))]


LM_LOSS = TokenCrossEntropy()
