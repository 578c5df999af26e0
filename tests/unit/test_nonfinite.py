"""Non-finite steps: a NaN or inf loss or gradient norm skips the step without touching the
parameters, the AdamW state or the LR schedule; skipped steps are counted in metrics.jsonl and
TensorBoard; more than train.max_nonfinite_in_a_row in a row stop the run with a message that
names the step and the last checkpoint. Poison is injected per batch through the loss function
(test code only), a loss of the logits like every other."""

import copy
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlt_mega.config import load_config
from rlt_mega.loss import TokenCrossEntropy
from rlt_mega.metrics import read_metrics
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.train.builders import build_engine
from rlt_mega.train.loop import Trainer, TrainingError
from rlt_mega.train.supervised import SupervisedJob, phase_timers

from helpers import TINY

VOCAB, SEQ, BATCH = 260, 12, 3


class InfGrad(torch.autograd.Function):
    """Identity forward; an infinite gradient backward: a finite loss with an inf grad norm."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class PoisonedLoss(TokenCrossEntropy):
    """The token cross-entropy, poisoned where the batch says so."""

    def logits_loss(self, logits, batch, vocab):
        loss = super().logits_loss(logits, batch, vocab)
        poison = batch.get("poison")
        if poison == "nan_loss":
            return loss * float("nan")
        if poison == "inf_loss":
            return loss + float("inf")
        if poison == "inf_grad":
            return InfGrad.apply(loss)
        return loss


poisoned_loss = PoisonedLoss()


class ListBatches:
    """One micro-batch per step from a fixed list; the cursor is the resumable state."""

    def __init__(self, batches):
        self.batches, self.cursor = batches, 0

    def next_batches(self):
        mb = self.batches[self.cursor]
        self.cursor += 1
        return [mb]

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, state):
        self.cursor = state["cursor"]


def make_batches(n, poison=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        mb = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        if poison and i + 1 in poison:  # poison: {step (1-based): kind}
            mb["poison"] = poison[i + 1]
        out.append(mb)
    return out


def local_engine(cfg):
    return build_engine(cfg, ParallelDims.single(cfg.model, cfg.train.device))


def trainer(cfg, engine, batches):
    """The loop with pretraining's job, fed ``batches`` and ``poisoned_loss``."""
    dims, timers = engine.dims, phase_timers()
    job = SupervisedJob(cfg.train, dims, engine, ListBatches(batches), lambda: [], timers, loss=poisoned_loss)
    return Trainer(cfg, dims, engine, job, timers)


def config(tmp_path, *overrides):
    return load_config("configs/tiny_cpu.yaml", [*TINY, f"data.seq_len={SEQ}", "train.eval_every=0",
                                                 "optim.warmup_steps=3", f"checkpoint.dir={tmp_path / 'ckpt'}",
                                                 f"logging.dir={tmp_path / 'tb'}", *overrides])


def snapshot(engine):
    return ({k: v.clone() for k, v in engine.model.state_dict().items()},
            copy.deepcopy(engine.optimizer.state_dict()), copy.deepcopy(engine.scheduler.state_dict()))


def assert_same(a, b):
    params_a, opt_a, sched_a = a
    params_b, opt_b, sched_b = b
    for key in params_a:
        assert torch.equal(params_a[key], params_b[key]), key
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for idx in opt_a["state"]:
        for key, value in opt_a["state"][idx].items():
            assert torch.equal(value, opt_b["state"][idx][key]), (idx, key)
    assert sched_a == sched_b


@pytest.mark.parametrize("poison", ["nan_loss", "inf_loss", "inf_grad"])
def test_a_non_finite_step_changes_nothing(tmp_path, poison):
    cfg = config(tmp_path, "train.steps=10")
    engine = local_engine(cfg)
    for mb in make_batches(3):  # AdamW moments and the warm-up schedule are under way
        assert not engine.train_step([mb], poisoned_loss).skipped
    before = snapshot(engine)
    stats = engine.train_step(make_batches(1, {1: poison}, seed=1), poisoned_loss)
    assert stats.skipped
    if poison == "inf_grad":  # the loss is finite, the gradient norm is not
        assert math.isfinite(stats.loss) and not math.isfinite(stats.grad_norm)
    else:
        assert not math.isfinite(stats.loss)
    assert_same(before, snapshot(engine))
    assert all(p.grad is None for p in engine.model.parameters())  # nothing carried into the next step


def test_skipped_steps_are_as_if_the_batch_never_came(tmp_path):
    """A run with NaN batches at steps 2 and 4 ends with the state of a run that saw only the
    clean batches (the schedule counts optimizer updates, not batches), and counts them."""
    cfg = config(tmp_path, "train.steps=6", "train.log_every=1", "checkpoint.every=0")
    batches = make_batches(6, {2: "nan_loss", 4: "inf_grad"})
    engine = local_engine(cfg)
    result = trainer(cfg, engine, batches).run()
    reference = local_engine(cfg)
    for mb in [batches[0], batches[2], batches[4], batches[5]]:
        reference.train_step([mb], poisoned_loss)
    assert_same(snapshot(reference), snapshot(engine))

    assert result["train/nonfinite_skipped"] == 2
    logged = [r["train/nonfinite_skipped"] for r in read_metrics(tmp_path / "tb")]
    assert logged == [0, 1, 1, 2, 2, 2]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/nonfinite_skipped")] == [0, 1, 1, 2, 2, 2]


def test_too_many_in_a_row_stop_the_run_naming_step_and_checkpoint(tmp_path):
    cfg = config(tmp_path, "train.steps=8", "checkpoint.every=2", "train.max_nonfinite_in_a_row=2",
                 "train.log_every=100")
    batches = make_batches(8, {3: "nan_loss", 4: "inf_loss", 5: "inf_grad"})
    engine = local_engine(cfg)
    with pytest.raises(TrainingError) as err:
        trainer(cfg, engine, batches).run()
    msg = str(err.value)
    assert "3 non-finite steps in a row up to step 5" in msg
    assert f"last good checkpoint: {tmp_path / 'ckpt' / 'step_00000004'}" in msg
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_00000002", "step_00000004"]
    # the stopping step is logged, off the log_every grid, and TensorBoard is flushed
    assert [(r["step"], r["train/nonfinite_skipped"]) for r in read_metrics(tmp_path / "tb")] == [(5, 3)]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/nonfinite_skipped")] == [(5, 3)]
