"""A killed `rlt-mega preprocess` (SIGKILL of the job and its workers, mid-way) leaves no
dataset that looks complete: the previous dataset at that prefix is untouched, the partial
files are named as such and are removed by the next run, which completes."""

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlt_mega.data.indexed import IndexedTokens
from rlt_mega.data.preprocess import preprocess

from helpers import write_corpus

DRIVER = str(Path(__file__).resolve().parents[1] / "crash_driver.py")
TIMEOUT = 300


def test_a_killed_preprocess_leaves_the_last_good_dataset(tmp_path):
    old, new = write_corpus(tmp_path / "old.jsonl", 50), write_corpus(tmp_path / "new.jsonl", 3000, seed=5)
    prefix = str(tmp_path / "data" / "corpus")
    preprocess(str(old), "byte", prefix, progress=False)
    before = {s: open(prefix + s, "rb").read() for s in (".bin", ".idx", ".json")}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()), RLT_CRASH_CHUNK_SLEEP="0.05")
    cmd = [sys.executable, DRIVER, "preprocess", "--data", str(new), "--out", prefix, "--workers", "2", "--chunk", "50",
           "--overwrite", "--no-progress"]
    with open(tmp_path / "killed.log", "w") as log:  # its own session: the kill takes the workers too
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + TIMEOUT
    while not any(os.path.getsize(p) > 0 for p in glob.glob(prefix + ".tmp*.bin")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"preprocess ended or hung before writing:\n{(tmp_path / 'killed.log').read_text()[-3000:]}")
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    parts = glob.glob(prefix + ".tmp*")
    assert parts and all(Path(p).name.startswith("corpus.tmp") for p in parts)
    assert {s: open(prefix + s, "rb").read() for s in (".bin", ".idx", ".json")} == before
    assert IndexedTokens(prefix).num_docs == 50  # still the old, complete dataset
    result = preprocess(str(new), "byte", prefix, workers=2, overwrite=True, progress=False)
    assert not glob.glob(prefix + ".tmp*")  # the dead run's parts are gone
    assert IndexedTokens(prefix).num_docs == result.documents == 3000
