"""GRPO with an environment end to end through the CLI: observations are inserted inside the
completions, the on-policy replay stays torch.equal to mu (grpo.verify_onpolicy), the env/*
metrics are logged, and a run resumed in the middle ends where the uninterrupted one does."""

import json

from safetensors.torch import load_file

from rlt_mega.cli import main
from rlt_mega.metrics import read_metrics

from test_grpo_cli import grpo_args, prompts  # noqa: F401 (a fixture)

ENV = ["grpo.env=helpers:FrequentTool", "sampling.check_every=1", "grpo.max_turns=3", "grpo.max_turn_tokens=3",
       "sampling.max_new_tokens=12"]
METRICS = ["env/turns", "env/tool_calls", "env/tool_errors", "env/observation_tokens",
           "env/observation_tokens_max", "env/truncated"]


def test_grpo_with_an_environment_is_exact_and_resumes_exactly(tmp_path, prompts):  # noqa: F811
    assert main(grpo_args(tmp_path, prompts, "full", "train.steps=3", *ENV)) == 0
    assert main(grpo_args(tmp_path, prompts, "split", "train.steps=2", *ENV)) == 0
    assert main(grpo_args(tmp_path, prompts, "split", "train.steps=3", "train.resume=auto", *ENV)) == 0
    full = load_file(tmp_path / "full" / "ckpt" / "step_00000003" / "model.safetensors")
    split = load_file(tmp_path / "split" / "ckpt" / "step_00000003" / "model.safetensors")
    assert full.keys() == split.keys() and all((full[k] == split[k]).all() for k in full)
    records = [r for r in read_metrics(tmp_path / "full" / "tb") if "reward/mean" in r]
    assert len(records) == 3
    for r in records:
        assert all(k in r for k in METRICS), sorted(set(METRICS) - set(r))
        assert r["ratio/onpolicy_max_dev"] == 0.0
        assert r["env/turns"] > 0.1 and r["env/observation_tokens_max"] <= 9  # 3 turns x 3 tokens
    assert any(r["env/truncated"] > 0 for r in records)
    # rlt-mega eval with the environment: its observations are in the completions
    common = grpo_args(tmp_path, prompts, "full", *ENV)[1:]
    out = tmp_path / "eval.jsonl"
    assert main(["eval", *common, "--data", str(prompts), "--limit", "6", "--output", str(out)]) == 0
    with_env = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    assert main(["eval", *common, "grpo.env=", "--data", str(prompts), "--limit", "6", "--output", str(out)]) == 0
    without = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    assert len(with_env) == len(without) == 6 and with_env != without


def test_an_environment_needs_a_check_every_step(tmp_path, prompts, capsys):  # noqa: F811
    assert main(grpo_args(tmp_path, prompts, "bad", "train.steps=1", "grpo.env=calculator")) == 2
    assert "needs sampling.check_every: 1" in capsys.readouterr().err
    assert main(grpo_args(tmp_path, prompts, "bad2", "train.steps=1", "grpo.env=abacus", "sampling.check_every=1")) == 2
    assert "grpo.env 'abacus': expected one of ['calculator', 'chat']" in capsys.readouterr().err
