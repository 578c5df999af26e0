"""kill -9 of a real ``rlt-mega pretrain`` process, (a) at a random step and (b) in the middle
of saves (paused between the phases of CheckpointManager.save by tests/crash_driver.py), then
``train.resume=auto``: the final parameters and optimizer state equal (torch.equal) those of an
uninterrupted run, damaged and partial checkpoints are skipped with a warning, and the last K
complete checkpoints are kept.

Nothing waits a fixed time: the tests poll the metrics log and the driver's marker file, with
generous timeouts, so a loaded machine makes them slower, not flaky."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlt_mega.checkpoint import load_torch

from helpers import TINY

STEPS, EVERY, KEEP = 16, 4, 2
RUN = [*TINY, f"train.steps={STEPS}", f"checkpoint.every={EVERY}", f"checkpoint.keep={KEEP}", "train.resume=auto"]
TIMEOUT = 600  # seconds; a run takes ~10 s on an idle 2-core machine
DRIVER = str(Path(__file__).resolve().parents[1] / "crash_driver.py")


def command(tmp_path, name, *extra, driver=False):
    entry = [DRIVER] if driver else ["-m", "rlt_mega"]
    return [sys.executable, *entry, "pretrain", "--config", "configs/tiny_cpu.yaml", *RUN,
            f"checkpoint.dir={tmp_path / name / 'ckpt'}", f"logging.dir={tmp_path / name / 'tb'}", *extra]


def env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()), **extra)


def run_to_end(tmp_path, name, log_name):
    with open(tmp_path / log_name, "w") as log:
        proc = subprocess.run(command(tmp_path, name), stdout=log, stderr=subprocess.STDOUT, env=env(),
                              timeout=TIMEOUT)
    output = (tmp_path / log_name).read_text()
    assert proc.returncode == 0, output[-3000:]
    return output


def start(tmp_path, name, log_name, **extra_env):
    log = open(tmp_path / log_name, "w")
    proc = subprocess.Popen(command(tmp_path, name, driver=True), stdout=log, stderr=subprocess.STDOUT,
                            env=env(**extra_env))
    log.close()
    return proc


def wait_for(condition, proc, log_path, what):
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (status {proc.returncode}) before {what}:\n"
                        f"{Path(log_path).read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def kill9(proc):
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def logged_step(log_dir):
    path = Path(log_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]  # a torn last line
    return int(lines[-1].split('"step": ')[1].split(",")[0]) if lines else 0


def assert_same_state(reference: Path, resumed: Path):
    """Weights and the optimizer/schedule state of the final checkpoints, bit for bit."""
    ref, got = load_file(reference / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    ref_opt = load_torch(reference / "engine.pt", deepspeed=True)
    got_opt = load_torch(resumed / "engine.pt", deepspeed=True)
    assert ref_opt["scheduler"] == got_opt["scheduler"]
    assert ref_opt["optimizer"]["state"].keys() == got_opt["optimizer"]["state"].keys()
    for idx, state in ref_opt["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, got_opt["optimizer"]["state"][idx][key]), (idx, key)


def assert_clean(ckpt: Path):
    """Only the last K complete checkpoints remain, no leftovers, the pointer on the last."""
    final = [f"step_{s:08d}" for s in range(STEPS - (KEEP - 1) * EVERY, STEPS + 1, EVERY)]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", *final]
    assert (ckpt / "latest").read_text() == final[-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    run_to_end(tmp, "full", "full.log")
    return tmp / "full" / "ckpt" / f"step_{STEPS:08d}"


def test_kill_at_a_random_step_then_resume(tmp_path, reference):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    kill_after = rng.randint(2 * EVERY + 1, 3 * EVERY + 1)  # two checkpoints exist by then
    proc = start(tmp_path, "run", "killed.log", RLT_CRASH_STEP_SLEEP="0.1")
    tb = tmp_path / "run" / "tb"
    wait_for(lambda: logged_step(tb) >= kill_after, proc, tmp_path / "killed.log", f"step {kill_after}")
    time.sleep(rng.uniform(0, 0.15))  # anywhere within the next step or save
    kill9(proc)
    ckpt = tmp_path / "run" / "ckpt"
    # damage the newest complete checkpoint as well (a bad disk): resuming must fall back
    newest = ckpt / (ckpt / "latest").read_text()
    model = newest / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])
    output = run_to_end(tmp_path, "run", "resumed.log")
    assert f"skipping damaged checkpoint: checkpoint {newest}" in output, (seed, output[-3000:])
    assert "resumed from" in output and "truncated?" in output
    assert_same_state(reference, ckpt / f"step_{STEPS:08d}")
    assert_clean(ckpt)


def test_kill_in_the_middle_of_saves_then_resume(tmp_path, reference):
    """Three crashes in one run, each resumed by the next: a file torn before the manifest
    (first save: nothing to resume, a fresh start), a sealed save not yet renamed, a renamed
    one whose ``latest`` pointer was not yet moved (resuming re-saves that step over it)."""
    ckpt = tmp_path / "run" / "ckpt"
    crashes = [("_seal", EVERY, True), ("_publish", 2 * EVERY, False), ("_point", 3 * EVERY, False)]
    for i, (phase, step, torn) in enumerate(crashes):
        marker = tmp_path / f"paused{i}"
        proc = start(tmp_path, "run", f"crash{i}.log", RLT_CRASH_PAUSE=f"{phase}:{step}",
                     RLT_CRASH_TORN="1" if torn else "0", RLT_CRASH_MARKER=str(marker))
        wait_for(marker.exists, proc, tmp_path / f"crash{i}.log", f"the pause before {phase} of step {step}")
        kill9(proc)
        tmp = ckpt / f".tmp-step_{step:08d}"
        if phase == "_point":
            assert (ckpt / f"step_{step:08d}").is_dir() and not tmp.exists()
            assert (ckpt / "latest").read_text() == f"step_{step - EVERY:08d}"
        else:
            assert tmp.is_dir() and not (ckpt / f"step_{step:08d}").exists()
            assert (tmp / "manifest.json").is_file() == (phase == "_publish")
    logs = [(tmp_path / f"crash{i}.log").read_text() for i in range(len(crashes))] + [
        run_to_end(tmp_path, "run", "final.log")]
    # each restart names the partial save it ignores, and where it resumes from
    assert "starting fresh" in logs[1] and f".tmp-step_{EVERY:08d}: a checkpoint save that was interrupted" in logs[1]
    assert f".tmp-step_{2 * EVERY:08d}: a checkpoint save that was interrupted" in logs[2]
    assert f"resumed from {ckpt / f'step_{EVERY:08d}'}" in logs[2]
    assert f"resumed from {ckpt / f'step_{2 * EVERY:08d}'}" in logs[3]
    assert_same_state(reference, ckpt / f"step_{STEPS:08d}")
    assert_clean(ckpt)
