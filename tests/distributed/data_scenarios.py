"""Distributed data scenarios (tests/distributed/test_data_parallel_reads.py), run on every rank:
the pretraining batch sources built for a real data-parallel layout (gloo process groups), their
rows returned for the test to compare with a single-process reference. Nothing asserts here."""

from __future__ import annotations

from pathlib import Path

import torch

from rlt_mega.config import from_dict
from rlt_mega.data.pretraining import pretraining_data
from rlt_mega.data.tokenizer import byte_level
from rlt_mega.parallel.dims import ParallelDims
from tests.helpers import make_prefix


def config(**data):
    return from_dict({"data": {"seq_len": 16, **data},
                      "train": {"micro_batch_size": 4, "grad_accum": 2, "steps": 20, "seed": 5, "eval_batches": 2},
                      "model": {"max_seq_len": 64}})


def rows(source, steps: int) -> list:
    """(steps * grad_accum) batches of windows (B, T + 1), as lists."""
    out = []
    for _ in range(steps):
        for mb in source.batches.next_batches():
            out.append(torch.cat([mb["inputs"], mb["targets"][:, -1:]], dim=1).tolist())
    return out


def data_paths(dir: str) -> dict:
    """Rank 0 preprocesses two corpora into ``dir``; then each path's first steps on this rank;
    the stream's state gathered over the ranks, loaded into a fresh source, and the steps that
    follow from both. ``args``: the datasets, for the test's single-process reference."""
    tok = byte_level()
    base = config()
    dims = ParallelDims.build(base.parallel, base.model, "cpu", base.train)
    root = Path(dir)
    prefix, corpus, other = str(root / "data" / "corpus"), str(root / "corpus.jsonl"), str(root / "data" / "other")
    if dims.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        make_prefix(root, "corpus", num_docs=300)
        make_prefix(root, "other", num_docs=200, seed=3)
    dims.barrier()
    args = {"prefix": prefix, "blend": [0.4, prefix, 0.6, other], "stream": corpus}
    out = {"dp_rank": dims.dp_rank, "dp": dims.dp, "args": args}
    out["indexed"] = rows(pretraining_data(config(train=prefix), tok, dims), 3)
    out["blend"] = rows(pretraining_data(config(blend=args["blend"]), tok, dims), 3)
    streaming = config(train=corpus, streaming=True, shuffle_buffer=4)
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

