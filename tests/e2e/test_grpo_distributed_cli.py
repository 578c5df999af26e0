"""`rlt-mega grpo` under torchrun on two ranks, two pipeline stages (the sampler ring, ZeRO-1,
two rollout micro-batches in flight, grad_accum 2, the k3 KL to a reference in the same layout,
held-out accuracy through the ring): every metric is logged by rank 0, the on-policy ratios are
exactly 1, and a run stopped and resumed ends with the weights of an uninterrupted one."""

import torch
from safetensors.torch import load_file

from rlt_mega.metrics import read_metrics

from helpers import launched, write_prompts

METRICS = ["reward/mean", "reward/accuracy", "ratio/min", "ratio/mean", "ratio/max", "ratio/clip_fraction",
           "ratio/onpolicy_max_dev", "support/miss_fraction", "mismatch/logprob_diff_max",
           "mismatch/logprob_diff_mean", "mismatch/kl_mu_dense", "perf/rollout_tokens_per_s",
           "perf/learner_tokens_per_s", "time/generate", "time/score", "time/reference", "time/replay", "time/update",
           "train/loss", "train/grad_norm", "kl/reference"]


def grpo(tmp_path, name, *overrides):
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, 40)
    args = ["grpo", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_hidden=64", "model.memory_block=2", "model.max_seq_len=48", f"data.train={prompts}",
            "data.seq_len=32", "train.log_every=1", "optim.lr=0.01", "optim.warmup_steps=0",
            "optim.schedule=constant", "logging.progress=false", f"checkpoint.dir={tmp_path / name / 'ckpt'}",
            f"logging.dir={tmp_path / name / 'tb'}", "checkpoint.every=0", "grpo.prompts_per_step=2",
            "grpo.group_size=4", "grpo.minibatches=2", "grpo.eval_size=4", "grpo.eval_every=0", "grpo.kl_coef=0.05",
            "grpo.verify_onpolicy=true",
            "grpo.reward=tests.distributed.grpo_scenarios:odd", "sampling.max_new_tokens=6", "train.steps=2",
            "train.grad_accum=2", "parallel.pp=2", "parallel.micro_batches=2", "parallel.zero_stage=1", *overrides]
    return launched(2, args)


def test_pipeline_grpo_under_torchrun_logs_every_metric_and_resumes_exactly(tmp_path):
    proc = grpo(tmp_path, "full")
    assert proc.stdout.count("held-out greedy accuracy: before GRPO") == 1  # rank 0 only
    records = read_metrics(tmp_path / "full" / "tb")
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert all(key in r for key in METRICS), sorted(set(METRICS) - set(r))
        assert r["ratio/onpolicy_max_dev"] == 0.0
        assert r["mismatch/logprob_diff_max"] < 1e-4 and r["support/miss_fraction"] == 0.0
        assert r["perf/rollout_tokens_per_s"] > 0 and r["kl/reference"] >= 0.0
    assert len([r for r in records if "eval/accuracy" in r]) == 2  # before and after

    grpo(tmp_path, "split", "train.stop_after=1")
    assert (tmp_path / "split" / "ckpt" / "latest").read_text() == "step_00000001"
    grpo(tmp_path, "split", "train.resume=auto")
    full = load_file(tmp_path / "full" / "ckpt" / "step_00000002" / "model.safetensors")
    resumed = load_file(tmp_path / "split" / "ckpt" / "step_00000002" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
