"""Pretraining: packed text windows, next-token cross-entropy, the dense schedule (or, under
tensor/pipeline/ZeRO parallelism, the distributed engine: the same loop, launched with
torchrun, the deepspeed launcher or srun; see docs/distributed.md)."""

from __future__ import annotations

import torch

from rlt_mega.checkpoint_tools.export import init_from, init_stage_from
from rlt_mega.config import Config, ConfigError
from rlt_mega.data.datasets import BatchIterator, DataStats, pack, text_of, train_eval_records
from rlt_mega.data.tokenizer import Tokenizer, check_same_tokenizer, load_tokenizer
from rlt_mega.learner.loss import shift
from rlt_mega.log import get_logger
from rlt_mega.model import RLT, build_model
from rlt_mega.parallel import distributed
from rlt_mega.parallel.engine import LocalEngine, resolve_device
from rlt_mega.train.loop import Trainer

log = get_logger(__name__)


class PackedBatches:
    """grad_accum micro-batches of packed windows per step, as {'inputs', 'targets'}."""

    def __init__(self, iterator: BatchIterator, grad_accum: int) -> None:
        self.iterator, self.grad_accum = iterator, grad_accum

    def next_micro_batches(self) -> list[dict]:
        out = []
        for _ in range(self.grad_accum):
            inputs, targets = shift(next(self.iterator))
            out.append({"inputs": inputs, "targets": targets})
        return out

    def state_dict(self) -> dict:
        return self.iterator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.iterator.load_state_dict(state)


def check_vocab(cfg: Config, tokenizer: Tokenizer) -> None:
    if cfg.train.init_from:  # an export that carries its own tokenizer (an imported model's) needs it
        check_same_tokenizer(tokenizer, cfg.train.init_from, "train.init_from")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but model.vocab_size="
                         f"{cfg.model.vocab_size}: set model.vocab_size >= {tokenizer.vocab_size}")


def build_local(cfg: Config) -> tuple[RLT, LocalEngine, torch.device]:
    """Model and single-device engine, seeded by train.seed."""
    device = resolve_device(cfg.train.device)
    model = build_model(cfg.model, device, seed=cfg.train.seed)
    if cfg.train.init_from:
        # Weights only. When train.resume=auto finds a checkpoint, the engine's load replaces
        # them, so a restarted job continues from its own checkpoints.
        init_from(model, cfg.train.init_from)
    model.set_checkpointing(cfg.train.checkpointing)
    return model, LocalEngine(model, cfg.optim, cfg.train, device), device


def initial_model(cfg: Config, dims) -> RLT:
    """The starting weights of a distributed run on the CPU: the same seeded single-device model
    on every rank, or only this rank's pipeline stage read from train.init_from."""
    if cfg.train.init_from:
        return init_stage_from(cfg.train.init_from, cfg.model, dims.layers, dims.is_first_stage, dims.is_last_stage)
    return build_model(cfg.model, "cpu", seed=cfg.train.seed)


def build_distributed(cfg: Config, dims) -> tuple[RLT, "distributed.DistributedEngine"]:
    """This rank's part of the model (``initial_model``) and the distributed engine."""
    engine = distributed.build_engine(cfg, dims, lambda: initial_model(cfg, dims))
    return engine.module, engine


def run(cfg: Config) -> dict:
    with distributed.launch(cfg) as dims:  # None: one process, the local engine
        return _run(cfg, dims)


def _run(cfg: Config, dims) -> dict:
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_vocab(cfg, tokenizer)
    stats = DataStats()
    train_texts, eval_texts = train_eval_records(cfg.data, text_of(cfg.data.text_field), ["text"], stats,
                                                 seed=cfg.train.seed)
    train = pack(train_texts, tokenizer, cfg.data.seq_len)
    evald = pack(eval_texts, tokenizer, cfg.data.seq_len)
    log.info("data: %d train windows, %d eval windows of %d tokens; %s", len(train), len(evald),
             cfg.data.seq_len, stats.summary())
    # Data-parallel replicas read disjoint rows; the TP and PP ranks of a replica read the same.
    dp_rank, dp = (dims.dp_rank, dims.dp) if dims is not None else (0, 1)
    batches = PackedBatches(BatchIterator(train, cfg.train.micro_batch_size, cfg.train.seed, cfg.data.shuffle,
                                          rank=dp_rank, world=dp), cfg.train.grad_accum)
    model, engine = build_distributed(cfg, dims) if dims is not None else build_local(cfg)[:2]
    log.info("model: %.2fM parameters, C=%d, L=%d, d=%d", sum(p.numel() for p in model.parameters()) / 1e6,
             cfg.model.memory_block, cfg.model.n_layers, cfg.model.d_model)

    num_eval = min(len(evald), cfg.train.eval_batches * cfg.train.micro_batch_size)

    def eval_batches() -> list[dict]:
        out = []
        for start in range(0, num_eval, cfg.train.micro_batch_size):
            inputs, targets = shift(evald[start:start + cfg.train.micro_batch_size]["input_ids"])
            out.append({"inputs": inputs, "targets": targets})
        return out

    if dims is None:
        result = Trainer(cfg, engine, batches, eval_batches).run()
    else:  # every data-parallel rank evaluates the same windows; the engine averages over all
        import torch.distributed as dist

        result = Trainer(cfg, engine, batches, eval_batches, rank=dims.rank, barrier=dist.barrier).run()
    if stats.total:
        log.warning("data: %s", stats.summary())
    result["data/skipped"] = stats.total
    return result
