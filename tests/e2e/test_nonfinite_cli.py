"""A diverging run stops through the CLI with one line that names the step and the last
checkpoint (tests/unit/test_nonfinite.py: the skipped steps themselves)."""

import os
import subprocess
import sys

from helpers import TINY


def test_a_diverging_run_stops_through_the_cli(tmp_path):
    """A learning rate of 1e30 makes every step after the first non-finite (no injection): the
    CLI stops with one line naming the step and the checkpoint, exit status 1."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "rlt_mega", "pretrain", "--config", "configs/tiny_cpu.yaml", *TINY,
         "optim.lr=1e30", "optim.min_lr=0", "optim.warmup_steps=0", "optim.schedule=constant",
         "train.steps=20", "checkpoint.every=1", "train.max_nonfinite_in_a_row=2",
         f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlt-mega pretrain: stopped: 3 non-finite steps in a row up to step 4")
    assert f"last good checkpoint: {tmp_path / 'ckpt' / 'step_00000003'}" in last and "Traceback" not in proc.stderr
    assert "step 2: non-finite loss nan" in proc.stderr
