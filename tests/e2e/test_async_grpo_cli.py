"""`rlt-mega grpo` under torchrun with a sampler role (grpo.sampler_replicas=1, max_staleness 1,
two processes): rank 0 logs every step with the async/* metrics, and train.resume=auto with the
roles continues the run from its checkpoint (step 4)."""

from rlt_mega.metrics import read_metrics

from helpers import launched, write_prompts


def grpo(tmp_path, *overrides):
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, 40)
    args = ["grpo", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_hidden=64", "model.memory_block=2", "model.max_seq_len=48", f"data.train={prompts}",
            "data.seq_len=32", "train.log_every=1", "optim.warmup_steps=0", "logging.progress=false",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}", "grpo.prompts_per_step=2",
            "grpo.group_size=2", "grpo.eval_size=2", "grpo.eval_every=0",
            "grpo.reward=tests.distributed.grpo_scenarios:odd", "sampling.max_new_tokens=6", "train.steps=3",
            "grpo.sampler_replicas=1", "grpo.max_staleness=1", *overrides]
    return launched(2, args, check=False)


def test_grpo_with_a_sampler_role_under_torchrun(tmp_path):
    proc = grpo(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    steps = [r for r in read_metrics(tmp_path / "tb") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["async/staleness_max"] for r in steps] == [0.0, 1.0, 1.0]
    for r in steps:
        assert 0.0 <= r["async/learner_idle_fraction"] <= 1.0 and r["async/weight_sync_s"] >= 0.0
    again = grpo(tmp_path, "train.resume=auto", "train.steps=4")
    assert again.returncode == 0, again.stdout[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "tb") if "train/loss" in r] == [1, 2, 3, 4]
