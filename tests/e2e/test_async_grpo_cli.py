"""`rlt-mega grpo` with a sampler role (grpo.sampler_replicas=1, two processes), max_staleness 2
with partial rollouts, a checkpoint every 2 steps: under the deepspeed launcher rank 0 logs every
step with the async/* metrics; then, under torchrun, either rank (the learner, or the sampler)
is SIGKILLed in the middle of the run (tests/crash_driver.py), torchrun stops the job, and a new
launch with train.resume=auto ends with the parameters, optimizer state and logged losses of the
uninterrupted run, bit for bit: the checkpoint holds the learner's queue of sampled steps
complete, and the learner restarts the sampler where the checkpoint stands."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import launched, write_prompts
from rlt_mega.checkpoint import load_torch
from rlt_mega.metrics import read_metrics
from test_elastic import assert_equal_tree

DRIVER = str(Path(__file__).resolve().parents[1] / "crash_driver.py")
STEPS, EVERY, TIMEOUT = 6, 2, 600


def grpo(tmp_path, name, kill=None, launcher="torchrun"):
    """The run in tmp_path/name under ``launcher``; ``kill``: "<rank>:<n>", that rank dies at
    its n-th step."""
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, 40)
    args = ["grpo", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_hidden=64", "model.memory_block=2", "model.max_seq_len=48", f"data.train={prompts}",
            "data.seq_len=32", "train.log_every=1", "optim.warmup_steps=0", "logging.progress=false",
            "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.eval_size=2", "grpo.eval_every=0",
            "grpo.reward=tests.distributed.grpo_scenarios:odd", "sampling.max_new_tokens=6",
            f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "train.resume=auto", "grpo.sampler_replicas=1",
            "grpo.max_staleness=2", "grpo.partial_rollouts=3", "grpo.is_correction=token_tis",
            f"checkpoint.dir={tmp_path / name / 'ckpt'}", f"logging.dir={tmp_path / name / 'tb'}"]
    proc = launched(2, args, launcher, check=kill is None, timeout=TIMEOUT, script=DRIVER,
                    env={"RLT_CRASH_GRPO_KILL": kill} if kill else None)
    return proc.returncode, proc.stderr


def steps(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "tb") if "train/loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    grpo(tmp, "full", launcher="deepspeed")
    return tmp / "full"


def test_grpo_with_a_sampler_role_logs_the_staleness(reference):
    logged = steps(reference)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    lags = [r["async/staleness_max"] for r in logged]  # step k learns data step k, started by k - 3 (partial)
    assert lags[:3] == [0.0, 1.0, 2.0] and all(2.0 <= lag <= 3.0 for lag in lags[3:]), lags
    for r in logged:
        assert 0.0 <= r["async/learner_idle_fraction"] <= 1.0 and r["async/weight_sync_s"] >= 0.0
        assert 0.0 <= r["async/sampler_idle_fraction"] <= 1.0


@pytest.mark.parametrize("kill", ["0:4", "1:8"], ids=["learner", "sampler"])
def test_a_rank_killed_then_resumed_ends_as_if_uninterrupted(tmp_path, reference, kill):
    """learner: dies beginning step 4 (the checkpoint of step 2 is the last); sampler: beginning
    data step 7, its last (data step 6 started under version 3: the learner is in step 4 or
    later, so the checkpoint of step 2, or of step 4, is the last)."""
    code, err = grpo(tmp_path, "run", kill=kill)
    assert code != 0 and "exitcode: -9" in err, err[-3000:]
    ckpt = tmp_path / "run" / "ckpt"
    assert (ckpt / "latest").read_text() in (f"step_{EVERY:08d}", f"step_{2 * EVERY:08d}")
    grpo(tmp_path, "run")
    final = f"step_{STEPS:08d}"
    ref = load_file(reference / "ckpt" / final / "model.safetensors")
    got = load_file(ckpt / final / "model.safetensors")
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert_equal_tree(load_torch(reference / "ckpt" / final / "engine.pt", deepspeed=True)["optimizer"],
                      load_torch(ckpt / final / "engine.pt", deepspeed=True)["optimizer"], "optimizer")
    want = {r["step"]: r["train/loss"] for r in steps(reference)}
    got_losses = {r["step"]: r["train/loss"] for r in steps(tmp_path / "run")}  # the resumed steps' lines last
    assert got_losses == want
