"""Environment turns inside rollouts (rollout/turns.py, rollout/env/): observations inserted after a
trigger are forced like prompt tokens (``Force`` events of the row plan), carry no mu and no loss,
and the replay repeats them: torch.equal to mu in fp32 and bf16, C in {1, 3} with insertions that
start and end inside a memory block and on its boundary, G in {1, 4} (forks before the first
turn), slots < rows, several turns per row; the learner's dense log-probs and gradient equal the
teacher-forced transcript's under the same mask (float64); the limits (max_turns, observation
caps, the token budget, the time limit); token identity with a tokenizer whose re-encoding
changes the ids; the chat environment's turns from the prompt records, laid out by the template."""

import json
import threading
import time

import pytest
import torch

from rlt_mega.config import ModelConfig
from rlt_mega.learner.aggregation import loss_count
from rlt_mega.learner.logprob import dense_logprobs
from rlt_mega.model.rlt import build_model
from rlt_mega.schedule.rows import Enter, Force, Leave, RowSwitches, record_from_json, record_to_json
from rlt_mega.rollout import Processing, Sampler, SamplingParams, generate, process_logits, replay
from rlt_mega.rollout.env import Chat, EnvFaults, EnvLimits, Environment, Environments, Turn

ALPHABET = "0123456789+-*/()<>=. abcdefghijklmnopqrstuvwxyz"  # ids 1..47; 0 is pad
V = len(ALPHABET) + 1


def decode(ids):
    return "".join(ALPHABET[i - 1] for i in ids if i > 0)


def encode(text):
    return [ALPHABET.index(c) + 1 for c in text]


class Echo(Environment):
    """Triggered by any of a few common characters; answers 1-5 characters (so insertions start
    and end at every offset inside a memory block), ends the episode on 'z'."""

    triggers = tuple("aeiostnr")

    def step(self, state, text):
        if "z" in text:
            return Turn(done=True)
        n = 1 + sum(map(ord, text)) % 5
        return Turn(observation="=" * (n - 1) + ">", tool_call=True, error=n == 5)


def tiny(C, dtype=torch.float32):
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, memory_block=C,
                      max_seq_len=96, init_std=0.1)
    return build_model(cfg, seed=3).to(dtype)


PROMPTS = [[1, 2, 3, 4]] * 4 + [[6, 7, 8, 9, 10, 11]] * 4 + [[5]] + [[3, 5, 7, 9, 11]]


def sample(model, prompts, env=Echo(), limits=EnvLimits(max_turns=6, max_turn_tokens=5), dtype="fp32",
           rows=RowSwitches(), max_new=30, seed=100):
    episodes = Environments(env, encode, limits).episodes([{} for _ in prompts])
    sampler = Sampler(model, check_every=1, rows=rows)
    params = SamplingParams(Processing(temperature=1.0), max_new_tokens=max_new, stop_token_ids=(2,))
    ro = sampler.generate([prompts], params, [list(range(seed, seed + len(prompts)))], pad_id=0, dtype=dtype,
                          decode=decode, episodes=[episodes])[0]
    return sampler, ro


def forces(ro):
    return [f for v in ro.schedule.rows.forces.values() for f in v]


ROWS = {"G4_shared": RowSwitches(), "slots": RowSwitches(slots=4), "G1": RowSwitches(share_prompts=False)}


@pytest.mark.parametrize("name", list(ROWS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("C", [1, 3])
def test_replay_repeats_the_insertions_bit_for_bit(C, dtype, name):
    model = tiny(C, torch.bfloat16 if dtype == "bf16" else torch.float32)
    for rows in [ROWS[name]]:
        sampler, ro = sample(model, PROMPTS, dtype=dtype, rows=rows, max_new=24)
        fs = forces(ro)
        per_row = [sum(f.seq == b for f in fs) for b in range(len(PROMPTS))]
        assert max(per_row) >= 3 and sum(n > 0 for n in per_row) >= 6, (name, per_row)  # several turns, most rows
        if C == 3:  # insertions starting and ending inside a block and on its boundary
            assert {f.start % C for f in fs} == {0, 1, 2} and {(f.start + len(f.ids)) % C for f in fs} == {0, 1, 2}
        assert "env" in ro.finish_reasons and len(set(ro.completion_lens)) > 2, name  # episodes end, rows leave
        for f in fs:  # the observation sits in the transcript, masked out, mu 0
            b, j = f.seq, f.start - ro.schedule.prompt_lens[f.seq]
            assert ro.tokens[b, f.start:f.start + len(f.ids)].tolist() == list(f.ids)
            assert not ro.mask[b, j:j + len(f.ids)].any() and not ro.mu[b, j:j + len(f.ids)].any()
        assert int(ro.mask.sum()) == sum(ro.completion_lens) - sum(len(f.ids) for f in fs)
        assert [Force] == list({type(e) for e in ro.schedule.rows.log if isinstance(e, Force)})
        assert torch.equal(sampler.replay([ro])[0], ro.mu), name
        assert torch.equal(replay(model, ro), ro.mu), name  # a fresh sampler: the record rules
        back = record_from_json(json.loads(json.dumps(record_to_json(ro.schedule.rows))))
        assert back == ro.schedule.rows


def test_mu_outside_insertions_matches_the_teacher_forced_transcript():
    """Each sampled token's mu is the model's distribution on the transcript with the observation
    in it (what the sampler saw is what the learner sees), checked with the plain dense forward."""
    model = tiny(3).double()
    _, ro = sample(model, PROMPTS[:1] + PROMPTS[8:], rows=RowSwitches(share_prompts=False))
    assert forces(ro)
    with torch.no_grad():
        logits = model(ro.tokens[:, :-1])
    lp = process_logits(logits, ro.schedule.processing).gather(2, ro.tokens[:, 1:, None]).squeeze(2)
    for b in range(ro.batch_size):
        P, n = ro.schedule.prompt_lens[b], ro.completion_lens[b]
        m = ro.mask[b, :n]
        assert torch.allclose(lp[b, P - 1:P - 1 + n][m], ro.mu[b, :n][m].double(), atol=1e-9)


def test_the_learners_dense_log_probs_and_gradient_equal_teacher_forcing_with_the_mask():
    _, ro = sample(tiny(3).double(), PROMPTS)
    assert forces(ro)
    adv = torch.linspace(-1.0, 1.0, ro.batch_size, dtype=torch.float64)
    grads = []
    for run in ("learner", "teacher"):
        model = tiny(3).double()
        if run == "learner":
            logp = dense_logprobs(model, ro)  # (B, N): compact, shared prompts
        else:  # the transcript fed whole, padded, the sampled tokens picked by the same mask
            logits = model(ro.tokens[:, :-1])
            full = process_logits(logits, ro.schedule.processing).gather(2, ro.tokens[:, 1:, None]).squeeze(2)
            logp = torch.zeros(ro.mask.shape, dtype=full.dtype)
            for b in range(ro.batch_size):
                P, n = ro.schedule.prompt_lens[b], ro.completion_lens[b]
                logp[b, :n] = full[b, P - 1:P - 1 + n]
            logp = torch.where(ro.mask, logp, torch.zeros_like(logp))
        assert not logp[~ro.mask].any()  # inserted tokens carry no value
        (logp * adv[:, None]).sum().backward()
        grads.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = grads
    assert (a - b).abs().max() <= 1e-12
    for n in ga:
        assert (ga[n] - gb[n]).norm() <= 1e-12 * gb[n].norm().clamp_min(1e-300), n
    # the loss's token count counts sampled tokens only
    inserted = sum(len(f.ids) for f in forces(ro))
    assert loss_count(ro.mask, "token_mean") == sum(ro.completion_lens) - inserted


class Retokenizing:
    """A tokenizer with a merge: 'ab' encodes to one id (47 + 1 = 48), so decode-then-encode of a
    transcript is not the identity."""

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out.append(V)
                i += 2
            else:
                out.append(ALPHABET.index(text[i]) + 1)
                i += 1
        return out

    def decode(self, ids):
        return "".join("ab" if i == V else ALPHABET[i - 1] for i in ids if i > 0)


class Spelled(Environment):
    """Answers 'a' then 'b' as two observations of one character each (a merge on re-encoding)."""

    triggers = tuple("cdfg")

    def step(self, state, text):
        return Turn(observation="a")


def test_the_learner_trains_on_the_samplers_ids_not_a_retokenized_transcript():
    tok = Retokenizing()
    cfg = ModelConfig(vocab_size=V + 1, d_model=32, n_layers=2, n_heads=4, memory_block=2, max_seq_len=96, init_std=0.1)
    model = build_model(cfg, seed=5)
    prompts = [[1, 2, 3]] * 4
    episodes = Environments(Spelled(), tok.encode, EnvLimits(max_turns=8)).episodes([{}] * 4)
    sampler = Sampler(model, check_every=1)
    params = SamplingParams(Processing(temperature=1.0), max_new_tokens=40)
    ro = sampler.generate([prompts], params, [[7, 8, 9, 10]], pad_id=0, decode=tok.decode, episodes=[episodes])[0]
    changed = [b for b in range(4) if tok.encode(tok.decode(ro.completion(b))) != ro.completion(b)]
    assert changed  # re-encoding the transcript would change the ids ...
    assert torch.equal(replay(model, ro), ro.mu)  # ... the replay and the learner use the sampler's
    dense = dense_logprobs(model, ro)
    assert (dense - ro.mu)[ro.mask].abs().max() < 1e-5


def test_limits_turns_observation_caps_budget_and_time():
    model = tiny(1)

    class Long(Environment):
        triggers = tuple("aeiou")

        def step(self, state, text):
            return Turn(observation="=" * 9, tool_call=True)

    _, ro = sample(model, PROMPTS[8:], env=Long(), limits=EnvLimits(max_turns=2, max_turn_tokens=4,
                                                                    max_episode_tokens=6), max_new=40)
    for b, st in enumerate(ro.episodes):
        fs = [f for f in forces(ro) if f.seq == b]
        assert st.turns == len(fs) <= 2 and sum(len(f.ids) for f in fs) <= 6
        assert all(len(f.ids) <= 4 for f in fs) and st.truncated == (st.turns > 0)  # 9 characters cut to 4
        assert st.observation_tokens == sum(len(f.ids) for f in fs)
        if ro.finish_reasons[b] == "env":  # a third trigger, past max_turns, ended the episode
            assert st.turns == 2
    assert "env" in ro.finish_reasons

    class Slow(Environment):
        triggers = tuple("aeiou")

        def step(self, state, text):
            time.sleep(1)
            return Turn(observation="1")

    t0 = time.perf_counter()
    _, ro = sample(model, [[5]], env=Slow(), limits=EnvLimits(max_turns=1, time_limit_s=0.05), max_new=20)
    assert time.perf_counter() - t0 < 2
    st = ro.episodes[0]
    assert st.turns == 1 and st.tool_errors == 1 and st.observation_tokens == len("error>>")
    # the only row: each of its calls (the one answered, the next one that max_turns ended) waited for in its slot
    assert (st.departures, st.blocking_waits, ro.finish_reasons[0]) == (0, 2, "env")
    assert torch.equal(replay(model, ro), ro.mu)


def test_scripted_chat_turns_and_bad_input():
    env = Chat()
    state = env.start({"turns": ["hi", "bye"]})
    assert env.triggered("well <end>") and not env.triggered("well")
    assert env.step(state, "x<end>") == Turn(observation="hi", role="user")
    assert env.step(state, "y<end>") == Turn(observation="bye", role="user")
    assert env.step(state, "z<end>").done
    with pytest.raises(ValueError, match="turns"):
        env.start({"question": "q"})
    model = tiny(1)
    sampler = Sampler(model, check_every=8)
    with pytest.raises(ValueError, match="check_every=1"):
        sampler.generate([[[1, 2]]], SamplingParams(max_new_tokens=4), [[1]], pad_id=0, decode=decode,
                         episodes=[Environments(Echo(), encode, EnvLimits()).episodes([{}])])
    with pytest.raises(ValueError, match="max_turns"):
        EnvLimits(max_turns=0)


def test_chat_turns_are_laid_out_by_the_chat_template(tmp_path):
    """Under data.chat_template the assistant's turn-end token hands over (and no longer stops the
    row), and the user turn is the template's text, tokenized once: the transcript reads as the
    template renders the conversation."""
    from rlt_mega import cli
    from rlt_mega.config import DataConfig
    from rlt_mega.data.datasets import PROMPT_COLUMNS, DataStats, load_records, prompt_record
    from rlt_mega.data.arithmetic import generate_problems
    from rlt_mega.data.chat import CHATML, render
    from rlt_mega.data.tokenizer import load_tokenizer

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in generate_problems(20, 0)))
    assert cli.main(["tokenizer", "train", "--data", str(data), "--vocab-size", "300", "--chat-template", "chatml",
                     str(tmp_path / "tok")]) == 0
    tok = load_tokenizer(str(tmp_path / "tok"), chat_template=True)
    envs = Environments(Chat(), tok.encode, EnvLimits(), tok.chat_turn, tok.turn_end_id)
    assert tok.turn_end_id in tok.stop_ids and envs.stop_ids(tok.stop_ids) == (tok.eos_id,)
    # the turns come from the prompt record (GRPO's and eval's data), a malformed one skipped and counted
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question": "1 + 1?", "answer": "2", "turns": ["and 2 + 2?"]}, {"question": "q", "answer": "a", "turns": [3]},
        {"question": "q", "answer": "a", "turns": ["\ud800"]}, {"question": "q", "answer": "a"}]))
    stats = DataStats()
    records = load_records(str(chats), "train", DataConfig(train=str(chats)), prompt_record(), PROMPT_COLUMNS, stats)
    assert [r["turns"] for r in records] == [["and 2 + 2?"], []] and stats.total == 2, stats.summary()
    assert "field 'turns' is not a list of strings x1" in stats.summary()
    ep = envs.episodes([records[0]])[0]
    prompt = tok.encode(tok.chat_prompt("1 + 1?"))
    answer = tok.encode("2") + [tok.turn_end_id]
    assert not ep.triggered(answer[:-1], "2") and ep.triggered(answer, "2")
    r = ep.respond(answer, "2")
    messages = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "and 2 + 2?"}]
    assert tok.tok.decode(prompt + answer + list(r.ids), skip_special_tokens=False) == \
        render(CHATML, messages, True, tok.special_tokens)
    assert ep.respond(answer, "4").done  # after the last scripted turn
    plain = Environments(Chat(), lambda t: [ord(c) for c in t], EnvLimits()).episodes([{"turns": ["hi"]}])[0]
    assert plain.triggered([], "ok <end>") and not plain.triggered([tok.turn_end_id], "ok")
    assert "".join(map(chr, plain.respond([], "ok <end>").ids)) == "\nUser: hi\nAssistant:"


def leaves(ro, why="env"):
    return [e for e in ro.schedule.rows.log if isinstance(e, Leave) and e.why == why]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("C", [1, 3])
def test_rows_leave_their_slot_while_their_environment_call_runs(C, dtype):
    """G = 4 groups forked before any turn, 4 slots for 10 rows: a triggered row leaves its slot
    (``Leave(why="env")``, its state parked), a waiting row takes the slot, the answer is forced at
    the next check and the row re-enters where it left; the replay repeats it torch.equal to mu,
    and a second run records the same events and tokens."""
    model = tiny(C, torch.bfloat16 if dtype == "bf16" else torch.float32)
    rows = RowSwitches(slots=4)
    _, ro = sample(model, PROMPTS, dtype=dtype, rows=rows, max_new=24)
    rec, away = ro.schedule.rows, leaves(ro)
    assert len(away) >= 8 and len({e.seq for e in away}) >= 5 and "Fork" in {type(e).__name__ for e in rec.log}
    assert max(sum(e.seq == b for e in away) for b in range(len(PROMPTS))) >= 2  # several calls of one row
    # (a row forked at the last step that triggers at once is not in a slot yet: away, no Leave)
    assert {(e.step, e.seq) for e in away} <= {(k, b) for k, v in rec.away.items() for b in v}
    took_freed_slot = 0
    for e in away:
        later = rec.log[rec.log.index(e) + 1:]
        # the row's answer comes at the next check: an observation forced there, or the episode ended
        force = [f for f in later if isinstance(f, Force) and f.seq == e.seq and f.step == e.step + 1]
        ended = e.seq in rec.checks.get(e.step + 1, [])
        assert len(force) + ended == 1, e
        if force:  # ... and the row re-enters later, at the position it left
            enter = next(x for x in later if isinstance(x, Enter) and x.seq == e.seq)
            assert enter.step >= e.step + 1 and later.index(force[0]) < later.index(enter)
        slot = next(x.slot for x in reversed(rec.log[:rec.log.index(e)]) if isinstance(x, Enter) and x.seq == e.seq)
        took_freed_slot += any(isinstance(x, Enter) and x.step == e.step and x.slot == slot for x in later)
    assert took_freed_slot >= 1  # a waiting row took the slot of a row whose call ran
    # env/departures and env/blocking_waits count each row's calls by where they ran: out of the
    # batch (every row the record has away, in a slot or not yet) or waited for at once in its slot
    for b, st in enumerate(ro.episodes):
        assert st.departures == sum(b in v for v in rec.away.values())
        assert st.departures + st.blocking_waits == st.turns + (ro.finish_reasons[b] == "env")
    assert torch.equal(replay(model, ro), ro.mu)
    assert record_from_json(json.loads(json.dumps(record_to_json(rec)))) == rec
    _, again = sample(model, PROMPTS, dtype=dtype, rows=rows, max_new=24)
    assert again.schedule.rows == rec and torch.equal(again.tokens, ro.tokens) and torch.equal(again.mu, ro.mu)


def test_a_slow_environment_runs_while_the_other_rows_decode(monkeypatch):
    """The order of what happens, never its timing: a call (an environment that answers only once
    a decoder step has run since it started, or once the sampler waits for it) saw a decoder step
    of the other rows between its start and its end whenever its row left the batch; with
    synchronous calls no step could run meanwhile."""
    from rlt_mega.model.decoder import StepRunner
    from rlt_mega.rollout.env import base

    trace, started, local = [], [], threading.local()
    step, start, turn = StepRunner.step, base.Calls.start, base.Call.turn

    def traced_step(self, *args):
        for ev in started:  # the calls submitted so far have begun (whenever their threads got to run)
            assert ev[0].wait(10)
        trace.append("step")
        return step(self, *args)

    def traced_start(self, fn):
        ev = (threading.Event(), threading.Event())  # (the call began, the sampler waits for it)
        started.append(ev)

        def run():
            local.ev = ev
            ev[0].set()
            return fn()

        call = start(self, run)
        call.waited = ev[1]
        return call

    def traced_turn(self):
        self.waited.set()
        return turn(self)

    monkeypatch.setattr(StepRunner, "step", traced_step)
    monkeypatch.setattr(base.Calls, "start", traced_start)
    monkeypatch.setattr(base.Call, "turn", traced_turn)

    class Slow(Environment):
        triggers = tuple("aeiou")

        def step(self, state, text):
            trace.append("call")
            at = len(trace)
            while "step" not in trace[at:] and not local.ev[1].is_set():
                time.sleep(0.0005)
            trace.append("return")
            return Turn(observation="=>", tool_call=True)

    model = tiny(3)
    _, ro = sample(model, PROMPTS[:4] + PROMPTS[8:], env=Slow(), limits=EnvLimits(max_turns=2, time_limit_s=30),
                   rows=RowSwitches(slots=3), max_new=16)
    calls = [i for i, x in enumerate(trace) if x == "call"]
    overlapped = sum("step" in trace[i:trace.index("return", i)] for i in calls)
    away = sum(len(v) for v in ro.schedule.rows.away.values())
    assert len(leaves(ro)) >= 3 and overlapped == away  # (and not one call waited for at once)
    assert away > len(leaves(ro))  # a forked row called with its first token, out of the queue, not a slot
    assert all(st.tool_errors == 0 for st in ro.episodes)
    assert sum(st.departures for st in ro.episodes) == away
    assert torch.equal(replay(model, ro), ro.mu)


def sample_rows(model, prompts, env, limits, max_new=40):
    """``sample`` with one record per row ({"row": b}: a user environment's start sees it)."""
    episodes = Environments(env, encode, limits).episodes([{"row": b} for b in range(len(prompts))])
    sampler = Sampler(model, check_every=1)
    params = SamplingParams(Processing(temperature=1.0), max_new_tokens=max_new, stop_token_ids=(2,))
    ro = sampler.generate([prompts], params, [list(range(100, 100 + len(prompts)))], pad_id=0,
                          decode=decode, episodes=[episodes])[0]
    return sampler, ro, episodes


class Calls(Environment):
    """Triggered by the common characters; records every call (row, the model's turn) and answers
    ``answer(row, number of the row's call)``."""

    triggers = tuple("aeiostnr")

    def __init__(self, answer):
        self.answer, self.asked, self.lock = answer, [], threading.Lock()

    def start(self, record):
        return record["row"]

    def step(self, row, text):
        with self.lock:
            n = sum(r == row for r, _ in self.asked)
            self.asked.append((row, text))
        return self.answer(row, n)


def test_an_empty_observation_restarts_the_model_turn():
    """An environment that answers "" (and one whose episode budget is spent) never sees the same
    written call twice: the model's turns it is asked about are consecutive pieces of the
    completion (their concatenation is the completion up to the last call, no piece repeated),
    env/turns and env/tool_calls count the calls asked, and the replay stays exact."""
    model = tiny(1)
    env = Calls(lambda row, n: Turn(observation="", tool_call=True))
    _, ro, _ = sample_rows(model, PROMPTS[8:] + PROMPTS[:2], env, EnvLimits(max_turns=8))
    assert not forces(ro)  # nothing inserted
    asked = 0
    for b, st in enumerate(ro.episodes):
        texts = [text for r, text in env.asked if r == b]
        asked += len(texts)
        completion = decode(list(ro.completion(b)))
        assert completion.startswith("".join(texts)), (b, texts, completion)  # each piece once, in order
        assert st.turns == st.tool_calls == len(texts) and not st.truncated
        if ro.finish_reasons[b] == "env":  # only past max_turns
            assert len(texts) == 8
    assert asked >= 4  # calls happened
    assert torch.equal(replay(model, ro), ro.mu)
    # the observation budget spent by the first call: the next trigger ends the episode, truncated
    env = Calls(lambda row, n: Turn(observation="=" * 9, tool_call=True))
    _, ro, _ = sample_rows(model, PROMPTS[8:] + PROMPTS[:2], env, EnvLimits(max_turns=8, max_turn_tokens=4,
                                                                            max_episode_tokens=4))
    for b, st in enumerate(ro.episodes):
        calls = sum(r == b for r, _ in env.asked)
        assert calls <= 1 and st.turns == st.tool_calls == calls and st.observation_tokens == 4 * calls
        if calls and ro.finish_reasons[b] == "env":
            assert st.truncated
    assert "env" in ro.finish_reasons
    assert torch.equal(replay(model, ro), ro.mu)


class Faulty(Calls):
    """A user environment with bugs: start raises for row 0; step raises at each row's first call,
    answers a str instead of a Turn at its second, an int observation at its third, then "=>"."""

    def start(self, record):
        if record["row"] == 0:
            raise KeyError("question")
        return record["row"]


def faulty_answer(row, n):
    if n == 0:
        raise ValueError(f"no tool for row {row}")
    return ["42", Turn(observation=7), Turn(observation="=>", tool_call=True)][min(n - 1, 2)]


def test_an_environments_faults_are_named_once_counted_and_stop_the_run(caplog):
    model = tiny(1)
    env = Faulty(faulty_answer)
    with caplog.at_level("WARNING", logger="rlt_mega.rollout.env.base"):
        _, ro, episodes = sample_rows(model, PROMPTS[8:] + PROMPTS[:2], env, EnvLimits(max_turns=8, max_errors=3))
    assert ro.episodes[0].faults == 1 and ro.finish_reasons[0] == "env"  # start failed: ended at its first trigger
    assert not any(r == 0 for r, _ in env.asked)
    for b, st in enumerate(ro.episodes[1:], 1):
        calls = sum(r == b for r, _ in env.asked)
        assert st.faults == min(calls, 3) and st.tool_errors == min(calls, 3), (b, calls, st)
    fs = forces(ro)  # the faults' answers are error observations
    assert any(f.ids == tuple(encode("error>>")) for f in fs) and any(f.ids == tuple(encode("=>")) for f in fs)
    assert torch.equal(replay(model, ro), ro.mu)
    warned = [r.getMessage() for r in caplog.records]
    name = f"{Faulty.__module__}:{Faulty.__qualname__}"
    for kind in ("start failed (KeyError: 'question')", "step failed (ValueError: no tool for row",
                 "step failed (TypeError: returned str '42', not a Turn)",
                 "step failed (TypeError: returned an observation of type int 7, not a str)"):
        assert sum(kind in w and name in w for w in warned) == 1, (kind, warned)  # each kind named once
    faults = sum(st.faults for st in ro.episodes)
    assert faults >= 4  # each kind at least once
    reason, hint = episodes[0].faults.over_limit(faults)  # what the trainer stops with
    assert reason.startswith(f"the environment grpo.env={name} failed {faults} times in one step, more than "
                             "grpo.max_env_errors=3 (")
    assert "start x1: KeyError: 'question'" in reason and "step x" in reason and ": ValueError: no tool" in reason
    assert ": TypeError: returned str '42', not a Turn" in reason and "of type int 7, not a str" in reason
    assert "max_env_errors (0: never stop)" in hint and "\n" not in reason + hint
    assert episodes[0].faults.over_limit(3) is None  # within the limit
    assert "(on another rank)" in episodes[0].faults.over_limit(4)[0]  # the counts started again
    assert EnvFaults(env, 0).over_limit(10**6) is None  # 0: never stop
    with pytest.raises(ValueError, match="max_errors=-1: must be >= 0"):
        EnvLimits(max_errors=-1)
    with pytest.raises(ValueError, match="time limit 0: must be > 0 seconds"):
        EnvLimits(time_limit_s=0)
