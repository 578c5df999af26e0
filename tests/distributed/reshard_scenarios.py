"""Resuming on another layout (issue 43), run on every rank of one 4-rank launch by
tests/distributed/worker.py as ``reshard_scenarios.<name>``.

A run trains on a layout from the same start and the same global batches, saves complete
training checkpoints (manifest, config.yaml, the layout-free state) at the steps asked, and may
start from another layout's checkpoint. The "one process" layout runs on rank 0 alone (the local
engine) while the other ranks wait. The test process compares the checkpoints' layout-free
states (fp32 masters and Adam moments, full tensors). Nothing here asserts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch.distributed as dist

from rlt_mega.checkpoint import CheckpointManager
from rlt_mega.config import save_config
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.train.builders import build_engine
from tests.distributed.scenarios import local_batches, make_cfg

MODEL = {"n_layers": 4, "n_heads": 4, "n_kv_heads": 4}
ROWS = 8  # the global batch of every layout: dp x grad_accum x micro_batch_size
LAYOUTS = {
    "tp2pp2z1": {"tp": 2, "pp": 2, "zero_stage": 1, "micro_batches": 2},
    "pp4z2": {"pp": 4, "zero_stage": 2, "micro_batches": 2},
    "tp4z3": {"tp": 4, "zero_stage": 3},
    "dp4z1": {"zero_stage": 1},
    "one": None,  # one process: the local engine on rank 0
}
DP = {"tp2pp2z1": 1, "pp4z2": 1, "tp4z3": 1, "dp4z1": 4, "one": 1}
LORA = {"rank": 4, "alpha": 8.0}


def config(layout: str, dtype: str = "fp32", lora: bool = False):
    mbs = ROWS // DP[layout] // 2
    cfg = make_cfg({**MODEL, **({"lora": LORA} if lora else {})}, LAYOUTS[layout] or {},
                   {"micro_batch_size": mbs, "grad_accum": 2, "dtype": dtype}, {"lr": 1e-2, "grad_clip": 0.5})
    cfg.checkpoint.consolidate = False  # the layout-free state is what the tests read
    return cfg


def _save(engine, cfg, rank: int, root: Path, step: int, barrier) -> str:
    def write(tmp: Path) -> None:
        engine.save(tmp)
        if rank == 0:
            save_config(cfg, tmp / "config.yaml")

    return str(CheckpointManager(root, keep=10, rank=rank, barrier=barrier).save(step, write,
                                                                                 meta={"layout": engine.layout()}))


def run(root: str, layout: str, dtype: str = "fp32", lora: bool = False, steps: int = 4,
        save_at: tuple = (2, 4), resume_from: Optional[str] = None) -> dict:
    """Trains on ``layout`` up to ``steps`` (from ``resume_from``'s step when given), saving a
    checkpoint under ``root`` at each step of ``save_at`` reached."""
    cfg = config(layout, dtype, lora)
    root = Path(root)
    if layout == "one":
        out = {}
        if dist.get_rank() == 0:
            dims = ParallelDims.single(cfg.model, "cpu")
            engine = build_engine(cfg, dims)  # the local engine
            out = _train(engine, cfg, dims, root, steps, save_at, resume_from, lambda: None)
        dist.barrier()
        return out
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", cfg.train)
    engine = build_engine(cfg, dims)
    out = _train(engine, cfg, dims, root, steps, save_at, resume_from, dist.barrier)
    engine.close()
    dims.destroy()
    return out


def _train(engine, cfg, dims, root: Path, steps: int, save_at, resume_from, barrier) -> dict:
    start = 0
    if resume_from:
        engine.load(Path(resume_from))
        start = engine.state_dict()["steps_taken"] if "steps_taken" in engine.state_dict() else \
            engine.scheduler.last_epoch
    saved = {}
    if resume_from and start in save_at:  # the state as loaded, written back by this layout
        saved[start] = _save(engine, cfg, dims.rank, root / "reloaded", start, barrier)
    for step in range(start, steps):
        engine.train_step(local_batches(cfg, step, dims))
        if step + 1 in save_at:
            saved[step + 1] = _save(engine, cfg, dims.rank, root, step + 1, barrier)
    return {"start": start, "saved": saved, "layout": engine.layout()}


def reshard_then_run(root: str, checkpoint: str, layout: str, dtype: str = "fp32") -> dict:
    """Rank 0 reshards ``checkpoint`` offline for ``layout`` (rlt-mega reshard) into root/resharded;
    then every rank resumes from it (run)."""
    from rlt_mega.checkpoint_tools.reshard_ckpt import reshard

    target = Path(root) / "resharded"
    if dist.get_rank() == 0:
        p = LAYOUTS[layout] or {}
        reshard(checkpoint, target, p.get("tp", 1), p.get("pp", 1), DP[layout], p.get("zero_stage", 0))
    dist.barrier()
    return run(root, layout, dtype, resume_from=str(target))
