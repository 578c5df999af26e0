"""Pretraining: packed text windows (in memory, memory-mapped indexed datasets, blends or
streams: rlt_mega/data/pretraining.py) with next-token cross-entropy, or a generated
state-tracking task (data.train=generated:<task>, rlt_mega/data/state_tasks.py) with the
cross-entropy of its targets; the dense schedule; on one
process or, under tensor/pipeline/ZeRO parallelism, on the layout a launcher started
(torchrun, the deepspeed launcher or srun; docs/distributed.md)."""

from __future__ import annotations

from rlt_mega.config import Config, state_task
from rlt_mega.data.datasets import DataStats
from rlt_mega.data.pretraining import pretraining_data
from rlt_mega.data.state_tasks import state_task_data
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.train import supervised


def run(cfg: Config) -> dict:
    return supervised.run(cfg, packed_data)


def packed_data(cfg: Config, dims: ParallelDims, tokenizer: Tokenizer, stats: DataStats):
    """This data-parallel rank's packed training windows and the held-out ones (supervised.DataFn),
    from the data path ``cfg.data`` names (in memory, indexed, blend or streaming), or the
    sequences of a generated state-tracking task."""
    if state_task(cfg.data.train) is not None:
        return state_task_data(cfg, dims.dp_rank)
    data = pretraining_data(cfg, tokenizer, dims, stats)

    def eval_batches() -> list[dict]:  # every data-parallel rank evaluates the same windows
        return data.eval_batches(cfg.train.micro_batch_size)

    return data.batches, eval_batches
