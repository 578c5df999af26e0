"""Prompts longer than model.max_seq_len and rewards that are not finite, through the CLI:
the prompts are skipped and counted at load (data/skipped) in GRPO, eval and generate, never
a traceback when one is drawn; a NaN or infinite reward is named, counted under
reward/nonfinite and scored as a failure (never accuracy 1.0), and a reward function that
keeps returning them stops the run with a message that names it."""

import json
import math

import pytest

from rlt_mega.cli import main
from rlt_mega.metrics import read_metrics

MAX_SEQ_LEN = 48
LONG = "x" * 80  # byte tokenizer: 80+ tokens, longer than model.max_seq_len


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(16)]
    rows[3]["question"] = rows[9]["question"] = LONG
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def grpo_args(tmp_path, prompts, *extra):
    return ["grpo", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.memory_block=2",
            f"model.max_seq_len={MAX_SEQ_LEN}", f"data.train={prompts}", "data.seq_len=32", "train.log_every=1",
            "optim.warmup_steps=0", "logging.progress=false", f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"logging.dir={tmp_path / 'tb'}", "grpo.prompts_per_step=4", "grpo.group_size=2", "grpo.eval_size=0",
            "sampling.max_new_tokens=4", *extra]


def test_long_prompts_are_skipped_and_a_nan_reward_is_counted_as_a_failure(tmp_path, prompts, caplog):
    assert main(grpo_args(tmp_path, prompts, "train.steps=4", "grpo.reward=helpers:nan_on_odd",
                          "grpo.max_nonfinite_reward_steps=0")) == 0
    err = caplog.text
    assert "prompt longer than model.max_seq_len (48 tokens) x2" in err, err[-3000:]
    assert "reward function nan_on_odd returned nan on prompt" in err
    rows = [r for r in read_metrics(tmp_path / "tb") if "reward/mean" in r]
    assert len(rows) == 4
    assert sum(r["reward/nonfinite"] for r in rows) > 0
    for r in rows:
        assert math.isfinite(r["reward/mean"]) and r["reward/failures"] >= r["reward/nonfinite"]


def test_an_inf_reward_is_a_failure_and_stops_the_run(tmp_path, prompts, capsys):
    assert main(grpo_args(tmp_path, prompts, "train.steps=5", "grpo.reward=helpers:inf_reward",
                          "grpo.max_nonfinite_reward_steps=2")) == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith("rlt-mega grpo: stopped: the reward function grpo.reward=helpers:inf_reward returned NaN "
                           "or an infinity in 2 steps in a row up to step 2"), err[-3000:]
    rows = [r for r in read_metrics(tmp_path / "tb") if "reward/mean" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["reward/accuracy"] == 0.0 and r["reward/mean"] == 0.0 and r["reward/nonfinite"] == 8


def test_eval_and_generate_skip_long_prompts(tmp_path, prompts, capsys, caplog):
    model = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.memory_block=2",
             f"model.max_seq_len={MAX_SEQ_LEN}", "data.seq_len=32", "sampling.max_new_tokens=4",
             "logging.progress=false", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    assert main(grpo_args(tmp_path, prompts, "train.steps=1")) == 0  # weights to evaluate
    capsys.readouterr()
    assert main(["eval", *model, "--data", str(prompts)]) == 0
    captured = capsys.readouterr()
    assert "eval prompts: prompt longer than model.max_seq_len (48 tokens) x2" in caplog.text, caplog.text[-2000:]
    assert "(14)" not in captured.out and "/14)" in captured.out
    assert main(["generate", *model, "--input", str(prompts)]) == 0
    captured = capsys.readouterr()
    assert f"--input {prompts}: prompt longer than model.max_seq_len (48 tokens) x2" in caplog.text
    assert len(captured.out.strip().splitlines()) == 14
