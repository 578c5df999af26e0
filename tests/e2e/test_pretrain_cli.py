"""Pretraining end to end through the CLI: the loss falls; a stopped and resumed run ends with
the parameters of an uninterrupted one (torch.equal)."""

import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from rlt_mega.metrics import read_metrics

from helpers import TINY


def pretrain(tmp_path, name, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1", RLT_LOG_LEVEL="WARNING")
    cmd = [sys.executable, "-m", "rlt_mega", "pretrain", "--config", "configs/tiny_cpu.yaml", *TINY,
           f"checkpoint.dir={tmp_path / name / 'ckpt'}", f"logging.dir={tmp_path / name / 'tb'}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_loss_falls(tmp_path):
    pretrain(tmp_path, "run", "train.steps=40", "checkpoint.every=0")
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "run" / "tb") if "train/loss" in r]
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert (tmp_path / "run" / "tb").glob("events.out.tfevents.*")


def test_stop_and_resume_is_exact(tmp_path):
    pretrain(tmp_path, "full", "train.steps=10", "checkpoint.every=5")
    # the same run, stopped after step 7 (checkpoint at 5 and 7), killed state of step 6-7
    # discarded, resumed from step 5 to 10
    pretrain(tmp_path, "split", "train.steps=10", "checkpoint.every=5", "train.stop_after=7")
    split_ckpt = tmp_path / "split" / "ckpt"
    assert (split_ckpt / "latest").read_text() == "step_00000007"
    (split_ckpt / "latest").write_text("step_00000005")
    shutil.rmtree(split_ckpt / "step_00000007")
    pretrain(tmp_path, "split", "train.steps=10", "checkpoint.every=5", "train.resume=auto")
    full = load_file(tmp_path / "full" / "ckpt" / "step_00000010" / "model.safetensors")
    resumed = load_file(split_ckpt / "step_00000010" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for key in full:
        assert (full[key] == resumed[key]).all(), key


def test_bad_config_through_the_cli(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "rlt_mega", "pretrain", "--config", "configs/tiny_cpu.yaml",
                           "model.n_heads=3"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "does not divide model.d_model" in proc.stderr and "Traceback" not in proc.stderr
