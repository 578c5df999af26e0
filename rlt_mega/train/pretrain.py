"""Pretraining: packed text windows, next-token cross-entropy, the dense schedule; on one
process or, under tensor/pipeline/ZeRO parallelism, on the layout a launcher started
(torchrun, the deepspeed launcher or srun; docs/distributed.md)."""

from __future__ import annotations

from rlt_mega.config import Config
from rlt_mega.data.datasets import BatchIterator, DataStats, pack, text_of, train_eval_records
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.log import get_logger
from rlt_mega.loss import shift
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.train import supervised

log = get_logger(__name__)


class PackedBatches:
    """grad_accum batches of packed windows per step, as {'inputs', 'targets'}."""

    def __init__(self, iterator: BatchIterator, grad_accum: int) -> None:
        self.iterator, self.grad_accum = iterator, grad_accum

    def next_batches(self) -> list[dict]:
        out = []
        for _ in range(self.grad_accum):
            inputs, targets = shift(next(self.iterator))
            out.append({"inputs": inputs, "targets": targets})
        return out

    def state_dict(self) -> dict:
        return self.iterator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.iterator.load_state_dict(state)


def run(cfg: Config) -> dict:
    return supervised.run(cfg, packed_data)


def packed_data(cfg: Config, dims: ParallelDims, tokenizer: Tokenizer, stats: DataStats):
    """This data-parallel rank's packed training windows and the held-out ones (supervised.DataFn)."""
    train_texts, eval_texts = train_eval_records(cfg.data, text_of(cfg.data.text_field), ["text"], stats,
                                                 seed=cfg.train.seed)
    train = pack(train_texts, tokenizer, cfg.data.seq_len)
    evald = pack(eval_texts, tokenizer, cfg.data.seq_len)
    log.info("data: %d train windows, %d eval windows of %d tokens; %s", len(train), len(evald),
             cfg.data.seq_len, stats.summary())
    # Data-parallel replicas read disjoint rows; the TP and PP ranks of a replica read the same.
    batches = PackedBatches(BatchIterator(train, cfg.train.micro_batch_size, cfg.train.seed, cfg.data.shuffle,
                                          rank=dims.dp_rank, world=dims.dp), cfg.train.grad_accum)
    size = cfg.train.micro_batch_size
    num_eval = min(len(evald), cfg.train.eval_batches * size)

    def eval_batches() -> list[dict]:
        out = []
        for start in range(0, num_eval, size):
            inputs, targets = shift(evald[start:start + size]["input_ids"])
            out.append({"inputs": inputs, "targets": targets})
        return out

    return batches, eval_batches
