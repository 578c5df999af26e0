"""Resuming on another layout (issue 43), run on every rank of one 4-rank launch by
tests/distributed/worker.py as ``reshard_scenarios.<name>``.

``matrix``: every layout trains from the same start on the same global batches, saving a
complete training checkpoint (manifest, config.yaml, the layout-free state) at step 2 and its
layout-free state at the end; then one engine per target layout resumes from each source's step
2 in turn, writing the state as loaded and after the last step. ``run`` and ``reshard_then_run``:
one run, saving complete checkpoints, from a start or from another layout's checkpoint (through
``rlt-mega reshard``). ``grpo``: an asynchronous GRPO run of the real trainer (checkpoints with
the queue, metrics.jsonl). The "one process" layout runs on rank 0 alone (the local engine)
while the other ranks wait. The test process compares the written states (fp32 masters and Adam
moments, full tensors) and logs. Nothing here asserts."""

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
ROWS = 4  # the global batch of every layout (dp x micro_batch_size) of SEQ tokens each
SEQ = 4  # the tensor-parallel all-reduces of the decoder steps are most of a step's time on gloo
LAYOUTS = {
    "tp2pp2z1": {"tp": 2, "pp": 2, "zero_stage": 1, "micro_batches": 2},
    "pp4z2": {"pp": 4, "zero_stage": 2, "micro_batches": 2},
    "tp4z3": {"tp": 4, "zero_stage": 3},
    "dp4z1": {"zero_stage": 1},
    "one": None,  # one process: the local engine on rank 0
    "tp2pp2z0": {"tp": 2, "pp": 2, "zero_stage": 0, "micro_batches": 2},  # bf16: DeepSpeed's unfused optimizer
}
DP = {"tp2pp2z1": 1, "pp4z2": 1, "tp4z3": 1, "dp4z1": 4, "one": 1, "tp2pp2z0": 1}
LORA = {"rank": 4, "alpha": 8.0}


def config(layout: str, dtype: str = "fp32", lora: bool = False):
    cfg = make_cfg({**MODEL, **({"lora": LORA} if lora else {})}, LAYOUTS[layout] or {},
                   {"micro_batch_size": ROWS // DP[layout], "grad_accum": 1, "dtype": dtype},
                   {"lr": 1e-2, "grad_clip": 0.5})
    cfg.data.seq_len = SEQ
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


def _write_state(engine, directory: Path, barrier) -> str:
    """The engine's layout-free state alone (parallel/reshard.py) into ``directory``: what the
    tests compare, without the engine's own files."""
    if hasattr(engine, "files"):  # the distributed engine (a collective)
        engine.state.save_layout_free(directory, engine.steps_taken)
    else:
        engine._save_layout_free(directory)
    barrier()
    return str(directory)


def matrix(root: str, dtype: str, layouts: list, pairs: list, steps: int = 4, at: int = 2) -> dict:
    """Every layout of ``layouts`` trains ``steps`` steps from the same start (saving a checkpoint
    at step ``at``: root/<layout>/step_..., and its layout-free state after the last step:
    root/<layout>/final); then for each target B of ``pairs`` (ordered (A, B)), one engine on B
    resumes from each of its sources' step ``at`` in turn, writes the state as loaded
    (root/<A>_to_<B>/reloaded) and after ``steps`` (root/<A>_to_<B>/final). Returns rank 0's
    seconds per phase."""
    import time

    root = Path(root)
    seconds = {}
    for layout in layouts:
        t0 = time.perf_counter()
        _on_layout(layout, dtype, lambda engine, cfg, dims, barrier: _uninterrupted(
            engine, cfg, dims, barrier, root / layout, steps, at))
        seconds[layout] = time.perf_counter() - t0
    for b in dict.fromkeys(b for _, b in pairs):
        sources = [a for a, bb in pairs if bb == b]
        t0 = time.perf_counter()
        _on_layout(b, dtype, lambda engine, cfg, dims, barrier: _resumes(
            engine, cfg, dims, barrier, root, sources, b, steps, at))
        seconds[f"to_{b}"] = time.perf_counter() - t0
    return seconds


def _on_layout(layout: str, dtype: str, body) -> None:
    """``body(engine, cfg, dims, barrier)`` on a fresh engine of ``layout`` (one process: on rank 0
    while the others wait)."""
    cfg = config(layout, dtype)
    if layout == "one":
        if dist.get_rank() == 0:
            dims = ParallelDims.single(cfg.model, "cpu")
            body(build_engine(cfg, dims), cfg, dims, lambda: None)
        dist.barrier()
        return
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", cfg.train)
    engine = build_engine(cfg, dims)
    try:
        body(engine, cfg, dims, dist.barrier)
    finally:
        engine.close()
        dims.destroy()


def _uninterrupted(engine, cfg, dims, barrier, root: Path, steps: int, at: int) -> None:
    for step in range(steps):
        engine.train_step(local_batches(cfg, step, dims))
        if step + 1 == at:
            _save(engine, cfg, dims.rank, root, at, barrier)
    _write_state(engine, root / "final", barrier)


def _resumes(engine, cfg, dims, barrier, root: Path, sources: list, b: str, steps: int, at: int) -> None:
    """One engine on layout ``b`` resumes from every source in turn: each load sets every
    parameter, moment, step and schedule position anew (what a fresh engine would hold)."""
    for a in sources:
        out = root / f"{a}_to_{b}"
        engine.load(_step(root / a, at))
        if hasattr(engine, "files"):
            (out / "read").mkdir(parents=True, exist_ok=True)
            (out / "read" / f"rank{dims.rank}").write_text(str(engine.files.bytes_read))
        _write_state(engine, out / "reloaded", barrier)
        for step in range(at, steps):
            engine.train_step(local_batches(cfg, step, dims))
        _write_state(engine, out / "final", barrier)


def _step(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


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


# ---------------------------------------------------------------------- GRPO
# Asynchronous GRPO layouts: (parallel.*, data-parallel replicas). Every layout samples the same
# global batch of 4 prompts x 2 completions a step (grpo.prompts_per_step = 4 / dp) in rollout
# batches of one group (train.grad_accum = prompts_per_step), so that a queue saved on one
# data-parallel size is dealt into the shares of any other as that one samples them.
GRPO_LAYOUTS = {"pp2dp2z1": ({"pp": 2, "dp": 2, "zero_stage": 1}, 2), "tp4z3": ({"tp": 4, "zero_stage": 3}, 1),
                "dp4z1": ({"dp": 4, "zero_stage": 1}, 4), "dp2": ({"dp": 2}, 2), "tp2": ({"tp": 2}, 1), "pp2": ({"pp": 2, "micro_batches": 2}, 1),
                "one": (None, 1)}
GRPO = {"max_staleness": 1, "is_correction": "token_tis"}  # a queue in every checkpoint
PROMPTS = 4  # the global batch's prompts


def grpo_config_of(root: Path, layout: str, train: dict, grpo: Optional[dict] = None):
    """Asynchronous GRPO (max_staleness 1: every checkpoint queues the next data step, sampled by
    an older policy) on ``layout`` (``GRPO_LAYOUTS``) with the same global batch on every layout."""
    import dataclasses

    from tests.distributed.async_scenarios import roles_config

    parallel, dp = GRPO_LAYOUTS[layout]
    grpo = {**GRPO, **(grpo or {}), "prompts_per_step": PROMPTS // dp}
    cfg = roles_config(grpo, {"steps": 2, "grad_accum": PROMPTS // dp, **train}, str(root), 0, parallel or {})
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_kv_heads=4),
                               checkpoint=dataclasses.replace(cfg.checkpoint, every=1, consolidate=False))


def grpo(root: str, layout: str, train: dict, grpo: Optional[dict] = None) -> dict:
    """A GRPO run on ``layout`` (train: its train.* settings: stop_after, resume; grpo: more grpo.*)
    writing its checkpoints and metrics under ``root`` (one process: on rank 0 while the others
    wait)."""
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.train.grpo import build_trainer, engine_config
    from tests.distributed.grpo_scenarios import odd, records

    cfg = grpo_config_of(Path(root), layout, train, grpo)
    if GRPO_LAYOUTS[layout][0] is None:
        from rlt_mega.parallel.dims import init_distributed

        init_distributed(None, "cpu")  # the launch's world (up already after another scenario)
        out = {}
        if dist.get_rank() == 0:
            out = build_trainer(cfg, ParallelDims.single(cfg.model, "cpu"), load_tokenizer("byte"), odd, records(24),
                                []).run()
        dist.barrier()
        return {"step": out.get("step")}
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", engine_config(cfg))
    try:
        out = build_trainer(cfg, dims, load_tokenizer("byte"), odd, records(24), []).run()
    finally:
        dims.destroy()
    return {"step": out["step"]}


def grpo_resharded(root: str, checkpoint: str, layout: str) -> dict:
    """Rank 0 reshards the GRPO ``checkpoint`` offline for ``layout`` (rlt-mega reshard: the
    state re-cut, the per-rank files with the queue carried) into root/resharded; then the run
    resumes from it on ``layout`` (grpo)."""
    from rlt_mega.checkpoint_tools.reshard_ckpt import reshard

    target = Path(root) / "resharded"
    if dist.get_rank() == 0:
        p, dp = GRPO_LAYOUTS[layout]
        reshard(checkpoint, target, p.get("tp", 1), p.get("pp", 1), dp, p.get("zero_stage", 0))
    dist.barrier()
    return grpo(root, layout, {"resume": str(target)})
