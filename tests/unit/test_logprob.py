"""Learner log-probs: the hybrid's value is the replay and its gradient the dense one;
on-policy ratios are exactly 1; after an update replay tracks a fresh dense computation;
tokens outside the new policy's support are counted and never produce NaN."""

import dataclasses
import math

import pytest
import torch

from rlt_mega.config import ModelConfig
from rlt_mega.learner.grpo import group_advantages, grpo_loss
from rlt_mega.learner.logprob import dense_logprobs, hybrid_logprobs, mismatch_metrics, replay_logprobs
from rlt_mega.model.rlt import build_model
from rlt_mega.rollout import Processing, SamplingParams, generate

PROMPTS = [[1, 2, 3], [6, 7, 8, 9, 10], [3, 5, 7, 9, 11, 13], [4, 4]]


def tiny(C: int = 4, seed: int = 0):
    cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, memory_block=C, max_seq_len=48,
                      init_std=0.1)
    return build_model(cfg, seed=seed)


def rollout_of(model, dtype="fp32", processing=Processing(temperature=0.7, top_p=0.9), max_new=8):
    return generate(model, PROMPTS, SamplingParams(processing, max_new_tokens=max_new), seeds=[1, 2, 3, 4],
                    pad_id=0, dtype=dtype)


def loss_of(logp, rollout, rewards=(1.0, 0.0, 0.0, 1.0)):
    """The GRPO loss averaged over the completion tokens (the loss is a sum; engines divide)."""
    adv = group_advantages(torch.tensor(rewards), group_size=4)
    out = grpo_loss(logp, rollout.mu, adv, rollout.mask, eps_low=0.2, eps_high=0.28)
    out.loss = out.loss / rollout.num_completion_tokens()
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hybrid_value_is_replay_and_gradient_is_dense(dtype):
    model = tiny()
    rollout = rollout_of(model, dtype)
    params = [p for p in model.parameters()]
    replayed = replay_logprobs(model, rollout)
    dense = dense_logprobs(model, rollout)
    hybrid = hybrid_logprobs(dense, replayed)
    assert torch.equal(hybrid, replayed)
    # The gradient of a real loss through the hybrid equals the dense schedule's gradient
    # under the same upstream gradient (the loss's, evaluated at the replay values).
    got = torch.autograd.grad(loss_of(hybrid, rollout).loss, params, retain_graph=True)
    leaf = replayed.clone().requires_grad_()
    upstream = torch.autograd.grad(loss_of(leaf, rollout).loss, leaf)[0]
    want = torch.autograd.grad(dense, params, grad_outputs=upstream)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert any(g.abs().sum() > 0 for g in got)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_on_policy_ratios_are_exactly_one(dtype):
    model = tiny(C=1)
    rollout = rollout_of(model, dtype)
    hybrid = hybrid_logprobs(dense_logprobs(model, rollout), replay_logprobs(model, rollout))
    ratio = torch.exp(hybrid - rollout.mu)[rollout.mask]
    assert torch.equal(ratio, torch.ones_like(ratio))
    out = loss_of(hybrid, rollout)
    assert out.metrics["ratio_min"] == 1.0 and out.metrics["ratio_max"] == 1.0
    assert out.metrics["clipped"] == 0


def test_after_an_update_replay_moves_and_tracks_dense():
    model = tiny()
    rollout = rollout_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hybrid = hybrid_logprobs(dense_logprobs(model, rollout), replay_logprobs(model, rollout))
    loss_of(hybrid, rollout).loss.backward()
    opt.step()
    replayed = replay_logprobs(model, rollout)
    assert not torch.equal(replayed, rollout.mu)
    with torch.no_grad():
        fresh = dense_logprobs(model, rollout)
    mask = rollout.mask
    assert torch.equal(torch.isfinite(fresh[mask]), torch.isfinite(replayed[mask]))
    both = mask & torch.isfinite(fresh)
    assert (fresh - replayed)[both].abs().max() < 1e-5
    assert (replayed - rollout.mu)[both].abs().max() > 1e-4


def test_support_misses_are_counted_and_never_nan():
    """Tokens sampled at temperature 0.5 without filters, scored under a policy restricted to its
    top 2 tokens: many sampled tokens fall outside it (log-prob -inf, ratio 0), some inside."""
    model = tiny()
    rollout = rollout_of(model, processing=Processing(temperature=0.5), max_new=12)
    rollout.schedule = dataclasses.replace(rollout.schedule, processing=Processing(temperature=1.0, top_k=2))
    replayed = replay_logprobs(model, rollout)
    dense = dense_logprobs(model, rollout)
    mask = rollout.mask
    num_miss = int((torch.isneginf(replayed) & mask).sum())
    assert 0 < num_miss < int(mask.sum())
    ref = replayed.detach().clone()  # a reference that also misses some tokens
    hybrid = hybrid_logprobs(dense, replayed)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = grpo_loss(hybrid, rollout.mu, adv, mask, ref_logp=ref, kl_coef=0.1)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert int(out.metrics["support_miss"]) == num_miss and out.metrics["ratio_min"] == 0.0
    metrics = mismatch_metrics(rollout.mu, dense, replayed, mask)
    assert metrics["support_miss"] == pytest.approx(num_miss / int(mask.sum()))
    assert all(math.isfinite(v) for v in metrics.values())


def test_mismatch_metrics_by_hand():
    mu = torch.tensor([[-1.0, -2.0, 0.0]])
    dense = torch.tensor([[-1.5, float("-inf"), 0.0]])
    replay = torch.tensor([[-1.25, -2.0, 5.0]])
    mask = torch.tensor([[True, True, False]])
    m = mismatch_metrics(mu, dense, replay, mask)
    assert m["logprob_diff_max"] == 0.25 and m["logprob_diff_mean"] == 0.25  # only token 0 counts
    assert m["support_miss"] == 0.0 and m["support_miss_dense"] == 0.5
    log_r = -0.5  # dense - mu at token 0; k3 = r - 1 - log r
    assert m["kl_mu_dense"] == pytest.approx(math.exp(log_r) - 1 - log_r)
