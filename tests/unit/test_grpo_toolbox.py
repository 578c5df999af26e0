"""The GRPO toolbox against hand-computed cases and against verl 0.9.1's own core_algos
(tests/verl_reference.py says how it is loaded): loss aggregation (agg_loss), the clipped
surrogate with dual-clip (compute_policy_loss_vanilla), GSPO (compute_policy_loss_gspo),
GRPO / Dr.GRPO / RLOO advantages (compute_grpo_outcome_advantage,
compute_rloo_outcome_advantage) and the k1 / k2 / k3 KL estimators (kl_penalty); the token
entropy against torch.distributions; the overlong penalty by hand."""

import math

import numpy as np
import pytest
import torch

from rlt_mega.learner.aggregation import LOSS_AGG_MODES, loss_count, loss_sum
from rlt_mega.learner.grpo import group_advantages, grpo_loss
from rlt_mega.learner.kl import kl_estimate
from rlt_mega.rollout.shaping import overlong_penalties
from tests.verl_reference import actor_config, core_algos

VERL_MODE = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
             "seq_mean_token_sum": "seq-mean-token-sum", "seq_mean_token_sum_norm": "seq-mean-token-sum-norm"}
VERL_KL = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def _losses():
    """3 rows of lengths 3, 1 and 2 (of N = 4)."""
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [-1.0, 5.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    return loss, mask


@pytest.mark.parametrize("mode,want", [("token_mean", (6 + 4 + 4) / 6), ("seq_mean_token_mean", (2 + 4 + 2) / 3),
                                       ("seq_mean_token_sum", (6 + 4 + 4) / 3),
                                       ("seq_mean_token_sum_norm", (6 + 4 + 4) / (3 * 8))])
def test_aggregation_by_hand(mode, want):
    loss, mask = _losses()
    assert float(loss_sum(loss, mask, mode)) / loss_count(mask, mode, length=8) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_matches_verl_on_one_and_two_ranks(mode):
    core = core_algos()
    loss, mask = _losses()
    ours = float(loss_sum(loss, mask, mode)) / loss_count(mask, mode, length=8)
    theirs = core.agg_loss(loss, mask.float(), VERL_MODE[mode], loss_scale_factor=8)
    assert ours == pytest.approx(float(theirs), rel=1e-7)
    # Two data-parallel ranks of 2 and 1 rows: verl's global normalisation (the mean over
    # ranks of loss * dp) and ours (the global sum over the global count) agree.
    global_tokens, global_seqs = int(mask.sum()), int((mask.sum(1) > 0).sum())
    shards = [(loss[:2], mask[:2]), (loss[2:], mask[2:])]
    verl_dp = sum(float(core.agg_loss(l, m.float(), VERL_MODE[mode], dp_size=2, batch_num_tokens=global_tokens,
                                      global_batch_size=global_seqs, loss_scale_factor=8)) for l, m in shards) / 2
    ours_dp = (sum(float(loss_sum(l, m, mode)) for l, m in shards)
               / sum(loss_count(m, mode, length=8) for _, m in shards))
    assert ours_dp == pytest.approx(verl_dp, rel=1e-7) and ours_dp == pytest.approx(ours, rel=1e-12)


def test_a_row_without_loss_tokens_is_not_a_sequence():
    loss, mask = _losses()
    mask = torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)])
    loss = torch.cat([loss, torch.ones(1, 4, dtype=torch.float64)])
    assert loss_count(mask, "seq_mean_token_mean") == 3 and loss_count(mask, "seq_mean_token_sum_norm", 5) == 15
    with pytest.raises(ValueError, match="loss_agg_length"):
        loss_count(mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        loss_sum(loss, mask, "token-mean")


def _policy_case(seed: int = 0, B: int = 6, N: int = 5):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, N, generator=g, dtype=torch.float64) * 3
    logp = (mu + torch.randn(B, N, generator=g, dtype=torch.float64) * 0.6).requires_grad_()
    adv = torch.tensor([1.5, -2.0, 0.5, -0.7, 1.0, -1.2], dtype=torch.float64)[:B]
    lens = torch.tensor([5, 3, 4, 1, 2, 5])[:B]
    mask = torch.arange(N)[None, :] < lens[:, None]
    return logp, mu, adv, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("clip_c", [None, 3.0, 1.5])
def test_clipped_surrogate_with_dual_clip_matches_verl(mode, clip_c):
    core = core_algos()
    logp, mu, adv, mask = _policy_case()
    out = grpo_loss(logp, mu, adv, mask, eps_low=0.2, eps_high=0.28, clip_ratio_c=clip_c, loss_agg=mode)
    ours = out.loss / loss_count(mask, mode, length=7)
    (g_ours,) = torch.autograd.grad(ours, logp)
    # verl's dual clip is always on; clip_ratio_c = 1e9 is "off" for these ratios.
    cfg = actor_config(0.2, 0.28, clip_ratio_c=clip_c or 1e9, loss_scale_factor=7)
    theirs, _ = core.compute_policy_loss_vanilla(mu, logp, adv[:, None].expand_as(mu), mask.double(), VERL_MODE[mode],
                                                 cfg)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    # rel 1e-7: verl's seq_mean_token_mean divides by n + 1e-8
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-7, abs=1e-12)
    assert torch.allclose(g_ours, g_theirs, rtol=1e-7, atol=1e-12)


def test_dual_clip_by_hand():
    """A = -1, ratio 5 >> 1 + eps: the plain clipped loss is -A * 5 = 5 (unbounded in r), the
    dual clip bounds it at -A * c = 3, a constant (no gradient)."""
    mu = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), math.log(5.0), dtype=torch.float64, requires_grad=True)
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool)
    plain = grpo_loss(logp, mu, adv, mask)
    assert float(plain.loss.detach()) == pytest.approx(5.0)
    dual = grpo_loss(logp, mu, adv, mask, clip_ratio_c=3.0)
    assert float(dual.loss.detach()) == pytest.approx(3.0) and float(dual.metrics["clipped"]) == 1
    (grad,) = torch.autograd.grad(dual.loss, logp)
    assert float(grad.abs().sum()) == 0.0


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "token_mean"])
def test_gspo_matches_verl(mode):
    core = core_algos()
    logp, mu, adv, mask = _policy_case(seed=1)
    logp = (mu + (logp.detach() - mu) * 0.01).requires_grad_()  # sequence ratios near 1: some inside the clip range
    out = grpo_loss(logp, mu, adv, mask, eps_low=3e-4, eps_high=4e-4, loss="gspo", loss_agg=mode)
    ours = out.loss / loss_count(mask, mode)
    (g_ours,) = torch.autograd.grad(ours, logp)
    theirs, _ = core.compute_policy_loss_gspo(mu, logp, adv[:, None].expand_as(mu), mask.double(), VERL_MODE[mode],
                                              actor_config(3e-4, 4e-4))
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-7)
    assert torch.allclose(g_ours, g_theirs, rtol=1e-7, atol=1e-14)
    assert 0 < float(out.metrics["clipped"]) < float(mask.sum())  # both branches exercised


def test_gspo_by_hand():
    """One sequence of two tokens with log-ratios 0.1 and 0.3: s = exp(0.2); A = 1 and a wide
    range: loss = -s, and d loss / d logp_t = -s / 2 for each token (seq_mean_token_mean)."""
    mu = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[0.1, 0.3]], dtype=torch.float64, requires_grad=True)
    out = grpo_loss(logp, mu, torch.ones(1, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool), eps_low=0.5,
                    eps_high=0.5, loss="gspo", loss_agg="seq_mean_token_mean")
    s = math.exp(0.2)
    assert float(out.loss.detach()) == pytest.approx(-s, rel=1e-12)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.allclose(grad, torch.full((1, 2), -s / 2, dtype=torch.float64))


def test_on_policy_ratios_are_exactly_one_for_every_policy_loss():
    _, mu, adv, mask = _policy_case()
    for loss in ("clip", "gspo"):
        out = grpo_loss(mu.clone().requires_grad_(), mu, adv, mask, loss=loss,
                        clip_ratio_c=3.0 if loss == "clip" else None)
        assert float(out.metrics["ratio_min"]) == 1.0 == float(out.metrics["ratio_max"])


def test_rloo_by_hand():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0]), 4, "rloo")
    want = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 3 - 5 / 3, 1 - 7 / 3, 2 - 2, 2 - 2]
    assert torch.allclose(adv, torch.tensor(want), atol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_advantages_match_verl(estimator):
    core = core_algos()
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 3, (5 * 4,), generator=g).float()
    rewards[4:8] = 1.0  # one group of equal rewards
    index = np.repeat(np.arange(5), 4)
    token_rewards = torch.zeros(20, 3)
    token_rewards[:, -1] = rewards  # an outcome reward on the last token
    mask = torch.ones(20, 3)
    if estimator == "rloo":
        theirs, _ = core.compute_rloo_outcome_advantage(token_rewards, mask, index)
    else:
        theirs, _ = core.compute_grpo_outcome_advantage(token_rewards, mask, index, epsilon=1e-6,
                                                        norm_adv_by_std_in_grpo=estimator == "grpo")
    ours = group_advantages(rewards, 4, estimator, eps=1e-6)
    assert torch.allclose(ours, theirs[:, 0], rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[4:8], torch.zeros(4))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_verl_and_hand(estimator):
    core = core_algos()
    logp = torch.tensor([[-1.0, -0.5, -3.0, -40.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -0.5, -2.0, -1.0]], dtype=torch.float64)
    ours = kl_estimate(logp, ref, estimator)
    assert torch.allclose(ours, core.kl_penalty(logp, ref, VERL_KL[estimator]), rtol=1e-12)
    d = logp - ref  # log(pi / ref)
    hand = {"k1": d, "k2": d ** 2 / 2, "k3": torch.clamp(torch.exp(-d) - 1 + d, max=10.0)}[estimator]
    assert torch.allclose(ours[:, :3], hand[:, :3], rtol=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_term_with_each_estimator(estimator):
    logp, mu, adv, mask = _policy_case()
    ref = mu - 0.1
    base = grpo_loss(logp, mu, adv, mask)
    out = grpo_loss(logp, mu, adv, mask, ref_logp=ref, kl_coef=0.5, kl_estimator=estimator)
    kl = torch.where(mask, kl_estimate(logp.detach(), ref, estimator), torch.zeros_like(mu)).sum()
    assert float((out.loss - base.loss).detach()) == pytest.approx(0.5 * float(kl), rel=1e-10)


def test_entropy_bonus_and_metric_against_torch_distributions():
    from rlt_mega.learner.logprob import dense_logprobs_and_entropy
    from rlt_mega.rollout.processing import Processing, process_logits
    from rlt_mega.rollout.sampler import Rollout, Schedule

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 11, (2, 6), generator=g)
    processing = Processing(temperature=0.7, top_k=6)
    schedule = Schedule(prompt_lens=[2, 3], memory_block=2, capacity=6, num_steps=5, encoder_calls=[],
                        processing=processing, dtype="fp32", pad_id=0, rows=None)  # (the record: unread here)
    rollout = Rollout(tokens, torch.zeros(2, 3), torch.tensor([[1, 1, 1], [1, 1, 0]]).bool(), [3, 2],
                      ["length", "stop_token"], schedule)
    _, entropy = dense_logprobs_and_entropy(logits, rollout)
    for b, (start, n) in enumerate([(1, 3), (2, 2)]):
        for j in range(n):
            dist = torch.distributions.Categorical(logits=process_logits(logits[b, start + j][None], processing)[0])
            assert float(entropy[b, j]) == pytest.approx(float(dist.entropy()), rel=1e-10)
    mu = torch.zeros(2, 3, dtype=torch.float64)
    plain = grpo_loss(mu, mu, torch.zeros(2, dtype=torch.float64), rollout.mask, entropy=entropy)
    bonus = grpo_loss(mu, mu, torch.zeros(2, dtype=torch.float64), rollout.mask, entropy=entropy, entropy_coef=0.1)
    assert float(bonus.loss - plain.loss) == pytest.approx(-0.1 * float(entropy[rollout.mask].sum()), rel=1e-10)
    assert float(plain.metrics["entropy_sum"]) == pytest.approx(float(entropy[rollout.mask].sum()), rel=1e-12)


def test_overlong_penalty_by_hand():
    """Budget 20, buffer 5: no penalty up to 15 tokens, then linear to -penalty at 20."""
    assert overlong_penalties([3, 15, 16, 18, 20], 20, 5, 1.0) == pytest.approx([0.0, 0.0, -0.2, -0.6, -1.0])
    assert overlong_penalties([20], 20, 5, 0.5) == [-0.5]
    assert overlong_penalties([20], 20, 0, 1.0) == [0.0]
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalties([1], 4, 5, 1.0)
