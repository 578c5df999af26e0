"""The job of pretraining and SFT: each step fetches ``train.grad_accum`` batches and takes one
optimizer step on the language-model loss (the dense schedule); evaluation is the held-out
loss (and, with eval.lengths, the accuracy at each length: data/state_tasks.py); a non-finite
loss or gradient skips the step, and more than ``train.max_nonfinite_in_a_row`` in a row stop
the run. The two differ only in their data (train/pretrain.py, train/sft.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Optional, Protocol

import torch

from rlt_mega.config import Config, TrainConfig
from rlt_mega.data.datasets import DataStats
from rlt_mega.data.state_tasks import LengthEval, length_eval
from rlt_mega.data.tokenizer import Tokenizer, load_tokenizer
from rlt_mega.log import get_logger
from rlt_mega.loss import LM_LOSS, LogitsLoss
from rlt_mega.metrics import Timers, peak_memory_bytes
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import Engine, StepStats
from rlt_mega.parallel.launch import launch
from rlt_mega.train.builders import build_engine, check_vocab
from rlt_mega.train.loop import Interval, SavedReplica, StepFailed, Trainer

log = get_logger(__name__)


def phase_timers() -> Timers:
    """Phase timers that attribute queued GPU work to its phase."""
    return Timers(torch.cuda.synchronize if torch.cuda.is_available() else None)


class BatchSource(Protocol):
    def next_batches(self) -> list[dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


# (cfg, this rank's layout, tokenizer, data stats) -> (the rank's batch source, the held-out batches)
DataFn = Callable[[Config, ParallelDims, Tokenizer, DataStats], tuple[BatchSource, Callable[[], list[dict]]]]


@dataclass
class SupervisedState:
    tokens: int = 0  # input tokens consumed (every data-parallel rank)
    nonfinite_total: int = 0
    nonfinite_in_a_row: int = 0


class SupervisedJob:
    """``batches``: this data-parallel rank's batch source (every rank of a model replica reads
    the same); ``eval_batches()``: the held-out batches (every data-parallel rank evaluates the
    same ones; the engine averages over all)."""

    eval_at_start = False

    def __init__(self, train: TrainConfig, dims: ParallelDims, engine: Engine, batches: BatchSource,
                 eval_batches: Callable[[], list[dict]], timers: Timers, loss: LogitsLoss = LM_LOSS,
                 name: str = "train", lengths: Optional[LengthEval] = None) -> None:
        self.train, self.dims, self.engine, self.batches, self.eval_batches = train, dims, engine, batches, eval_batches
        self.timers, self.loss, self.name, self.lengths = timers, loss, name, lengths
        self.eval_every = Interval(train.eval_every, at_end=train.eval_every > 0)
        self.state = SupervisedState()
        self._window_tokens = 0

    def step(self, done: int) -> dict[str, float]:
        with self.timers("data"):
            batches = self.batches.next_batches()
        with self.timers("step"):
            stats = self.engine.train_step(batches, self.loss)
        tokens = sum(int(b["inputs"].numel()) for b in batches) * self.dims.dp
        self.state.tokens += tokens
        self._window_tokens += tokens
        scalars = {"train/loss": stats.loss, "train/grad_norm": stats.grad_norm, "train/lr": stats.lr,
                   "train/tokens": self.state.tokens, **stats.precision}
        if self._count_nonfinite(stats, done + 1):
            limit = self.train.max_nonfinite_in_a_row
            raise StepFailed(f"{self.state.nonfinite_in_a_row} non-finite steps in a row up to step {done + 1} "
                             f"(train.max_nonfinite_in_a_row={limit})",
                             "Lower optim.lr or check the data, then resume with train.resume=auto",
                             {**scalars, "train/nonfinite_skipped": self.state.nonfinite_total})
        return {**scalars, "train/nonfinite_skipped": self.state.nonfinite_total}

    def _count_nonfinite(self, stats: StepStats, step: int) -> bool:
        """Counts a skipped step; True when there were more in a row than allowed."""
        if not stats.skipped:
            self.state.nonfinite_in_a_row = 0
            return False
        self.state.nonfinite_total += 1
        self.state.nonfinite_in_a_row += 1
        log.warning("step %d: non-finite loss %s or gradient norm %s: step skipped (%d in a row, %d in all)",
                    step, stats.loss, stats.grad_norm, self.state.nonfinite_in_a_row, self.state.nonfinite_total)
        return self.state.nonfinite_in_a_row > self.train.max_nonfinite_in_a_row

    def log_line(self, scalars: dict[str, float], seconds: float) -> dict[str, float]:
        line = {**scalars, "train/tokens_per_s": self._window_tokens / max(seconds, 1e-9),
                "train/peak_memory_bytes": peak_memory_bytes(self.dims.device)}
        self._window_tokens = 0
        return line

    def postfix(self, scalars: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{scalars['train/loss']:.4f}", "tok_s": f"{scalars['train/tokens_per_s']:.0f}"}

    def evaluate(self, step: int) -> dict[str, float]:
        loss = self.engine.eval_loss(self.eval_batches(), self.loss)
        log.info("step %d: eval loss %.4f", step, loss)
        if self.lengths is None:
            return {"eval/loss": loss}
        accuracy = self.lengths(self.engine.eval_loss)
        log.info("step %d: %s", step, ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in accuracy.items()))
        return {"eval/loss": loss, **accuracy}

    def result(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"state": asdict(self.state), "data": self.batches.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.state = SupervisedState(**state["state"])
        self.batches.load_state_dict(state["data"])

    rank_state_types = ()

    def rank_state_dict(self) -> dict:
        return {}  # every rank's part of the data position is in state_dict

    def load_rank_state_dict(self, state: Optional[dict], step: int) -> None:
        pass

    def load_moved_rank_state(self, replicas: list[Optional[dict]], own: Optional[dict] | SavedReplica,
                              step: int) -> None:
        pass


def run(cfg: Config, data: DataFn) -> dict:
    """Pretraining or SFT on the layout of this launch: ``data`` builds this data-parallel rank's
    batch source and the held-out batches; the engine, the job and the loop are the same."""
    with launch(cfg) as dims:
        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
        check_vocab(cfg, tokenizer)
        stats = DataStats()
        batches, eval_batches = data(cfg, dims, tokenizer, stats)
        engine = build_engine(cfg, dims)
        log.info("model: %s, %.2fM parameters on this rank, C=%d, L=%d, d=%d", cfg.model.arch,
                 sum(p.numel() for p in engine.module.parameters()) / 1e6, cfg.model.memory_block,
                 cfg.model.n_layers, cfg.model.d_model)
        timers = phase_timers()
        job = SupervisedJob(cfg.train, dims, engine, batches, eval_batches, timers, lengths=length_eval(cfg))
        result = Trainer(cfg, dims, engine, job, timers).run()
        if stats.total:
            log.warning("data: %s", stats.summary())
        result["data/skipped"] = stats.total
        return result
