"""Indexed pretraining data on two data-parallel ranks under torchrun (DeepSpeed ZeRO-1): rank 1
is SIGKILLed in the middle of the run (tests/crash_driver.py), the job dies, and a new launch
with train.resume=auto ends with the weights and optimizer shards of an uninterrupted run, bit
for bit: the data state in the checkpoint is the sample index of both ranks' reads."""

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlt_mega.checkpoint import load_torch

from helpers import launcher_run, make_prefix
from test_elastic import TINY, assert_equal_tree

ROOT = Path(__file__).resolve().parents[2]
DRIVER = str(Path(__file__).resolve().parents[1] / "crash_driver.py")
STEPS, EVERY, KILL_AT = 7, 3, 5  # a checkpoint at 3; rank 1 dies fetching step 5's batches
TIMEOUT = 600


def torchrun(tmp_path, name, prefix, *extra, kill=None, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", RLT_LOG_LEVEL="WARNING")
    if kill:
        env["RLT_CRASH_KILL"] = kill
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", DRIVER, "pretrain",
           "--config", "configs/tiny_cpu.yaml", *TINY, f"data.train={prefix}", "parallel.zero_stage=1",
           f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "train.resume=auto",
           f"checkpoint.dir={tmp_path / name / 'ckpt'}", f"logging.dir={tmp_path / name / 'tb'}", *extra]
    code, _, err = launcher_run(cmd, env, TIMEOUT, check)
    return code, err


def test_two_ranks_killed_and_resumed_end_as_if_uninterrupted(tmp_path):
    prefix, _ = make_prefix(tmp_path, "corpus", num_docs=400)
    torchrun(tmp_path, "full", prefix)
    code, err = torchrun(tmp_path, "run", prefix, kill=f"1:{KILL_AT}", check=False)
    assert code != 0 and "exitcode: -9" in err, err[-3000:]
    ckpt = tmp_path / "run" / "ckpt"
    assert (ckpt / "latest").read_text() == f"step_{EVERY:08d}"
    _, err = torchrun(tmp_path, "run", prefix)
    full, resumed = tmp_path / "full" / "ckpt" / f"step_{STEPS:08d}", ckpt / f"step_{STEPS:08d}"
    ref, got = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    shards = sorted(p.relative_to(full) for p in full.rglob("*optim_states.pt"))
    assert shards and shards == sorted(p.relative_to(resumed) for p in resumed.rglob("*optim_states.pt"))
    for shard in shards:
        assert_equal_tree(load_torch(full / shard, deepspeed=True)["optimizer_state_dict"],
                          load_torch(resumed / shard, deepspeed=True)["optimizer_state_dict"], str(shard))
