"""GRPO end to end through the CLI on a tiny model: every metric is logged, the on-policy
ratio is exactly 1 at every step, a learnable reward rises, and a resumed run ends where the
uninterrupted one does."""

import json

import pytest
from safetensors.torch import load_file

from rlt_mega.cli import main
from rlt_mega.metrics import read_metrics

from helpers import gsm8k_dir

METRICS = ["reward/mean", "reward/accuracy", "ratio/min", "ratio/mean", "ratio/max", "ratio/clip_fraction",
           "ratio/onpolicy_max_dev", "support/miss_fraction", "mismatch/logprob_diff_max",
           "mismatch/logprob_diff_mean", "mismatch/kl_mu_dense", "perf/rollout_tokens_per_s",
           "perf/learner_tokens_per_s", "time/generate", "time/score", "time/replay", "time/update", "train/loss"]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(32)))
    return path


def grpo_args(tmp_path, prompts, run, *extra):
    return ["grpo", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.memory_block=2",
            "model.max_seq_len=64", f"data.train={prompts}", "data.seq_len=32", "train.log_every=1",
            "optim.lr=0.01", "optim.warmup_steps=0", "optim.schedule=constant", "logging.progress=false",
            f"checkpoint.dir={tmp_path / run / 'ckpt'}", f"logging.dir={tmp_path / run / 'tb'}",
            "grpo.prompts_per_step=4", "grpo.group_size=8", "grpo.minibatches=2", "grpo.eval_size=0",
            "grpo.verify_onpolicy=true",
            "grpo.reward=helpers:emit_seven", "sampling.max_new_tokens=8", *extra]


def test_grpo_cli_learns_a_reward_and_logs_every_metric(tmp_path, prompts, capsys):
    assert main(grpo_args(tmp_path, prompts, "run", "train.steps=14")) == 0
    assert "TensorBoard logs" in capsys.readouterr().out
    records = [r for r in read_metrics(tmp_path / "run" / "tb") if "reward/mean" in r]
    assert len(records) == 14
    for r in records:
        assert all(key in r for key in METRICS), sorted(set(METRICS) - set(r))
        assert r["ratio/onpolicy_max_dev"] == 0.0  # first minibatch: value = replay = mu, bit for bit
        assert r["support/miss_fraction"] == 0.0 and r["mismatch/logprob_diff_max"] < 1e-4
        assert 0.0 <= r["mismatch/kl_mu_dense"] < 1e-6  # on-policy: only the schedules' rounding
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > 0.03 and last > 5 * first, rewards
    assert (tmp_path / "run" / "ckpt" / "step_00000014" / "model.safetensors").is_file()


def test_grpo_bf16_with_reference_kl(tmp_path, prompts):
    args = grpo_args(tmp_path, prompts, "bf16", "train.steps=2", "train.dtype=bf16", "grpo.kl_coef=0.05",
                     "grpo.epochs=2", "grpo.eps_high=0.28", "grpo.advantage=dr_grpo")
    assert main(args) == 0
    records = [r for r in read_metrics(tmp_path / "bf16" / "tb") if "reward/mean" in r]
    assert len(records) == 2
    for r in records:
        assert r["ratio/onpolicy_max_dev"] == 0.0  # exact in bf16 too
        assert "kl/reference" in r and r["kl/reference"] >= 0.0


# Dynamic sampling draws a step's extra prompts from the same record order, so a resumed run must
# continue that order where the interrupted one left it (emit_seven leaves most groups of a fresh
# model at reward 0, so rounds are dropped and redrawn).
@pytest.mark.parametrize("options", [(), ("grpo.dynamic_sampling=true", "grpo.max_sampling_rounds=3")],
                         ids=["plain", "dynamic_sampling"])
def test_grpo_resume_continues_exactly(tmp_path, prompts, options):
    assert main(grpo_args(tmp_path, prompts, "full", "train.steps=4", *options)) == 0
    assert main(grpo_args(tmp_path, prompts, "split", "train.steps=2", *options)) == 0
    assert main(grpo_args(tmp_path, prompts, "split", "train.steps=4", "train.resume=auto", *options)) == 0
    full = load_file(tmp_path / "full" / "ckpt" / "step_00000004" / "model.safetensors")
    split = load_file(tmp_path / "split" / "ckpt" / "step_00000004" / "model.safetensors")
    assert full.keys() == split.keys() and all((full[k] == split[k]).all() for k in full)
    records = {run: [r for r in read_metrics(tmp_path / run / "tb") if "reward/mean" in r] for run in ("full", "split")}
    tail = {run: {r["step"]: r for r in rows} for run, rows in records.items()}
    for step in (3, 4):
        assert tail["split"][step]["reward/mean"] == tail["full"][step]["reward/mean"]
    if options:
        drawn = [r for r in records["full"] if r.get("sampling/rounds", 1) > 1]
        assert drawn, "emit_seven should leave some groups constant, so dynamic sampling redraws"


def test_grpo_refuses_a_bad_reward(tmp_path, prompts, capsys):
    assert main(grpo_args(tmp_path, prompts, "bad", "train.steps=1", "grpo.reward=nowhere")) == 2
    assert "reward 'nowhere'" in capsys.readouterr().err


def test_grpo_on_real_gsm8k_records(tmp_path):
    """The GSM8K data path of configs/grpo_gsm8k.yaml (a local copy instead of the hub), on a
    tiny untrained model: real prompts, the GSM8K reward, held-out accuracy."""
    args = ["grpo", "--config", "configs/grpo_gsm8k.yaml", f"data.train={gsm8k_dir()}", "data.tokenizer=byte",
            "model.vocab_size=260", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
            "model.ffn_hidden=64", "model.max_seq_len=1024", "train.dtype=fp32", "train.device=cpu", "train.steps=1",
            "train.checkpointing.decoder=none", "train.checkpointing.encoder=false", "grpo.prompts_per_step=2",
            "grpo.group_size=2", "grpo.minibatches=2", "grpo.eval_size=2", "sampling.max_new_tokens=4",
            "grpo.verify_onpolicy=true",
            "logging.progress=false", f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}"]
    assert main(args) == 0
    records = read_metrics(tmp_path / "tb")
    assert [r["eval/accuracy"] for r in records if "eval/accuracy" in r] == [0.0, 0.0]
    assert [r["ratio/onpolicy_max_dev"] for r in records if "reward/mean" in r] == [0.0]


def test_grpo_with_slots_equals_one_slot_a_row(tmp_path, prompts):
    """Two GRPO steps with slots < rows (the rows wait and enter freed slots) against one slot a
    row: the same completions and rewards, parameters within fp32 rounding (the schedules differ
    only in GEMM shapes)."""
    runs = {"rows": ["sampling.slots=6"], "lockstep": ["sampling.slots=0"]}
    out = {}
    for run, extra in runs.items():
        assert main(grpo_args(tmp_path, prompts, run, "train.steps=2", "checkpoint.every=2", *extra)) == 0
        records = [r for r in read_metrics(tmp_path / run / "tb") if "reward/mean" in r]
        assert all(r["ratio/onpolicy_max_dev"] == 0.0 for r in records)
        out[run] = (records, load_file(str(tmp_path / run / "ckpt" / "step_00000002" / "model.safetensors")))
    (rows, p_rows), (lock, p_lock) = out["rows"], out["lockstep"]
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in lock]
    assert max(float((p_rows[k] - p_lock[k]).abs().max()) for k in p_lock) <= 1e-5
    assert rows[0]["train/loss"] == pytest.approx(lock[0]["train/loss"], rel=1e-4, abs=1e-6)
