"""Pretraining: packed text windows (in memory, memory-mapped indexed datasets, blends or
streams: rlt_mega/data/pretraining.py), next-token cross-entropy, the dense schedule (or, under
tensor/pipeline/ZeRO parallelism, the distributed engine: the same loop, launched with
torchrun, the deepspeed launcher or srun; see docs/distributed.md)."""

from __future__ import annotations

import torch

from rlt_mega.checkpoint_tools.export import init_from, init_stage_from
from rlt_mega.config import Config, ConfigError
from rlt_mega.data.pretraining import PackedBatches, pretraining_data  # noqa: F401 (PackedBatches: the tests' hooks)
from rlt_mega.data.tokenizer import Tokenizer, load_tokenizer
from rlt_mega.log import get_logger
from rlt_mega.model import RLT, build_model
from rlt_mega.parallel import distributed
from rlt_mega.parallel.engine import LocalEngine, resolve_device
from rlt_mega.train.loop import Trainer

log = get_logger(__name__)


def check_vocab(cfg: Config, tokenizer: Tokenizer) -> None:
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
    data = pretraining_data(cfg, tokenizer, dims)  # the data path (in memory, indexed, blend, streaming)
    batches = data.batches
    model, engine = build_distributed(cfg, dims) if dims is not None else build_local(cfg)[:2]
    log.info("model: %.2fM parameters, C=%d, L=%d, d=%d", sum(p.numel() for p in model.parameters()) / 1e6,
             cfg.model.memory_block, cfg.model.n_layers, cfg.model.d_model)

    def eval_batches() -> list[dict]:
        return data.eval_batches(cfg.train.micro_batch_size)

    if dims is None:
        result = Trainer(cfg, engine, batches, eval_batches).run()
    else:  # every data-parallel rank evaluates the same windows; the engine averages over all
        import torch.distributed as dist

        result = Trainer(cfg, engine, batches, eval_batches, rank=dims.rank, barrier=dist.barrier).run()
    if data.stats.total:
        log.warning("data: %s", data.stats.summary())
    result["data/skipped"] = data.stats.total
    return result
