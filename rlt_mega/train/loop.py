"""The loop shared by pretraining and SFT: steps, logging, evaluation, checkpoints, resume,
non-finite steps. A trainer provides where micro-batches come from and how loss is counted;
this module owns the order of things.

Everything that must survive a restart is state_dict-able: the engine (model, optimizer,
schedule), the batch source (epoch, cursor), ``TrainState`` and every RNG. A run resumed
from step k continues bit for bit as if it had never stopped.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
from tqdm import tqdm

from rlt_mega.checkpoint import (CheckpointError, CheckpointManager, check_resume_config, load_torch,
                                 rng_state, set_rng_state)
from rlt_mega.config import Config, save_config
from rlt_mega.log import get_logger
from rlt_mega.metrics import Metrics, Timers
from rlt_mega.parallel.engine import CountFn, LossFn, StepStats, lm_count, lm_loss

log = get_logger(__name__)


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row); says where to resume."""


class BatchSource(Protocol):
    def next_micro_batches(self) -> list[dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (skipped ones included)
    tokens: int = 0  # input tokens consumed
    nonfinite_total: int = 0
    nonfinite_in_a_row: int = 0
    last_checkpoint: Optional[str] = None


class Trainer:
    def __init__(self, cfg: Config, engine, batches: BatchSource, eval_batches: Callable[[], list[dict]],
                 loss_fn: LossFn = lm_loss, count_fn: CountFn = lm_count, rank: int = 0,
                 barrier: Callable[[], None] = lambda: None, extra_state: Optional[Callable[[], dict]] = None
                 ) -> None:
        self.cfg, self.engine, self.batches, self.eval_batches = cfg, engine, batches, eval_batches
        self.loss_fn, self.count_fn, self.rank = loss_fn, count_fn, rank
        self.state = TrainState()
        self.ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep, rank=rank, barrier=barrier)
        self.metrics = Metrics.for_run(cfg, enabled=rank == 0)
        self.timers = Timers(torch.cuda.synchronize if torch.cuda.is_available() else None)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        return save_trainer_checkpoint(self.ckpt, self.engine, self.cfg, self.rank, self.state,
                                       self.batches.state_dict())

    def resume(self) -> None:
        def restore(saved: dict) -> None:
            self.state = TrainState(**saved["state"])
            self.batches.load_state_dict(saved["data"])

        path = resume_trainer_checkpoint(self.ckpt, self.engine, self.cfg, self.rank, restore)
        if path is not None:
            self.state.last_checkpoint = str(path)
            log.info("resumed from %s at step %d", path, self.state.step)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        self.resume()
        if self.rank == 0:
            save_config(self.cfg, _mkdir(Path(self.cfg.logging.dir)) / "config.yaml")
        bar = tqdm(total=self.cfg.train.steps, initial=self.state.step,
                   disable=not (self.cfg.logging.progress and self.rank == 0), desc="train", dynamic_ncols=True)
        try:  # a run stopped by an error still flushes its metrics (TensorBoard buffers them)
            return self._loop(bar)
        finally:
            bar.close()
            self.metrics.close()

    def _loop(self, bar: tqdm) -> dict:
        cfg = self.cfg.train
        window_tokens, window_start, last = 0, time.perf_counter(), {}
        end = cfg.steps if cfg.stop_after is None else min(cfg.steps, self.state.step + cfg.stop_after)
        while self.state.step < end:
            with self.timers("data"):
                micro_batches = self.batches.next_micro_batches()
            with self.timers("step"):
                stats = self.engine.train_step(micro_batches, self.loss_fn, self.count_fn)
            tokens = sum(int(mb["inputs"].numel()) for mb in micro_batches) * self.engine.data_parallel_size()
            self.state.step += 1
            self.state.tokens += tokens
            window_tokens += tokens
            too_many_nonfinite = self._account_nonfinite(stats)
            bar.update(1)
            step = self.state.step
            if step % cfg.log_every == 0 or step == cfg.steps or too_many_nonfinite:
                elapsed = time.perf_counter() - window_start
                last = {"train/loss": stats.loss, "train/grad_norm": stats.grad_norm, "train/lr": stats.lr,
                        "train/tokens_per_s": window_tokens / max(elapsed, 1e-9),
                        "train/tokens": self.state.tokens, "train/nonfinite_skipped": self.state.nonfinite_total,
                        **self.timers.pop()}
                self.metrics.log(step, last)
                bar.set_postfix(loss=f"{stats.loss:.4f}", tok_s=f"{last['train/tokens_per_s']:.0f}")
                window_tokens, window_start = 0, time.perf_counter()
            if too_many_nonfinite:
                raise TrainingError(
                    f"{self.state.nonfinite_in_a_row} non-finite steps in a row up to step {step} "
                    f"(train.max_nonfinite_in_a_row={cfg.max_nonfinite_in_a_row}); last good checkpoint: "
                    f"{self.state.last_checkpoint or 'none'}. Lower optim.lr or check the data, then resume with "
                    "train.resume=auto")
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                last["eval/loss"] = self.evaluate(step)
            if self.cfg.checkpoint.every and step % self.cfg.checkpoint.every == 0 and step < end:
                self.save()
        if self.state.step > 0 and (not self.state.last_checkpoint
                                    or not self.state.last_checkpoint.endswith(f"{self.state.step:08d}")):
            self.save()
        return {"step": self.state.step, **last}

    def evaluate(self, step: int) -> float:
        loss = self.engine.eval_loss(self.eval_batches(), self.loss_fn, self.count_fn)
        self.metrics.log(step, {"eval/loss": loss})
        log.info("step %d: eval loss %.4f", step, loss)
        return loss

    def _account_nonfinite(self, stats: StepStats) -> bool:
        """Counts a skipped step; True when there were more in a row than allowed."""
        if not stats.skipped:
            self.state.nonfinite_in_a_row = 0
            return False
        self.state.nonfinite_total += 1
        self.state.nonfinite_in_a_row += 1
        log.warning("step %d: non-finite loss %s or gradient norm %s: step skipped (%d in a row, %d in all)",
                    self.state.step, stats.loss, stats.grad_norm, self.state.nonfinite_in_a_row,
                    self.state.nonfinite_total)
        return self.state.nonfinite_in_a_row > self.cfg.train.max_nonfinite_in_a_row


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_trainer_checkpoint(ckpt: CheckpointManager, engine, cfg: Config, rank: int, state, data_state: dict,
                            **meta) -> Path:
    """One atomic checkpoint of a trainer: the engine's shards, rank 0's trainer state (a
    dataclass with ``step`` and ``last_checkpoint``) with its data order and the config, and every
    rank's RNG state (the data order is seeded, but a user hook may draw numbers)."""
    def write(tmp: Path) -> None:
        engine.save(tmp)
        if rank == 0:
            torch.save({"state": asdict(state), "data": data_state}, tmp / "trainer.pt")
            save_config(cfg, tmp / "config.yaml")
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")

    path = ckpt.save(state.step, write, meta={"layout": engine.layout(), **meta})
    state.last_checkpoint = str(path)
    log.info("saved checkpoint %s", path)
    return path


def resume_trainer_checkpoint(ckpt: CheckpointManager, engine, cfg: Config, rank: int,
                              restore: Callable[[dict], None]) -> Optional[Path]:
    """Loads the checkpoint train.resume names (None: there is none) into the engine, hands the
    trainer.pt contents to ``restore`` and sets this rank's RNG state; the restored state's
    last_checkpoint is the caller's to set (``restore`` replaces the state object)."""
    path = ckpt.resolve(cfg.train.resume)
    if path is None:
        if cfg.train.resume == "auto":
            log.info("train.resume=auto: no checkpoint in %s, starting fresh", cfg.checkpoint.dir)
        return None
    check_resume_config(path, cfg)
    engine.load(path)
    saved = load_torch(path / "trainer.pt")
    try:
        restore(saved)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: trainer.pt does not hold this trainer's state "
                              f"({type(exc).__name__}: {exc})") from None
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(load_torch(rng_file))
    return path
