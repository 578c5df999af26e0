"""The one trainer loop (rlt_mega/train/loop.py) driving a fake ``step()``: the log, eval and save
intervals, stop_after, a resumed loop that continues where it stopped (its state_dict, the job's
and the engine's), a failing step that is logged before the run stops, and the intervals and the
single-process layout on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlt_mega.checkpoint import load_torch
from rlt_mega.config import load_config
from rlt_mega.loss import LM_LOSS
from rlt_mega.metrics import Timers, read_metrics
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import Engine, EngineConfig, LocalEngine
from rlt_mega.train.loop import Interval, LoopState, StepFailed, StopAfter, Trainer, TrainingError


class FakeEngine:
    """An Engine whose only state is the number of optimizer steps it took (saved in its files)."""

    def __init__(self, dims: ParallelDims) -> None:
        self.dims, self.steps_taken, self.module = dims, 0, torch.nn.Linear(1, 1)

    def train_step(self, batches, loss=LM_LOSS):
        self.steps_taken += 1

    def eval_loss(self, batches, loss=LM_LOSS):
        return 0.0

    def sampling_module(self):
        return self.module

    def state_dict(self):
        return {"steps_taken": self.steps_taken}

    def load_state_dict(self, state):
        self.steps_taken = state["steps_taken"]

    def save(self, directory: Path):
        (directory / "engine.json").write_text(json.dumps(self.state_dict()))

    def load(self, directory: Path):
        self.load_state_dict(json.loads((directory / "engine.json").read_text()))

    def layout(self):
        return {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}


class FakeJob:
    """Counts its steps (its state) and records what the loop asked of it."""

    name = "fake"
    rank_state_types = ()
    eval_at_start = False

    def __init__(self, engine: FakeEngine, eval_every: int, fail_at: int | None = None) -> None:
        self.engine, self.eval_every, self.fail_at = engine, Interval(eval_every, at_end=True), fail_at
        self.count, self.calls, self.evaluated = 0, [], []

    def step(self, done: int) -> dict:
        self.calls.append(done)
        self.engine.train_step([])
        self.count += 1
        scalars = {"fake/step": float(done + 1), "fake/count": float(self.count)}
        if self.fail_at == done + 1:
            raise StepFailed(f"step {done + 1} failed", "Try again", scalars)
        return scalars

    def log_line(self, scalars, seconds):
        return {**scalars, "fake/seconds": seconds}

    def postfix(self, scalars):
        return {"count": str(scalars["fake/count"])}

    def evaluate(self, step):
        self.evaluated.append(step)
        return {"fake/eval": float(step)}

    def result(self):
        return {"fake/result": self.count}

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]

    def rank_state_dict(self):
        return {}

    def load_rank_state_dict(self, state, step):
        pass


def make(tmp_path, *overrides, fail_at=None):
    cfg = load_config(None, ["train.steps=10", "train.log_every=3", "train.eval_every=0", "checkpoint.every=4",
                             "logging.progress=false", f"checkpoint.dir={tmp_path / 'ckpt'}",
                             f"logging.dir={tmp_path / 'tb'}", *overrides])
    dims = ParallelDims.single(cfg.model, "cpu")
    engine = FakeEngine(dims)
    job = FakeJob(engine, eval_every=4, fail_at=fail_at)
    timers = Timers()
    return Trainer(cfg, dims, engine, job, timers), job, engine


def test_intervals_and_stop_after_then_a_resume_continues_the_loop_state(tmp_path):
    trainer, job, engine = make(tmp_path, "train.stop_after=6")
    result = trainer.run()
    assert job.calls == list(range(6)) and result["step"] == 6
    assert [r["step"] for r in read_metrics(tmp_path / "tb") if "fake/step" in r] == [3, 6]  # log every 3
    assert job.evaluated == [4]  # eval every 4 (and at step 10, not reached)
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    assert ckpts == ["step_00000004", "step_00000006"]  # every 4, and where this process stops
    saved = load_torch(tmp_path / "ckpt" / "step_00000006" / "trainer.pt", deepspeed=True)
    assert saved["job"] == {"count": 6} and saved["loop"]["step"] == 6
    assert trainer.state.state_dict() == {"step": 6, "last_checkpoint_step": 6}
    assert result["fake/result"] == 6 and result["fake/count"] == 6.0 and result["fake/eval"] == 4.0

    again, job2, engine2 = make(tmp_path, "train.resume=auto")
    result = again.run()
    assert again.state.state_dict() == {"step": 10, "last_checkpoint_step": 10}
    assert job2.calls == [6, 7, 8, 9] and job2.count == 10 and engine2.steps_taken == 10  # all three resumed
    assert job2.evaluated == [8, 10]  # every 4 and at the last step
    logged = [r["step"] for r in read_metrics(tmp_path / "tb") if "fake/step" in r]
    assert logged == [3, 6, 9, 10]  # every 3 and at the last step, across both processes
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    assert ckpts[-2:] == ["step_00000008", "step_00000010"] and result["step"] == 10

    done, job3, _ = make(tmp_path, "train.resume=auto")
    assert done.run()["step"] == 10 and job3.calls == []  # nothing left: no step, no second save of 10


def test_a_failing_step_is_logged_then_stops_the_run_naming_the_last_checkpoint(tmp_path):
    trainer, job, _ = make(tmp_path, "train.log_every=100", fail_at=6)
    with pytest.raises(TrainingError) as err:
        trainer.run()
    assert str(err.value) == f"step 6 failed; last good checkpoint: {tmp_path / 'ckpt' / 'step_00000004'}. Try again"
    assert [r["step"] for r in read_metrics(tmp_path / "tb") if "fake/step" in r] == [6]  # off the log grid
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000004"]


def test_the_interval_and_stop_objects():
    every = Interval(4, at_end=True)
    assert [s for s in range(1, 11) if every.due(s, 10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if Interval(0, at_end=True).due(s, 10)] == [10]
    assert not any(Interval(0).due(s, 10) for s in range(1, 11))
    assert StopAfter(None).end(3, 10) == 10 and StopAfter(4).end(3, 10) == 7 and StopAfter(20).end(3, 10) == 10
    state = LoopState(step=5, last_checkpoint_step=4)
    other = LoopState()
    other.load_state_dict(state.state_dict())
    assert other == state


def test_the_single_process_layout_has_no_process_group_and_identity_collectives():
    import torch.distributed as dist

    cfg = load_config(None, ["train.device=cpu"])
    dims = ParallelDims.single(cfg.model, "cpu")
    assert not dims.distributed and dims.world_size == dims.tp == dims.pp == dims.dp == 1
    assert dims.is_first_stage and dims.is_last_stage and dims.is_replica_source and dims.is_loss_rank
    assert dims.layers == range(cfg.model.n_layers)
    t = torch.tensor([1.0, 2.0])
    assert dims.all_reduce(t, op="max", axis="dp") is t and t.tolist() == [1.0, 2.0]
    assert dims.share_in_replica({"a": 1}) == {"a": 1} and dims.sum_over_dp([1.5, 2.0]) == [1.5, 2.0]
    assert dims.reduce({"x": 2.0}, {"y": 1.0}, {"z": -1.0}) == {"x": 2.0, "y": 1.0, "z": -1.0}
    dims.barrier()
    dims.destroy()
    assert not dist.is_initialized()


def test_both_engines_implement_the_engine_protocol():
    from rlt_mega.model.rlt import build_model
    from rlt_mega.parallel.distributed import DistributedEngine

    cfg = load_config(None, ["model.d_model=32", "model.n_heads=2", "model.n_layers=1"])
    dims = ParallelDims.single(cfg.model, "cpu")
    local = LocalEngine(build_model(cfg.model, seed=0), dims, cfg.optim, EngineConfig.from_train(cfg.train))
    assert isinstance(local, Engine) and isinstance(FakeEngine(dims), Engine)
    members = [n for n in dir(Engine) if not n.startswith("_")]
    assert {"train_step", "eval_loss", "sampling_module", "save", "load", "layout", "module"} <= set(members)
    assert all(hasattr(DistributedEngine, n) for n in members if n != "dims")
