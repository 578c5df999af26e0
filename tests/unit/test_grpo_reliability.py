"""GRPO's bad cases in one update, sampling to loss: completions that never stop are cut at
the token limit and still scored; a reward function that raises scores 0, is logged with the
prompt id and counted; a group whose rewards are all equal has zero advantage, no division
by zero, and contributes no gradient, while the other groups still learn."""

import logging

import pytest
import torch

pytest.importorskip("rlt_mega.learner.grpo", reason="needs GRPO (branch rollout)")

from rlt_mega.config import ModelConfig  # noqa: E402
from rlt_mega.learner.grpo import group_advantages, grpo_loss  # noqa: E402
from rlt_mega.learner.logprob import dense_logprobs  # noqa: E402
from rlt_mega.model.rlt import build_model  # noqa: E402
from rlt_mega.rollout import SamplingParams, generate  # noqa: E402
from rlt_mega.rollout.rewards import score  # noqa: E402

V, G, MAX_NEW = 64, 4, 6
PROMPTS = {"p0": [1, 2, 3], "p1": [7, 8, 9, 10, 11]}


def decode(ids):
    return "".join(chr(65 + i % 26) for i in ids)


@pytest.fixture
def warnings():
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("rlt_mega")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def rollout_of_two_groups():
    model = build_model(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, memory_block=2,
                                    max_seq_len=32, init_std=0.1), seed=0)
    ids = [pid for pid in PROMPTS for _ in range(G)]  # the G completions of a prompt contiguous
    # No stop token or string: every completion runs into max_new_tokens.
    rollout = generate(model, [PROMPTS[pid] for pid in ids], SamplingParams(max_new_tokens=MAX_NEW),
                       seeds=list(range(len(ids))), pad_id=0)
    return model, ids, rollout


def test_cut_completions_failing_rewards_and_equal_groups(warnings):
    model, ids, rollout = rollout_of_two_groups()
    assert rollout.finish_reasons == ["length"] * len(ids) and rollout.completion_lens == [MAX_NEW] * len(ids)

    seen = []

    def reward(completion, answer):
        seen.append(completion)
        if answer == "p1":  # a reward bug that hits every completion of one prompt
            raise KeyError("no parser for this answer")
        return float(len(set(completion)))  # differs between the completions of p0

    texts = [decode(rollout.completion(b)) for b in range(len(ids))]
    rewards, failures, _ = score(texts, ids, ids, reward)
    assert seen == texts and all(len(t) == MAX_NEW for t in texts)  # cut, and still scored
    assert failures == G and rewards[G:] == [0.0] * G
    assert len({r for r in rewards[:G]}) > 1, "the test needs distinct rewards in group p0"
    assert sum("prompt p1" in w and "no parser for this answer" in w for w in warnings) == G

    advantages = group_advantages(torch.tensor(rewards), G)
    assert torch.isfinite(advantages).all()
    assert torch.equal(advantages[G:], torch.zeros(G))  # equal rewards: exactly zero, not 0/0

    logp = dense_logprobs(model, rollout)
    out = grpo_loss(logp, rollout.mu, advantages, rollout.mask)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)  # group p0 still learns

    # group p1 alone: zero loss and zero gradient
    model.zero_grad(set_to_none=True)
    rows = torch.arange(G, 2 * G)
    alone = grpo_loss(dense_logprobs(model, rollout)[rows], rollout.mu[rows], advantages[rows],
                      rollout.mask[rows])
    alone.loss.backward()
    assert alone.loss.item() == 0.0
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("value", [0.0, 1.0, -3.5])
def test_all_groups_equal_give_zero_loss_not_nan(value):
    model, ids, rollout = rollout_of_two_groups()
    advantages = group_advantages(torch.full((len(ids),), value), G)
    assert torch.equal(advantages, torch.zeros(len(ids)))
    out = grpo_loss(dense_logprobs(model, rollout), rollout.mu, advantages, rollout.mask)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
