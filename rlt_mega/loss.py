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

The logits a loss reads come as :class:`Logits`: the (B, T, V_local) tensor itself, or under
``train.checkpointing.head_chunk`` the head's input z and the head, applied a chunk of positions
at a time (each chunk's logits recomputed in the backward), so that at most one chunk of fp32
logits is alive. A loss reads them through ``Logits.map`` and runs under both.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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


class Logits:
    """The dense schedule's logits as a loss reads them (the engine builds them).

    ``Logits(logits)``: the logits (B, T, V_local) fp32 themselves. ``Logits(z, head, chunk)``
    (train.checkpointing.head_chunk = chunk > 0): the head's input z (B, T, d) and the head
    (final norm + lm_head, z -> fp32 logits), applied ``chunk`` positions at a time where the
    loss reads, each chunk's head and loss terms checkpointed (recomputed in the backward), so
    that at most one chunk of fp32 logits and of what the loss makes of them is alive.

    The recomputation is exact: the gradients equal those of the same chunks kept (``recompute``
    False, the tests' reference) bit for bit. Against the whole head at once they are equal to
    rounding only: the head's GEMM (MKL, cuBLAS) picks its blocking, hence the order it sums over
    d (forward) and over V (the input's gradient), by the number of rows, so a row's logits in a
    chunk's GEMM may differ in the last bit from the same row's in the whole GEMM; and a summed
    loss and the head's weight gradients are sums over chunks."""

    def __init__(self, x: torch.Tensor, head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 chunk: int = 0, recompute: bool = True) -> None:
        self.x, self.head, self.chunk = x, head, chunk if head is not None else 0
        self.recompute = recompute

    @staticmethod
    def of(logits) -> "Logits":
        """A loss's argument as Logits (a plain tensor of logits wrapped)."""
        return logits if isinstance(logits, Logits) else Logits(logits)

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T): the rows and positions."""
        return tuple(self.x.shape[:2])

    def rows(self, start: int, stop: int) -> "Logits":
        return Logits(self.x[start:stop], self.head, self.chunk, self.recompute)

    def map(self, fn: Callable[..., object], index: Optional[torch.Tensor] = None,
            *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``fn(logits (n, V_local), *args' n rows)`` -> a tensor or a tuple of tensors, each with
        n rows or 0-dim (a sum), for the flat positions ``index`` (M,) (b * T + t; None: every
        position, row-major) and per-position ``args`` (M, ...) -> each output concatenated over
        the chunks (M, ...) (a 0-dim output: (num_chunks,))."""
        flat = self.x.reshape(-1, self.x.shape[-1])
        M = flat.shape[0] if index is None else index.shape[0]
        step = self.chunk if self.chunk > 0 else max(M, 1)

        def piece(lo: int, hi: int, *piece_args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            x = flat[lo:hi] if index is None else flat.index_select(0, index[lo:hi])
            out = fn(x if self.head is None else self.head(x), *piece_args)
            return tuple(o.reshape(1) if o.dim() == 0 else o for o in (out if isinstance(out, tuple) else (out,)))

        pieces = []
        for lo in range(0, max(M, 1), step):  # (no positions: one empty piece, the outputs' shapes)
            sliced = [a[lo:lo + step] for a in args]
            if self.chunk > 0 and self.recompute and torch.is_grad_enabled():  # the chunk's logits recomputed in the backward
                pieces.append(checkpoint(piece, lo, lo + step, *sliced, use_reentrant=False,
                                         preserve_rng_state=False))  # (the head draws no random numbers)
            else:
                pieces.append(piece(lo, lo + step, *sliced))
        if len(pieces) == 1:
            return pieces[0]
        return tuple(torch.cat(outs) for outs in zip(*pieces))


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

    ``logits_loss(logits, batch, vocab)``: logits (b, T, V_local) fp32 of the tokens (under
    train.checkpointing.head_chunk a :class:`Logits`; ``Logits.of`` reads either)
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

    def logits_loss(self, logits: torch.Tensor | Logits, batch: dict, vocab: Vocab) -> torch.Tensor:
        raise NotImplementedError

    def count(self, batch: dict) -> float:
        raise NotImplementedError

    def split(self, batch: dict, num_pieces: int) -> list[dict]:
        return [batch]


class TokenCrossEntropy(LogitsLoss):
    """Next-token cross-entropy of language modelling (pretraining, SFT): batches
    ``{"inputs": (b, T), "targets": (b, T)}``, targets IGNORE where there is none; normalised
    by the number of target tokens. Rows are independent, so the engine may cut a batch."""

    def logits_loss(self, logits: torch.Tensor | Logits, batch: dict, vocab: Vocab) -> torch.Tensor:
        """The chunks' sums added (one chunk: the whole sum, as before chunking)."""
        return Logits.of(logits).map(vocab.cross_entropy_sum, None, batch["targets"].reshape(-1))[0].sum()

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
