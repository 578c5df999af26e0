"""Metrics: TensorBoard scalars plus a ``metrics.jsonl`` beside them (one JSON object per
logged step, for scripts and tests), and the same scalars to Weights & Biases when
logging.wandb.project is set, written by rank 0 only; and phase timers.

wandb is imported only when configured, so nobody needs it installed otherwise; its run lives
under logging.dir (``wandb/``), its config is the run's whole Config."""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from rlt_mega.config import Config, ConfigError, WandbConfig, to_dict
from rlt_mega.log import get_logger

log = get_logger(__name__)


def peak_memory_bytes(device: torch.device) -> float:
    """The process's peak memory so far: on CUDA the caching allocator's peak of allocated
    tensors on ``device`` (torch.cuda.max_memory_allocated); elsewhere the peak resident set size
    of the process (getrusage's ru_maxrss, KiB on Linux), which includes the Python and torch
    runtime (a few hundred MB)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes


class Metrics:
    """``resumed_at``: the step of the checkpoint a run resumed from. What a previous process
    logged past it (it died after the checkpoint) is dropped, so that no step is logged twice:
    metrics.jsonl's rows of later steps are removed, and TensorBoard purges its events from
    step resumed_at + 1 on (SummaryWriter's purge_step)."""

    def __init__(self, log_dir: str | Path, enabled: bool = True, wandb: Optional[WandbConfig] = None,
                 run_config: Optional[dict] = None, resumed_at: Optional[int] = None) -> None:
        self.log_dir, self.enabled = Path(log_dir), enabled
        self._writer = None
        self._jsonl = None
        self._wandb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: slow import

            self.log_dir.mkdir(parents=True, exist_ok=True)
            purge = None if resumed_at is None else resumed_at + 1
            if resumed_at is not None:
                truncate_metrics(self.log_dir / "metrics.jsonl", resumed_at)
            self._writer = SummaryWriter(str(self.log_dir), purge_step=purge)
            self._jsonl = open(self.log_dir / "metrics.jsonl", "a")
            if wandb is not None and wandb.enabled:
                self._wandb = _start_wandb(wandb, self.log_dir, run_config)

    @classmethod
    def for_run(cls, cfg: Config, enabled: bool, resumed_at: Optional[int] = None) -> "Metrics":
        """A trainer's metrics: logging.dir, logging.wandb, and the Config as the wandb run's config."""
        return cls(cfg.logging.dir, enabled, wandb=cfg.logging.wandb, run_config=to_dict(cfg), resumed_at=resumed_at)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        for key, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(key, value, step)
        clean = {k: (v if v is None or math.isfinite(v) else str(v)) for k, v in scalars.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:  # the same scalars (non-finite ones as floats: wandb keeps nan/inf)
            self._wandb.log({k: v for k, v in scalars.items() if v is not None}, step=step)

    def close(self) -> None:
        if self.enabled:
            self._writer.close()
            self._jsonl.close()
            if self._wandb is not None:
                self._wandb.finish()
                self._wandb = None


def _start_wandb(cfg: WandbConfig, log_dir: Path, run_config: Optional[dict]):
    try:
        import wandb
    except ImportError:  # the config checks this at load time; a changed environment still gets a clear message
        raise ConfigError(f"logging.wandb.project={cfg.project} but wandb is not installed: `pip install wandb`, "
                          "or set logging.wandb.project=null") from None
    run = wandb.init(project=cfg.project, name=cfg.name, entity=cfg.entity, mode=cfg.mode, dir=str(log_dir),
                     config=run_config)
    log.info("wandb run %s (%s) in %s", run.name, cfg.mode, log_dir / "wandb")
    return run


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drops the rows of ``path`` (metrics.jsonl) logged after ``last_step``, and a last line cut
    short by a kill; rewritten atomically (a kill now leaves the old file or the new one)."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            keep = int(row["step"]) <= last_step
        except (ValueError, KeyError, TypeError):  # a row cut short by the kill
            keep = False
        if keep:
            kept.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)
        log.info("%s: dropped %d rows logged after step %d by the run that resumed here", path, dropped, last_step)


def read_metrics(log_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl (for tests, sweeps and notebooks)."""
    path = Path(log_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Timers:
    """Wall time per named phase: ``with timers("generate"): ...``; ``pop()`` returns and resets."""

    def __init__(self, sync: Optional[callable] = None) -> None:
        self._total: dict[str, float] = defaultdict(float)
        self._sync = sync  # e.g. torch.cuda.synchronize, so GPU work is attributed to its phase

    @contextmanager
    def __call__(self, name: str):
        if self._sync:
            self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                self._sync()
            self._total[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self._total.items()}
        self._total.clear()
        return out
