"""Packed SFT rows with document resets on a distributed layout against one process trained on
the same pairs one per row (tests/distributed/test_packing_parallel.py; the unit tier,
tests/unit/test_packing.py, checks the same on one process)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlt_mega.data.packing import packed_batch
from rlt_mega.loss import IGNORE
from rlt_mega.train.sft import sft_batch
from tests.distributed.scenarios import Reference, _close, _engine, make_cfg, max_diff
from rlt_mega.parallel.gather import gather_full

# Pair lengths in positions (tokens - 1) per packed row, with C = 4: documents ending on a
# memory-block boundary (4, 8) and off it (5, 3, 6, 7), one row with padding at its end.
ROWS = [[5, 4, 3, 7], [8, 6], [3, 5, 6, 2]]


def pairs_case(vocab: int, rows=ROWS, seed: int = 0) -> tuple[list[list[tuple[list[int], int, list]]], int]:
    """Random (ids, num_prompt, observed: none) pairs laid out in rows; returns (rows of pairs, the
    row length)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths in rows:
        row = []
        for n in lengths:
            ids = torch.randint(0, vocab, (n + 1,), generator=g).tolist()
            num_prompt = 1 + int(torch.randint(0, max(1, n - 1), (1,), generator=g))  # at least one answer token
            row.append((ids, num_prompt, []))
        out.append(row)
    return out, max(sum(r) for r in rows)


def unpacked_batch(rows, pad_id: int = 0) -> dict:
    """The same pairs one per row (sft_batch, the unpacked SFT path)."""
    pairs = [p for row in rows for p in row]
    return sft_batch({"ids": [p[0] for p in pairs], "num_prompt": [p[1] for p in pairs]}, pad_id)


def packed_vs_unpacked(model=None, parallel=None, train=None) -> dict:
    """One backward of the engine on the packed rows against the one-process reference on the
    unpacked pairs: the loss (sum over answer tokens / their count) and every gathered gradient."""
    cfg = make_cfg({"memory_block": 4, "max_seq_len": 32, **(model or {})}, parallel,
                   {"micro_batch_size": len(ROWS), **(train or {})})
    dims, engine = _engine(cfg)
    rows, length = pairs_case(cfg.model.vocab_size)
    packed = packed_batch(rows, pad_id=0, length=length, reset=True)
    flat = unpacked_batch(rows)
    ref = Reference(cfg)
    ref.opt.zero_grad(set_to_none=True)
    logits = ref.model(flat["inputs"])
    count = int((flat["targets"] != IGNORE).sum())
    ref_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat["targets"].reshape(-1),
                               ignore_index=IGNORE, reduction="sum") / count
    ref_loss.backward()
    loss, tokens, _ = engine.backward_step([packed])
    full = gather_full(engine.gradients(), dims)
    out = {"loss": loss, "ref_loss": float(ref_loss), "tokens": tokens, "ref_tokens": count}
    out["grad_diff"], out["grad_worst"] = max_diff(full, ref.grads())
    out["grad_scale"] = max(float(g.abs().max()) for g in ref.grads().values())
    _close(dims, engine)
    return out
