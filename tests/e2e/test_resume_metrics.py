"""A run SIGKILLed after logging steps past its last checkpoint, then resumed: no step is logged
twice, in metrics.jsonl (the dead run's rows past the checkpoint are dropped) or in TensorBoard
(the resumed writer purges them: purge_step)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.event_pb2 import SessionLog
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from rlt_mega.metrics import read_metrics

from helpers import ROOT, TINY

DRIVER = str(ROOT / "tests" / "crash_driver.py")


def test_kill_then_resume_logs_every_step_once(tmp_path):
    run = ["pretrain", "--config", "configs/tiny_cpu.yaml", *TINY, "train.steps=6", "checkpoint.every=2",
           "train.resume=auto", f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RLT_CRASH_PAUSE="_seal:4",
               RLT_CRASH_MARKER=str(tmp_path / "paused"))
    # steps 1-4 logged, checkpoint 2 complete, the save of step 4 paused before its manifest
    proc = subprocess.Popen([sys.executable, DRIVER, *run], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (tmp_path / "paused").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the pause"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [r["step"] for r in read_metrics(tmp_path / "tb") if "train/loss" in r] == [1, 2, 3, 4]
    done = subprocess.run([sys.executable, "-m", "rlt_mega", *run], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)), timeout=300)
    assert done.returncode == 0 and "resumed from" in done.stderr and "step_00000002" in done.stderr, \
        done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "tb") if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    # the marker the readers purge by (their own out-of-order detection aside): the resumed
    # writer's first event is a session start at step 3 (purge_step)
    resumed_file = sorted((tmp_path / "tb").glob("events.out.tfevents.*"))[-1]
    starts = [e.step for e in EventFileLoader(str(resumed_file)).Load() if e.HasField("session_log")
              and e.session_log.status == SessionLog.START]
    assert starts == [3], starts
