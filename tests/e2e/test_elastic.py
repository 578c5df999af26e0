"""Elastic restart: ``torchrun --max-restarts=2`` on 2 data-parallel ranks (DeepSpeed ZeRO-1);
rank 1 is SIGKILLed in the middle of the run (tests/crash_driver.py); torchrun restarts the
group, the ranks resume from the last checkpoint (train.resume=auto) and finish with the
weights and optimizer shards of an uninterrupted run, bit for bit. And a launch whose restarts
could not work (torchrun's shared rendezvous store) is warned about at start-up."""

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlt_mega.checkpoint import load_torch

from helpers import launcher_run

ROOT = Path(__file__).resolve().parents[2]

TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_hidden=64", "model.n_layers=2",
        "model.memory_block=2", "data.seq_len=16", "data.generated.num_train=300", "data.generated.num_eval=10",
        "train.micro_batch_size=4", "train.eval_every=0", "train.log_every=1", "logging.progress=false",
        "optim.warmup_steps=2", "optim.lr=5e-3"]
STEPS, EVERY, KILL_AT = 8, 3, 5  # checkpoints at 3 and 6; rank 1 dies fetching step 5's batches
RUN = [*TINY, "parallel.zero_stage=1", f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep=2",
       "train.resume=auto"]
DRIVER = str(Path(__file__).resolve().parents[1] / "crash_driver.py")
TIMEOUT = 600  # seconds; ~20 s per attempt on an idle 2-core machine


def torchrun(tmp_path, name, *extra_args, kill=None, share_store=False):
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: otherwise torchrun's agent keeps one TCPStore for
    # every attempt and the restarted ranks read the dead ranks' gloo addresses from the first
    # one: "Gloo connectFullMesh failed ... Connection refused" (pytorch/pytorch#135712). Only
    # the c10d rendezvous (--standalone, --rdzv-backend c10d) honours it; static does not.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0" if share_store else "1")
    if kill:
        env["RLT_CRASH_KILL"] = kill
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *extra_args,
           DRIVER, "pretrain", "--config", "configs/tiny_cpu.yaml", *RUN, f"checkpoint.dir={tmp_path / name / 'ckpt'}",
           f"logging.dir={tmp_path / name / 'tb'}"]
    return launcher_run(cmd, env, TIMEOUT)[2]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final checkpoint of the same 2-rank run without a kill, and its log. It runs with
    torchrun's shared store (harmless without a restart), so that it also shows the warning."""
    tmp = tmp_path_factory.mktemp("full")
    log = torchrun(tmp, "full", "--max-restarts=1", share_store=True)
    return tmp / "full" / "ckpt" / f"step_{STEPS:08d}", log


def test_a_launch_whose_restarts_would_fail_is_warned_about(uninterrupted):
    assert "restarts will fail to connect. Export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in uninterrupted[1]


def test_one_rank_killed_torchrun_restarts_and_the_run_ends_as_if_uninterrupted(tmp_path, uninterrupted):
    log = torchrun(tmp_path, "elastic", "--max-restarts=2", kill=f"1:{KILL_AT}")
    assert "failed (exitcode: -9) local_rank: 1" in log, log[-4000:]  # the kill, seen by torchrun
    assert "restarts will fail" not in log
    assert f"resumed from {tmp_path / 'elastic' / 'ckpt' / f'step_{EVERY:08d}'} at step {EVERY}" in log, log[-4000:]
    full, elastic = uninterrupted[0], tmp_path / "elastic" / "ckpt" / f"step_{STEPS:08d}"
    ref, got = load_file(full / "model.safetensors"), load_file(elastic / "model.safetensors")
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    # every rank's DeepSpeed files: optimizer shards (fp32 master weights, Adam moments)
    shards = sorted(p.relative_to(full) for p in full.rglob("*optim_states.pt"))
    assert shards and shards == sorted(p.relative_to(elastic) for p in elastic.rglob("*optim_states.pt"))
    for shard in shards:
        assert_equal_tree(load_torch(full / shard, deepspeed=True)["optimizer_state_dict"],
                          load_torch(elastic / shard, deepspeed=True)["optimizer_state_dict"], str(shard))
    assert sorted(p.name for p in (tmp_path / "elastic" / "ckpt").iterdir()) == [
        "latest", f"step_{STEPS - 2:08d}", f"step_{STEPS:08d}"]


def test_a_two_rank_checkpoint_resumes_in_one_process_with_its_optimizer_state(tmp_path, uninterrupted, caplog):
    """Another layout (dp 2 -> 1, ZeRO-1 -> none, the local engine): train.resume resumes it from
    its layout-free state, says so, and continues from step 8 with the two ranks' Adam state."""
    from rlt_mega.cli import main
    from rlt_mega.config import load_config
    from rlt_mega.parallel.reshard import LayoutFreeState

    code = main(["pretrain", "--config", "configs/tiny_cpu.yaml", *RUN, "parallel.zero_stage=0",
                 f"train.steps={STEPS + 1}", f"train.resume={uninterrupted[0]}", f"checkpoint.dir={tmp_path / 'ckpt'}",
                 f"logging.dir={tmp_path / 'tb'}"])
    assert code == 0
    said = [r.getMessage() for r in caplog.records if "layout-free state" in r.getMessage()]
    assert said and "written with layout {tp=1, pp=1, dp=2, zero_stage=1}" in said[0], said
    assert "dp 2->1, zero_stage 1->0" in said[0]
    before = LayoutFreeState.open(uninterrupted[0])
    after = LayoutFreeState.open(tmp_path / "ckpt" / f"step_{STEPS + 1:08d}")
    assert (before.adam_step, after.adam_step, after.steps_taken) == (STEPS, STEPS + 1, STEPS + 1)
    beta2 = load_config(uninterrupted[0] / "config.yaml").optim.beta2
    for name in before.names():  # one more Adam step from the saved moments: v1 = b2 v0 + (1 - b2) g^2 >= b2 v0
        v0, v1 = (s.read(name, "exp_avg_sq", 1, 0) for s in (before, after))
        assert bool((v1 >= beta2 * v0 * (1 - 1e-6)).all()), name


def assert_equal_tree(a, b, where):
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal_tree(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_tree(x, y, f"{where}/{i}")
    elif hasattr(a, "__dict__"):  # e.g. DeepSpeed's loss scaler, which has no __eq__
        assert type(a) is type(b), where
        assert_equal_tree(vars(a), vars(b), where)
    else:
        assert a == b, where
