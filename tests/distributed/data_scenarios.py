"""Distributed data scenarios (tests/distributed/test_data_parallel_reads.py), run on every rank:
the pretraining batch sources built for a real data-parallel layout (gloo process groups), their
rows returned for the test to compare with a single-process reference. Nothing asserts here."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlt_mega.checkpoint import load_torch
from rlt_mega.config import from_dict
from rlt_mega.data.datasets import DataStats
from rlt_mega.data.pretraining import pretraining_data
from rlt_mega.data.tokenizer import byte_level
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.train.builders import build_engine
from rlt_mega.train.loop import Trainer
from rlt_mega.train.pretrain import packed_data
from rlt_mega.train.supervised import SupervisedJob, phase_timers
from tests.helpers import make_prefix, write_corpus


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


def streamed_training(dir: str) -> dict:
    """A streamed pretraining run through the trainer and the distributed engine on this
    layout: uninterrupted to step 6, and stopped after 3 (checkpoints at 2 and 3), moved back
    to the checkpoint of step 2 and resumed. Each rank's stream position is gathered into rank
    0's trainer.pt at every save. -> whether the final weights are equal, and what step 2's
    checkpoint holds."""
    root = Path(dir)
    tiny = {"d_model": 32, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 64, "n_layers": 2, "memory_block": 2,
            "max_seq_len": 64}

    def cfg(name: str, **train):
        return from_dict({"model": tiny, "data": {"train": str(root / "stream.jsonl"), "streaming": True,
                                                  "shuffle_buffer": 4, "seq_len": 16},
                          "optim": {"warmup_steps": 2, "lr": 5e-3},
                          "train": {"micro_batch_size": 2, "grad_accum": 2, "steps": 6, "eval_every": 0, "seed": 3,
                                    "log_every": 1, **train},
                          "checkpoint": {"dir": str(root / name / "ckpt"), "every": 2, "keep": 3},
                          "logging": {"dir": str(root / name / "tb"), "progress": False}})

    def train(config) -> None:
        batches, eval_batches = packed_data(config, dims, byte_level(), DataStats())
        engine = build_engine(config, dims)
        timers = phase_timers()
        job = SupervisedJob(config.train, dims, engine, batches, eval_batches, timers)
        Trainer(config, dims, engine, job, timers).run()
        engine.close()

    first = cfg("full")
    dims = ParallelDims.build(first.parallel, first.model, "cpu", first.train)
    if dims.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        write_corpus(root / "stream.jsonl", 300, seed=4)
    dims.barrier()
    train(first)
    train(cfg("split", stop_after=3))
    ckpt = root / "split" / "ckpt"
    if dims.rank == 0:  # resume from step 2: the streams had moved on since
        (ckpt / "latest").write_text("step_00000002")
        shutil.rmtree(ckpt / "step_00000003")
    dims.barrier()
    saved = load_torch(ckpt / "step_00000002" / "trainer.pt", deepspeed=True)["job"]["data"]
    train(cfg("split", resume="auto"))
    full = load_file(root / "full" / "ckpt" / "step_00000006" / "model.safetensors")
    resumed = load_file(ckpt / "step_00000006" / "model.safetensors")
    dims.destroy()
    return {"stream_ranks": len(saved["stream_ranks"]), "same_keys": full.keys() == resumed.keys(),
            "unequal": [key for key in full if not torch.equal(full[key], resumed.get(key, torch.empty(0)))]}
