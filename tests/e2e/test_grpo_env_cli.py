"""GRPO with an environment end to end through the CLI: the chat environment's user turns,
scripted by each prompt record's ``turns`` (data), are inserted inside the completions of that
prompt's rows (a reward that sees them says so), the on-policy replay stays torch.equal to mu
(grpo.verify_onpolicy), the env/* metrics are logged, a run resumed in the middle ends where the
uninterrupted one does, and ``rlt-mega eval`` writes the turns into the transcripts."""

import json

import pytest

from safetensors.torch import load_file

from rlt_mega.cli import main
from rlt_mega.metrics import read_metrics

from test_grpo_cli import grpo_args, prompts  # noqa: F401 (a fixture)

# "\nUser: s<i>\nAssistant:" is 21-22 byte tokens: the first turn fits, the second is cut by the budget
ENV = ["grpo.env=helpers:FrequentChat", "sampling.check_every=1", "grpo.max_turns=3", "grpo.max_turn_tokens=24",
       "sampling.max_new_tokens=32", "grpo.reward=helpers:own_turn_and_seven"]


@pytest.fixture
def chats(tmp_path):
    """Prompt records with scripted user turns, and two malformed ones (skipped, counted)."""
    path = tmp_path / "chats.jsonl"
    good = [json.dumps({"question": f"q{i}", "answer": f"#### {i}", "turns": [f"s{i}", "more"]}) for i in range(32)]
    bad = [json.dumps({"question": "q", "answer": "#### 0", "turns": "s0"}),
           json.dumps({"question": "q", "answer": "#### 0", "turns": ["s0", ""]})]
    path.write_text("\n".join(good[:5] + bad + good[5:]) + "\n")
    return path
METRICS = ["env/turns", "env/tool_calls", "env/tool_errors", "env/observation_tokens",
           "env/observation_tokens_max", "env/truncated"]


def test_grpo_with_an_environment_is_exact_and_resumes_exactly(tmp_path, chats):
    assert main(grpo_args(tmp_path, chats, "full", "train.steps=3", *ENV)) == 0
    assert main(grpo_args(tmp_path, chats, "split", "train.steps=2", *ENV)) == 0
    assert main(grpo_args(tmp_path, chats, "split", "train.steps=3", "train.resume=auto", *ENV)) == 0
    full = load_file(tmp_path / "full" / "ckpt" / "step_00000003" / "model.safetensors")
    split = load_file(tmp_path / "split" / "ckpt" / "step_00000003" / "model.safetensors")
    assert full.keys() == split.keys() and all((full[k] == split[k]).all() for k in full)
    records = [r for r in read_metrics(tmp_path / "full" / "tb") if "reward/mean" in r]
    assert len(records) == 3
    for r in records:
        assert all(k in r for k in METRICS), sorted(set(METRICS) - set(r))
        assert r["ratio/onpolicy_max_dev"] == 0.0
        assert r["env/turns"] > 0.9 and r["env/observation_tokens_max"] <= 31  # the budget: 32 less one draw
        assert r["reward/mean"] > 0.9  # the rows' completions hold their own prompt's turn (-1 for another's)
    assert any(r["env/truncated"] > 0 for r in records)
    # rlt-mega eval with the environment: its observations are in the completions
    common = grpo_args(tmp_path, chats, "full", *ENV)[1:]
    out = tmp_path / "eval.jsonl"
    assert main(["eval", *common, "--data", str(chats), "--limit", "6", "--output", str(out)]) == 0
    with_env = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["question"] for r in with_env] == [f"q{i}" for i in range(6)]  # the malformed records skipped
    for r in with_env:  # each transcript holds its own record's scripted turn
        assert f"\nUser: s{r['question'][1:]}\nAssistant:" in r["completion"], r
    assert main(["eval", *common, "grpo.env=", "--data", str(chats), "--limit", "6", "--output", str(out)]) == 0
    without = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    assert len(with_env) == len(without) == 6 and not any("User:" in c for c in without)


def test_an_environment_needs_a_check_every_step(tmp_path, prompts, capsys):  # noqa: F811
    assert main(grpo_args(tmp_path, prompts, "bad", "train.steps=1", "grpo.env=calculator")) == 2
    assert "needs sampling.check_every: 1" in capsys.readouterr().err
    assert main(grpo_args(tmp_path, prompts, "bad2", "train.steps=1", "grpo.env=abacus", "sampling.check_every=1")) == 2
    assert "grpo.env 'abacus': expected one of ['calculator', 'chat']" in capsys.readouterr().err
