"""Distributed data scenarios (tests/parallel/test_data_distributed.py), run on every rank: the
pretraining batch sources built for a real data-parallel layout (gloo process groups), their
rows returned for the test to compare with a single-process reference. Nothing asserts here."""

from __future__ import annotations

import torch

from rlt_mega.config import from_dict
from rlt_mega.data.pretraining import pretraining_data
from rlt_mega.data.tokenizer import byte_level
from rlt_mega.parallel.dims import ParallelDims


def config(**data):
    return from_dict({"data": {"seq_len": 16, **data},
                      "train": {"micro_batch_size": 4, "grad_accum": 2, "steps": 20, "seed": 5, "eval_batches": 2},
                      "model": {"max_seq_len": 64}})


def rows(source, steps: int) -> list:
    """(steps * grad_accum) micro-batches of windows (B, T + 1), as lists."""
    out = []
    for _ in range(steps):
        for mb in source.batches.next_micro_batches():
            out.append(torch.cat([mb["inputs"], mb["targets"][:, -1:]], dim=1).tolist())
    return out


def data_paths(prefix: str, blend: list, stream: str) -> dict:
    """Each path's first steps on this rank; the stream's state gathered over the ranks, loaded
    into a fresh source, and the steps that follow from both."""
    tok = byte_level()
    cfg = config(train=prefix)
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", cfg.train)
    out = {"dp_rank": dims.dp_rank, "dp": dims.dp}
    out["indexed"] = rows(pretraining_data(cfg, tok, dims), 3)
    out["blend"] = rows(pretraining_data(config(blend=blend), tok, dims), 3)
    streaming = config(train=stream, streaming=True, shuffle_buffer=4)
    source = pretraining_data(streaming, tok, dims)
    out["stream"] = rows(source, 3)
    state = source.batches.state_dict()  # an all-gather over the data-parallel group
    out["stream_ranks"] = len(state["stream_ranks"])
    out["own_state_gathered"] = torch.equal(state["stream_ranks"][dims.dp_rank]["pending"],
                                            torch.from_numpy(source.batches.iterator.pending.astype("int32")))
    out["stream_next"] = rows(source, 4)
    resumed = pretraining_data(streaming, tok, dims)
    resumed.batches.load_state_dict(state)
    out["stream_resumed"] = rows(resumed, 4)
    out["eval_stream"] = source.eval_windows.tolist()
    dims.destroy()
    return out
