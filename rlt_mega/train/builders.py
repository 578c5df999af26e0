"""What the trainers and the inference commands build from a config: the model's starting
weights, the engine for this rank's layout (the one place that picks the local or the
distributed engine), GRPO's frozen reference, and the model ``generate`` and ``eval`` run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from torch import nn

from rlt_mega.checkpoint import CheckpointError
from rlt_mega.checkpoint_tools.export import init_from, init_stage_from, read_config
from rlt_mega.checkpoint_tools.files import CheckpointFormatError
from rlt_mega.checkpoint_tools.training import is_training_checkpoint, load_training_weights
from rlt_mega.config import Config, ConfigError, ModelConfig
from rlt_mega.data.tokenizer import Tokenizer, check_same_tokenizer
from rlt_mega.log import get_logger
from rlt_mega.model.rlt import RLT, build_model
from rlt_mega.parallel.build import build_stage
from rlt_mega.learner.distill import Teacher
from rlt_mega.parallel.dims import ParallelDims, resolve_device, split_layers
from rlt_mega.parallel.engine import Engine, EngineConfig, LocalEngine
from rlt_mega.parallel.sharding import adapt_for_rank, shard_for_rank
from rlt_mega.parallel.tp import apply_tensor_parallel
from rlt_mega.rollout import Sampler

log = get_logger(__name__)


def check_vocab(cfg: Config, tokenizer: Tokenizer) -> None:
    if cfg.train.init_from:  # an export that carries its own tokenizer (an imported model's) needs it
        check_same_tokenizer(tokenizer, cfg.train.init_from, "train.init_from")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{cfg.model.vocab_size}: set model.vocab_size >= {tokenizer.vocab_size}")


def initial_model(cfg: Config, dims: ParallelDims) -> RLT:
    """The starting weights, on the CPU, this rank's part only: train.init_from's (only this
    rank's pipeline stage is read), or this rank's stage and shard of the model seeded by
    train.seed (parallel/build.py: built from the meta device, nothing else allocated, equal to
    the single-process model of the same seed). When train.resume finds a checkpoint, the
    engine's load replaces them (a restarted job continues from its own checkpoints)."""
    if cfg.train.init_from:
        return init_stage_from(cfg.train.init_from, cfg.model, dims.layers, dims.is_first_stage, dims.is_last_stage)
    return build_stage(cfg.model, dims, cfg.train.seed)


def build_engine(cfg: Config, dims: ParallelDims, engine: Optional[EngineConfig] = None) -> Engine:
    """This rank's part of the model (``initial_model``) inside the engine for ``dims``: the
    distributed engine wherever process groups exist, the local engine on the single-process
    layout. ``engine``: the step's shape (default: train.* as written)."""
    engine = engine or EngineConfig.from_train(cfg.train)
    model = initial_model(cfg, dims)
    if cfg.model.lora.enabled:  # adapters on this rank's stage and shard, the base frozen
        adapt_for_rank(shard_for_rank(model, dims), dims, cfg.train.seed)
    if dims.distributed:
        from rlt_mega.parallel.distributed import DistributedEngine  # imports DeepSpeed's pieces when used

        return DistributedEngine(model, dims, cfg.optim, engine, cfg.parallel, cfg.checkpoint)
    return LocalEngine(shard_for_rank(model, dims), dims, cfg.optim, engine, cfg.checkpoint.layout_free)


def reference_model(cfg: Config, dims: ParallelDims, engine: Engine) -> nn.Module:
    """GRPO's frozen reference: the initial policy in this rank's layout, without gradients, in
    the dtype the engine holds its parameters in (DeepSpeed's bf16 keeps bf16 parameters; the
    local engine autocasts over fp32)."""
    model = shard_for_rank(initial_model(cfg, dims), dims)
    return model.to(next(engine.module.parameters()).dtype).requires_grad_(False).eval()


def build_teacher(cfg: Config, dims: ParallelDims, tokenizer: Tokenizer, engine: Engine, comms, rows) -> Teacher:
    """grpo.teacher (learner/distill.py): the export's model, frozen, in this rank's layout (its
    own layers split over the pipeline stages by the same rule, parallel.dims.split_layers),
    replaying with the student's decoder step, rows and dtype. Everything that would make its
    scores meaningless or its replay impossible is refused here, before step 1: an export that
    does not load, another tokenizer or vocabulary, another memory block."""
    path = cfg.grpo.teacher
    check_same_tokenizer(tokenizer, path, "grpo.teacher")
    try:
        teacher_cfg = read_config(path)
    except (CheckpointError, CheckpointFormatError, OSError) as exc:
        raise ConfigError(f"grpo.teacher={path} does not load: {exc}") from None
    student = cfg.model
    if teacher_cfg.vocab_size != student.vocab_size:
        raise ConfigError(f"grpo.teacher={path} has a vocabulary of {teacher_cfg.vocab_size} tokens (its "
                          f"model.vocab_size) but the student has model.vocab_size={student.vocab_size} (data.tokenizer="
                          f"{tokenizer.name}): the teacher scores the student's token ids, so both need one tokenizer "
                          "and vocabulary")
    if teacher_cfg.memory_block != student.memory_block:
        raise ConfigError(f"grpo.teacher={path} has model.memory_block={teacher_cfg.memory_block} but the student "
                          f"has {student.memory_block}: the teacher replays the student's rollout schedule; export "
                          f"(or import) the teacher with memory_block {student.memory_block}")
    if teacher_cfg.arch != "rlt":
        raise ConfigError(f"grpo.teacher={path} is a model.arch={teacher_cfg.arch} export: the teacher replays the "
                          "rollout schedule, which is the RLT's; import the Llama/Qwen2 checkpoint with "
                          "`rlt-mega import` (without --arch dense)")
    if cfg.grpo.teacher_topk > student.vocab_size:
        raise ConfigError(f"grpo.teacher_topk={cfg.grpo.teacher_topk} exceeds the vocabulary of {student.vocab_size} "
                          f"tokens (model.vocab_size): choose k <= {student.vocab_size}")
    layers = split_layers(teacher_cfg.n_layers, dims.pp)[dims.pp_rank]
    try:
        model = init_stage_from(path, teacher_cfg, layers, dims.is_first_stage, dims.is_last_stage)
    except (CheckpointError, CheckpointFormatError, OSError, KeyError, RuntimeError) as exc:
        raise ConfigError(f"grpo.teacher={path} does not load: {exc}") from None
    apply_tensor_parallel(model, dims)  # (not shard_for_rank: that would prune to the student's layers)
    model = model.to(dims.device, next(engine.module.parameters()).dtype).requires_grad_(False).eval()
    log.info("grpo.teacher: %s (%d layers, d_model %d), teacher_coef %s%s", path, teacher_cfg.n_layers,
             teacher_cfg.d_model, cfg.grpo.teacher_coef, f", top-{cfg.grpo.teacher_topk} forward KL x "
             f"{cfg.grpo.teacher_topk_coef}" if cfg.grpo.teacher_topk else "")
    sampler = Sampler(model, comms, layers, check_every=cfg.sampling.check_every, rows=rows)
    return Teacher(sampler, str(path), cfg.grpo.teacher_topk)


def inference_model(cfg: Config) -> RLT:
    """The model of ``cfg`` for generate/eval, on train.device: weights from train.init_from (an
    export), else from the newest valid training checkpoint in checkpoint.dir."""
    device = resolve_device(cfg.train.device)
    model = build_model(cfg.model, device)
    if cfg.train.init_from:
        init_from(model, cfg.train.init_from)
        return model
    if not is_training_checkpoint(Path(cfg.checkpoint.dir)):
        raise CheckpointError(f"no weights: set train.init_from=<export directory>, or train into "
                              f"checkpoint.dir={cfg.checkpoint.dir} first")
    saved_cfg, state, source = load_training_weights(cfg.checkpoint.dir)
    for f in dataclasses.fields(ModelConfig):  # as train.init_from does: shapes must agree (below)
        if getattr(saved_cfg.model, f.name) != getattr(cfg.model, f.name):
            log.warning("checkpoint %s: model.%s is %s there but %s in this config", source["path"], f.name,
                        getattr(saved_cfg.model, f.name), getattr(cfg.model, f.name))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint {source['path']}: its weights do not fit model.* of this config "
                              f"(use the checkpoint's own config.yaml): {exc}") from None
    log.info("weights from %s (step %s)", source["path"], source.get("step"))
    return model
