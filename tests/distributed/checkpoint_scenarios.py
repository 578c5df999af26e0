"""Distributed checkpoint scenarios (run on every rank by tests/distributed/worker.py as
``checkpoint_scenarios.<name>``): train and save on a layout, start a layout from an export,
resume on another data-parallel size. They write checkpoints and tensors under ``root`` for
the test process, which checks them against single-process models and DeepSpeed's own
utilities; they return only small facts. Nothing here asserts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from rlt_mega.checkpoint import CheckpointError, CheckpointManager
from rlt_mega.config import Config, save_config
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.gather import gather_full
from rlt_mega.parallel.tp import gather_vocab
from rlt_mega.train.builders import build_engine
from tests.distributed.scenarios import _close, _engine, local_batches, make_cfg


def probe_tokens(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch whose logits the tests compare: (micro_batch_size, seq_len) inputs."""
    g = torch.Generator().manual_seed(77)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.data.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _cfg(model, parallel, train, root: Path, init_from: Optional[str] = None) -> Config:
    root.mkdir(parents=True, exist_ok=True)  # on every rank: a shared directory, no race
    cfg = make_cfg(model, parallel, {**(train or {}), **({"init_from": init_from} if init_from else {})},
                   {"lr": 1e-3})
    cfg.checkpoint.dir = str(root / "ckpt")  # where a resume converts a universal checkpoint
    return cfg


def save_checkpoint(engine, cfg: Config, dims: ParallelDims, root: Path, step: int, consolidate: bool) -> str:
    """A complete training checkpoint (manifest with the layout, config.yaml) as the trainer
    writes it, with or without the consolidated model.safetensors."""
    cfg.checkpoint.consolidate = consolidate  # the engine reads it at save time

    def write(tmp: Path) -> None:
        engine.save(tmp)
        if dims.rank == 0:
            save_config(cfg, tmp / "config.yaml")

    manager = CheckpointManager(root, keep=5, rank=dims.rank, barrier=dist.barrier)
    return str(manager.save(step, write, meta={"layout": engine.layout()}))


def training_logits(engine, dims: ParallelDims, cfg: Config) -> Optional[torch.Tensor]:
    """The distributed model's full-vocabulary logits (b, T, V) of probe_tokens, on the last
    stage's data- and tensor-parallel rank 0 (None elsewhere). With pp > 1 the head's output is recorded while
    the ring evaluates the loss (a test-only hook on the last stage's module)."""
    x, y = probe_tokens(cfg)
    if dims.pp == 1:
        logits = engine.logits(x)
    else:
        model, captured = engine.module, []
        if dims.is_last_stage:
            head = model.head

            def recording_head(z: torch.Tensor) -> torch.Tensor:
                out = head(z)
                captured.append(out.detach().clone())  # before the vocab-parallel loss consumes it
                return out

            model.head = recording_head
        engine.eval_loss([{"inputs": x, "targets": y}])
        if not dims.is_last_stage:
            return None
        del model.head
        logits = gather_vocab(torch.cat(captured, dim=0), dims)
    return logits if dims.dp_rank == 0 and dims.tp_rank == 0 and dims.is_last_stage else None


def _store(obj, path: Path, dims: ParallelDims, only_rank: Optional[int] = 0) -> None:
    if obj is not None and (only_rank is None or dims.rank == only_rank):
        torch.save(obj, path)


# ------------------------------------------------------------------------------------------
# Scenarios
# ------------------------------------------------------------------------------------------

def train_and_save(root: str, model=None, parallel=None, train=None, steps: int = 2) -> dict:
    """Trains ``steps`` steps, records the training model's logits (root/logits.pt) and saves
    the same state twice: with the consolidated model.safetensors (root/consolidated/step_N)
    and without it (root/shards/step_N)."""
    root = Path(root)
    cfg = _cfg(model, parallel, train, root)
    dims, engine = _engine(cfg)
    for step in range(steps):
        engine.train_step(local_batches(cfg, step, dims))
    out = {"layout": engine.layout(),
           "consolidated": save_checkpoint(engine, cfg, dims, root / "consolidated", steps, True),
           "shards": save_checkpoint(engine, cfg, dims, root / "shards", steps, False)}
    _store(training_logits(engine, dims, cfg), root / "logits.pt", dims, only_rank=None)
    _close(dims, engine)
    return out


def init_from_export(root: str, export: str, model=None, parallel=None, train=None) -> dict:
    """A run started from an export by the production path (train/builders.build_engine:
    each rank reads its stage, the engine slices its TP shard); records its logits
    (root/logits.pt), exports its weights again from rank 0 (root/again.pt: the gathered state
    dict) and saves a shards-only checkpoint (root/shards/step_0)."""
    root = Path(root)
    cfg = _cfg(model, parallel, train, root, init_from=export)
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", cfg.train)
    engine = build_engine(cfg, dims)
    _store(training_logits(engine, dims, cfg), root / "logits.pt", dims, only_rank=None)
    full = engine.full_state_dict()  # collective; the single-device layout on rank 0
    _store(full, root / "again.pt", dims)
    out = {"shards": save_checkpoint(engine, cfg, dims, root / "shards", 0, False), "layout": engine.layout()}
    _close(dims, engine)
    return out


def resume_save(root: str, parallel=None, train=None, steps_before: int = 2, steps_after: int = 2) -> dict:
    """The uninterrupted run: ``steps_before`` steps, a (shards-only) checkpoint, then
    ``steps_after`` more; the gathered fp32 parameters go to root/uninterrupted.pt."""
    root = Path(root)
    cfg = _cfg(None, parallel, train, root)
    dims, engine = _engine(cfg)
    for step in range(steps_before):
        engine.train_step(local_batches(cfg, step, dims))
    path = save_checkpoint(engine, cfg, dims, root / "saved", steps_before, False)
    for step in range(steps_before, steps_before + steps_after):
        engine.train_step(local_batches(cfg, step, dims))
    _store(gather_full(engine.parameters_fp32(), dims), root / "uninterrupted.pt", dims)
    out = {"checkpoint": path, "layout": engine.layout()}
    _close(dims, engine)
    return out


def resume_load(root: str, checkpoint: str, parallel=None, train=None, steps_after: int = 2,
                weights_only_export: Optional[str] = None, tag: str = "resumed") -> dict:
    """Resumes ``checkpoint`` on this layout (engine.load), saves again at once (root/<tag>/,
    to compare the optimizer state with the original), trains ``steps_after`` steps on the
    same global batches as the uninterrupted run and stores the parameters (root/<tag>.pt).
    With ``weights_only_export`` the run starts from that export instead (fresh optimizer
    state, the schedule position set by hand): the control that shows what a lost optimizer
    state costs."""
    root = Path(root)
    cfg = _cfg(None, parallel, train, root, init_from=weights_only_export)
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", cfg.train)
    engine = build_engine(cfg, dims)
    saved_step = int(Path(checkpoint).name.split("_")[1])
    if weights_only_export:
        engine.load_state_dict({"steps_taken": saved_step})
    else:
        engine.load(Path(checkpoint))
    out = {"steps_taken": engine.state_dict()["steps_taken"]}
    if not weights_only_export:
        out["reloaded"] = save_checkpoint(engine, cfg, dims, root / tag, saved_step, False)
    start = engine.state_dict()["steps_taken"]
    for step in range(start, start + steps_after):
        engine.train_step(local_batches(cfg, step, dims))
    _store(gather_full(engine.parameters_fp32(), dims), root / f"{tag}.pt", dims)
    _close(dims, engine)
    return out


def resume_refused(root: str, checkpoint: str, parallel=None, train=None) -> dict:
    """Resuming on a layout the optimizer state cannot move to must fail, naming both layouts."""
    cfg = _cfg(None, parallel, train, Path(root))
    dims, engine = _engine(cfg)
    try:
        engine.load(Path(checkpoint))
        out = {"raised": False, "message": ""}
    except CheckpointError as exc:
        out = {"raised": True, "message": str(exc)}
    _close(dims, engine)
    return out
