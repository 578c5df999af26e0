"""The one trainer loop. Pretraining, SFT and GRPO differ only in their :class:`Job`: its
``step`` (fetch a batch and train; or GRPO's named phases), its evaluation and its state. The
loop owns the order of things: resume, steps, the log / eval / save intervals, stop_after,
the progress bar, the run's config.yaml, checkpoints, a failing step.

Everything that must survive a restart is state_dict-able: the engine (model, optimizer,
schedule), the loop (:class:`LoopState`: steps done, the last checkpoint's step), the job
(its counters and data order) and every rank's RNG. A run resumed from step k continues bit
for bit as if it had never stopped.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

import torch
from tqdm import tqdm

from rlt_mega.checkpoint import (CheckpointError, CheckpointManager, check_resume_config, load_torch,
                                 rank_files_layout, require_writable, rng_state, set_rng_state)
from rlt_mega.config import Config, save_config
from rlt_mega.log import get_logger
from rlt_mega.metrics import Metrics, Timers
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import Engine
from rlt_mega.parallel.reshard import same_layout

log = get_logger(__name__)


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row); says where to resume."""


class StepFailed(Exception):
    """Raised by a step that ran but after which the run cannot go on: the loop logs the step's
    ``scalars``, then stops with ``reason``, the last good checkpoint and ``hint``."""

    def __init__(self, reason: str, hint: str, scalars: dict[str, float]) -> None:
        super().__init__(reason)
        self.reason, self.hint, self.scalars = reason, hint, scalars


@dataclass
class Interval:
    """Due at every ``every``-th step (0: never) and, with ``at_end``, at the last step."""

    every: int
    at_end: bool = False

    def due(self, step: int, last_step: int) -> bool:
        return bool(self.every and step % self.every == 0) or (self.at_end and step == last_step)


@dataclass
class StopAfter:
    """train.stop_after: this process stops after that many steps (time-limited jobs); the
    learning-rate schedule still spans train.steps and train.resume=auto continues."""

    steps: Optional[int]

    def end(self, start: int, total: int) -> int:
        return total if self.steps is None else min(total, start + self.steps)


@dataclass
class LoopState:
    step: int = 0  # steps done (skipped non-finite ones included)
    last_checkpoint_step: Optional[int] = None  # the step of the last checkpoint saved or resumed

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.last_checkpoint_step = int(state["step"]), state["last_checkpoint_step"]


class Job(Protocol):
    """What the loop drives. ``step(done)`` runs the step after ``done`` steps and returns its
    scalars (it may raise :class:`StepFailed`); ``log_line(scalars, seconds)`` what a log line
    holds after the window since the previous one; ``evaluate(step)`` held-out scalars;
    ``result()`` the job's part of the run's result."""

    name: str  # the progress bar's label and the manifest's "job"
    eval_every: Interval  # relative to train.steps
    eval_at_start: bool  # also before the first step of a fresh run

    def step(self, done: int) -> dict[str, float]: ...
    def log_line(self, scalars: dict[str, float], seconds: float) -> dict[str, float]: ...
    def postfix(self, scalars: dict[str, float]) -> dict[str, str]: ...
    def evaluate(self, step: int) -> dict[str, float]: ...
    def result(self) -> dict: ...
    def state_dict(self) -> dict: ...  # called on every rank at a save; rank 0's is kept
    def load_state_dict(self, state: dict) -> None: ...
    def rank_state_dict(self) -> dict: ...  # this rank's own (GRPO: its staleness queue), in job_rank<r>.pt
    # the plain record types job_rank<r>.pt may hold beyond tensors and containers (the
    # weights-only loader's allow-list for that file: rlt_mega/checkpoint.py)
    rank_state_types: Sequence[type]
    # None: the checkpoint has no file for this rank; step: the checkpoint's step
    def load_rank_state_dict(self, state: Optional[dict], step: int) -> None: ...
    # On another layout: ``replicas`` every saved replica's source rank's state (``source_ranks``;
    # None where its file is missing), ``own`` the state of the saved rank at this rank's place
    # (``position_rank``; None where its file is missing), or where the model is cut otherwise a
    # ``SavedReplica`` that reads every place of one saved replica (to re-cut per-rank copies of
    # parameters: GRPO's kept policy versions)
    def load_moved_rank_state(self, replicas: list[Optional[dict]], own: "Optional[dict] | SavedReplica",
                              step: int) -> None: ...


@dataclass
class SavedReplica:
    """The per-rank files of a saved layout's first data-parallel replica: ``layout`` (the saved
    one) and ``read(pp_rank, tp_rank)``, that place's job state (memory-mapped; None where its file
    is missing)."""

    layout: dict
    read: Callable[[int, int], Optional[dict]]


def replica_rank(saved: dict, pp_rank: int, tp_rank: int) -> int:
    """The rank of layout ``saved`` at (``pp_rank``, ``tp_rank``) of data-parallel replica 0."""
    tp, dp = int(saved.get("tp", 1) or 1), int(saved.get("dp", 1) or 1)
    return tp_rank + tp * dp * pp_rank


def source_ranks(saved: dict) -> list[int]:
    """The rank of layout ``saved`` that holds each data-parallel replica's per-rank job state
    complete: its last pipeline stage's tensor-parallel rank 0 (GRPO's queued samples with their
    mu). Megatron's rank order (parallel/dims.py): rank = tp_rank + tp * (dp_rank + dp * pp_rank)."""
    tp, pp, dp = (int(saved.get(k, 1) or 1) for k in ("tp", "pp", "dp"))
    return [tp * (d + dp * (pp - 1)) for d in range(dp)]


def position_rank(saved: dict, current: dict, dims: ParallelDims) -> Optional[int]:
    """The rank of layout ``saved`` at this rank's place in its model replica (tensor- and
    pipeline-parallel rank; replica min(dp_rank, dp - 1), every replica holding the same), where
    ``saved`` cuts the model as ``current`` does (tp, pp, the stage split): its per-rank copies of
    parameters (GRPO's kept policy versions) are then this rank's. None elsewhere."""
    if any(int(saved.get(k, 1) or 1) != int(current.get(k, 1) or 1) for k in ("tp", "pp")):
        return None
    if None not in (saved.get("pp_split"), current.get("pp_split")) and \
            list(saved["pp_split"]) != list(current["pp_split"]):
        return None
    tp, dp = int(saved.get("tp", 1) or 1), int(saved.get("dp", 1) or 1)
    return dims.tp_rank + tp * (min(dims.dp_rank, dp - 1) + dp * dims.pp_rank)


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims, engine: Engine, job: Job, timers: Timers) -> None:
        self.cfg, self.dims, self.engine, self.job, self.timers = cfg, dims, engine, job, timers
        self.log_every = Interval(cfg.train.log_every, at_end=True)  # relative to train.steps
        self.save_every = Interval(cfg.checkpoint.every, at_end=True)  # relative to this process's last step
        self.stop = StopAfter(cfg.train.stop_after)
        self.state = LoopState()
        require_writable(cfg.checkpoint.dir, "checkpoint.dir")  # before any step is computed (every rank writes)
        if dims.rank == 0:  # the metrics' writer
            require_writable(cfg.logging.dir, "logging.dir")
        self.ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep, rank=dims.rank, barrier=dims.barrier)
        self.metrics: Optional[Metrics] = None  # opened once resume() knows the step (Metrics' resumed_at)
        self._last_path: Optional[Path] = None  # where the last checkpoint is (for messages)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        resumed = self.resume()
        self.metrics = Metrics.for_run(self.cfg, enabled=self.dims.rank == 0,
                                       resumed_at=self.state.step if resumed is not None else None)
        if self.dims.rank == 0:
            log_dir = Path(self.cfg.logging.dir)
            log_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, log_dir / "config.yaml")
        total = self.cfg.train.steps
        bar = tqdm(total=total, initial=self.state.step, desc=self.job.name, dynamic_ncols=True,
                   disable=not (self.cfg.logging.progress and self.dims.rank == 0))
        try:  # a run stopped by an error still flushes its metrics (TensorBoard buffers them)
            if self.state.step == 0 and self.job.eval_at_start:
                self._evaluate(0)  # the job keeps what it needs of it (GRPO: the accuracy before)
            return self._steps(total, bar)
        finally:
            bar.close()
            self.metrics.close()

    def _steps(self, total: int, bar: tqdm) -> dict:
        end = self.stop.end(self.state.step, total)
        line: dict[str, float] = {}
        last_eval: dict[str, float] = {}
        window_steps, window_start = 0, time.perf_counter()
        while self.state.step < end:
            failure: Optional[StepFailed] = None
            try:
                scalars = self.job.step(self.state.step)
            except StepFailed as exc:
                scalars, failure = exc.scalars, exc
            self.state.step += 1
            step = self.state.step
            window_steps += 1
            bar.update(1)
            if self.log_every.due(step, total) or failure is not None:
                times = {k: v / window_steps for k, v in self.timers.pop().items()}  # seconds per step
                line = {**self.job.log_line(scalars, time.perf_counter() - window_start), **times}
                self.metrics.log(step, line)
                bar.set_postfix(self.job.postfix(line))
                window_steps, window_start = 0, time.perf_counter()
            if failure is not None:
                where = self._last_path or "none"
                raise TrainingError(f"{failure.reason}; last good checkpoint: {where}. {failure.hint}")
            if self.job.eval_every.due(step, total):
                last_eval = self._evaluate(step)
            if self.save_every.due(step, end):
                self.save()
        return {"step": self.state.step, **line, **last_eval, **self.job.result()}

    def _evaluate(self, step: int) -> dict[str, float]:
        scalars = self.job.evaluate(step)
        if scalars:
            self.metrics.log(step, scalars)
        return scalars

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """One atomic checkpoint: the engine's files, rank 0's trainer.pt (the loop's and the
        job's state) and config.yaml, every rank's job_rank<r>.pt (the job's own per rank) and RNG state (the data order is seeded,
        but a user hook may draw numbers)."""
        step = self.state.step
        # On every rank, though only rank 0 writes it: a job's state may be a collective (a
        # streamed run gathers every data-parallel replica's stream position).
        job_state = self.job.state_dict()
        rank_state = self.job.rank_state_dict()

        def write(tmp: Path) -> None:
            self.engine.save(tmp)
            if self.dims.rank == 0:
                torch.save({"loop": self.state.state_dict(), "job": job_state}, tmp / "trainer.pt")
                save_config(self.cfg, tmp / "config.yaml")
            torch.save(rng_state(), tmp / f"rng_rank{self.dims.rank}.pt")
            torch.save(rank_state, tmp / f"job_rank{self.dims.rank}.pt")

        path = self.ckpt.save(step, write, meta={"layout": self.engine.layout(), "job": self.job.name})
        self.state.last_checkpoint_step, self._last_path = step, path
        log.info("saved checkpoint %s", path)
        return path

    def _rank_state(self, path: Path, rank: int, mmap: bool = False) -> Optional[dict]:
        file = path / f"job_rank{rank}.pt"
        return load_torch(file, mmap=mmap, allow=self.job.rank_state_types) if file.is_file() else None

    def resume(self) -> Optional[Path]:
        """Loads the checkpoint train.resume names (None: there is none) into the engine, the
        loop and the job, and sets this rank's RNG state."""
        cfg = self.cfg
        path = self.ckpt.resolve(cfg.train.resume)
        if path is None:
            if cfg.train.resume == "auto":
                log.info("train.resume=auto: no checkpoint in %s, starting fresh", cfg.checkpoint.dir)
            return None
        check_resume_config(path, cfg)
        self.engine.load(path)
        saved = load_torch(path / "trainer.pt")
        try:
            self.state.load_state_dict(saved["loop"])
            self.job.load_state_dict(saved["job"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path}: trainer.pt does not hold the state of this {self.job.name} "
                                  f"run ({type(exc).__name__}: {exc})") from None
        # The per-rank files (job_rank<r>.pt, rng_rank<r>.pt) belong to the ranks of the layout that
        # wrote them: the manifest's layout, or the one a reshard carried them from.
        saved_layout = rank_files_layout(path)
        moved = saved_layout is not None and not same_layout(saved_layout, self.engine.layout())
        if moved:  # every saved replica's job state (GRPO: each replica's queue, re-split) and this place's
            own = position_rank(saved_layout, self.engine.layout(), self.dims)
            place = SavedReplica(saved_layout, lambda p, t: self._rank_state(
                path, replica_rank(saved_layout, p, t), mmap=True)) if own is None else self._rank_state(path, own)
            self.job.load_moved_rank_state([self._rank_state(path, r) for r in source_ranks(saved_layout)], place,
                                           self.state.step)
        else:
            self.job.load_rank_state_dict(self._rank_state(path, self.dims.rank), self.state.step)
        rng_file = path / f"rng_rank{self.dims.rank}.pt"
        if moved:
            log.info("RNG streams not restored: they belong to the ranks of layout %s (the data order is seeded "
                     "and its position is in trainer.pt; sampling draws from per-request seeds); the job's per-rank "
                     "state moved from every saved replica's last stage", saved_layout)
        elif rng_file.is_file():
            set_rng_state(load_torch(rng_file))
        self.state.last_checkpoint_step, self._last_path = self.state.step, path
        log.info("resumed from %s at step %d", path, self.state.step)
        return path
