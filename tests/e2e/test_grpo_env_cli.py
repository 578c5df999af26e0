"""GRPO with an environment end to end through the CLI: the chat environment's user turns,
scripted by each prompt record's ``turns`` (data), are inserted inside the completions of that
prompt's rows (a reward that sees them says so), the on-policy replay stays torch.equal to mu
(grpo.verify_onpolicy), the env/* metrics are logged, a run resumed in the middle ends where the
uninterrupted one does, and ``rlt-mega eval`` writes the turns into the transcripts; under
data.chat_template the turns are the template's user turns after the model's own turn end, and the
learner runs the sampler's ids."""

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
           "env/observation_tokens_max", "env/truncated", "env/departures", "env/blocking_waits", "env/faults"]


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


def test_an_environments_faults_are_counted_and_too_many_stop_the_run(tmp_path, chats, capsys):
    """A user environment that raises in start() for some rows and answers a str instead of a Turn
    runs on (error observations, env/faults logged, the replay exact); one that raises at every
    call stops the run after its first step with one line naming the class, the method, the
    exception and the count."""
    env = [a for a in ENV if not a.startswith("grpo.env=")]
    assert main(grpo_args(tmp_path, chats, "start", "train.steps=1", *env, "grpo.env=helpers:BrokenStart",
                          "grpo.max_env_errors=0")) == 0
    records = [r for r in read_metrics(tmp_path / "start" / "tb") if "reward/mean" in r]
    assert records[0]["env/faults"] > 0 and records[0]["ratio/onpolicy_max_dev"] == 0.0
    capsys.readouterr()
    assert main(grpo_args(tmp_path, chats, "step", "train.steps=3", *env, "grpo.env=helpers:BrokenStep",
                          "grpo.max_env_errors=2")) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    stop = [line for line in lines if line.startswith("rlt-mega grpo: stopped: ")]
    assert len(stop) == 1 and stop[0].startswith(
        "rlt-mega grpo: stopped: the environment grpo.env=helpers:BrokenStep failed "), lines
    assert "more than grpo.max_env_errors=2 (step x" in stop[0] and ": ZeroDivisionError: division by zero)" in stop[0]
    assert "Traceback" not in "\n".join(lines)
    records = [r for r in read_metrics(tmp_path / "step" / "tb") if "reward/mean" in r]
    assert len(records) == 1 and records[0]["env/faults"] > 2  # the step is logged before the stop


def test_an_environment_needs_a_check_every_step(tmp_path, prompts, capsys):  # noqa: F811
    assert main(grpo_args(tmp_path, prompts, "bad", "train.steps=1", "grpo.env=calculator")) == 2
    assert "needs sampling.check_every: 1" in capsys.readouterr().err
    assert main(grpo_args(tmp_path, prompts, "bad2", "train.steps=1", "grpo.env=abacus", "sampling.check_every=1")) == 2
    assert "grpo.env 'abacus': expected one of ['calculator', 'chat']" in capsys.readouterr().err


def test_chat_turns_laid_out_by_the_chat_template_token_in_token_out(tmp_path, chats, monkeypatch):
    """data.chat_template=true with grpo.env=chat and the turns from the data: the model's own
    <|im_end|> hands over (an initial model whose head puts it first at about half the positions,
    so that turns happen at once), the record's user turn is inserted as the template lays it out
    (the ids tokenized once, forced: no mu), the learner's inputs are the sampler's ids, the on-policy
    replay is exact and env/departures counts calls that ran out of the batch."""
    import torch

    from rlt_mega.checkpoint_tools.export import export_model
    from rlt_mega.config import ModelConfig
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.model.rlt import build_model
    from rlt_mega.schedule.rows import Force
    from rlt_mega.rollout import Sampler
    from rlt_mega.train import grpo_learn as grpo_module

    assert main(["tokenizer", "train", "--data", str(chats), "--vocab-size", "300", "--chat-template", "chatml",
                 str(tmp_path / "tok")]) == 0
    tok = load_tokenizer(str(tmp_path / "tok"), chat_template=True)
    end = tok.turn_end_id
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, memory_block=2, max_seq_len=64)
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        u = torch.randn(cfg.d_model, generator=torch.Generator().manual_seed(0))
        model.lm_head.weight[end] = 4 * u / u.norm()  # a logit of about N(0, 4^2) for <|im_end|>, 0 for the rest
    export = export_model(model, None, tmp_path / "init", tokenizer_dir=tmp_path / "tok")

    sampled, learned = [], []
    generate, batch = Sampler.generate, grpo_module.grpo_batch

    def recording_generate(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        sampled.extend((ro, ro.tokens.clone()) for ro in out)
        return out

    def recording_batch(parts, *args, **kwargs):
        out = batch(parts, *args, **kwargs)
        learned.append(out["inputs"].clone())
        return out

    monkeypatch.setattr(Sampler, "generate", recording_generate)
    monkeypatch.setattr(grpo_module, "grpo_batch", recording_batch)
    args = grpo_args(tmp_path, chats, "template", "train.steps=2", f"model.vocab_size={tok.vocab_size}",
                     f"data.tokenizer={export}", "data.chat_template=true", f"train.init_from={export}",
                     "grpo.env=chat", "sampling.check_every=1", "grpo.max_turns=3", "grpo.max_turn_tokens=24",
                     "sampling.max_new_tokens=32", "sampling.slots=16")
    assert main(args) == 0
    records = [r for r in read_metrics(tmp_path / "template" / "tb") if "reward/mean" in r]
    assert len(records) == 2
    for r in records:
        assert r["ratio/onpolicy_max_dev"] == 0.0 and r["env/turns"] > 0.9, r
        assert r["env/departures"] > 0.5 and r["env/departures"] + r["env/blocking_waits"] >= r["env/turns"], r

    # the turns as the template lays them out, after the model's own turn end, tokenized once
    turns = 0
    for ro, tokens in sampled:
        for f in (f for events in ro.schedule.rows.forces.values() for f in events if isinstance(f, Force)):
            P = ro.schedule.prompt_lens[f.seq]
            question = tok.decode(tokens[f.seq, :P].tolist())
            i = int(question.rsplit("q", 1)[1].split()[0].strip())
            done = sum(g.seq == f.seq and g.start < f.start for v in ro.schedule.rows.forces.values() for g in v)
            turn = [f"s{i}", "more"][done]
            assert list(f.ids) == tok.encode(tok.chat_turn("user", turn))[:len(f.ids)] and len(f.ids) > 0
            assert tokens[f.seq, f.start - 1] == end and torch.equal(tokens[f.seq, f.start:f.start + len(f.ids)],
                                                                      torch.tensor(f.ids))
            assert not ro.mask[f.seq, f.start - P:f.start - P + len(f.ids)].any()  # forced: no mu, no loss
            assert f"<|im_start|>user\n{turn}<|im_end|>" in tok.tok.decode(list(f.ids), skip_special_tokens=False) \
                or len(f.ids) < len(tok.encode(tok.chat_turn("user", turn)))
            turns += 1
    assert turns >= 16
    # token in, token out: every row the learner ran is a row the sampler drew, id for id
    drawn = {tuple(t[b].tolist()) for _, t in sampled for b in range(t.shape[0])}
    rows = [tuple(x.tolist()) for inputs in learned for x in inputs]
    assert rows and all(any(d[:len(x)] == x or x[:len(d)] == d for d in drawn) for x in rows)
