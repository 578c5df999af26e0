"""Group advantages and the clipped GRPO loss against hand-computed values."""

import math

import pytest
import torch

from rlt_mega.learner.grpo import group_advantages, grpo_loss, k3_kl
from rlt_mega.learner.logprob import hybrid_logprobs

EPS = 1e-6


def test_grpo_advantages_group_of_four():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    std = math.sqrt((4 * 0.25) / 3)  # Bessel-corrected std of {1, 0, 0, 1}
    a = 0.5 / (std + EPS)
    assert torch.allclose(adv, torch.tensor([a, -a, -a, a]), rtol=0, atol=1e-7)


def test_advantages_of_two_groups_and_dr_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4)
    s1 = math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3)
    s2 = math.sqrt(2 / 3)
    want = [0.75 / (s1 + EPS), -0.25 / (s1 + EPS), -0.25 / (s1 + EPS), -0.25 / (s1 + EPS),
            1 / (s2 + EPS), -1 / (s2 + EPS), 0.0, 0.0]
    assert torch.allclose(adv, torch.tensor(want), rtol=0, atol=1e-6)
    dr = group_advantages(rewards, group_size=4, estimator="dr_grpo")
    assert torch.equal(dr, torch.tensor([0.75, -0.25, -0.25, -0.25, 1.0, -1.0, 0.0, 0.0]))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_equal_rewards_give_zero_advantage(estimator):
    adv = group_advantages(torch.tensor([2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0]), 4, estimator)
    assert torch.equal(adv, torch.zeros(8))


def test_advantage_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(torch.zeros(4), 4, "gae")
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)


def _case():
    """4 sequences x 2 tokens (the last token of row 3 is padding); mu = log 0.5."""
    ratios = torch.tensor([[1.0, 1.5], [0.5, 1.1], [0.7, 0.9], [1.3, 1.0]], dtype=torch.float64)
    mu = torch.full((4, 2), math.log(0.5), dtype=torch.float64)
    logp = (mu + ratios.log()).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, True], [True, True], [True, False]])
    return logp, mu, adv, mask


def test_clipped_surrogate_by_hand():
    logp, mu, adv, mask = _case()
    out = grpo_loss(logp, mu, adv, mask, eps_low=0.2, eps_high=0.28)
    # Per token min(r A, clip(r, 0.8, 1.28) A):
    #   row 0 (A=+1): r=1.0 -> 1.0;   r=1.5 -> 1.28 (clipped above, eps_high)
    #   row 1 (A=-1): r=0.5 -> -0.8 (clipped below, eps_low);   r=1.1 -> -1.1
    #   row 2 (A=+1): r=0.7 -> 0.7 (below 0.8 but A > 0: unclipped);   r=0.9 -> 0.9
    #   row 3 (A=-1): r=1.3 -> -1.3 (above 1.28 but A < 0: unclipped);   padding
    surrogate = 1.0 + 1.28 - 0.8 - 1.1 + 0.7 + 0.9 - 1.3
    assert out.loss.item() == pytest.approx(-surrogate, abs=1e-12)  # a sum: the engine divides
    assert out.metrics["clipped"] == 2 and out.metrics["num_tokens"] == 7
    assert out.metrics["ratio_min"].item() == pytest.approx(0.5)
    assert out.metrics["ratio_max"].item() == pytest.approx(1.5)
    out.loss.backward()
    # d/dlogp of -r A is -r A on unclipped tokens, 0 on clipped ones and padding.
    want = torch.tensor([[-1.0, 0.0], [0.0, 1.1], [-0.7, -0.9], [1.3, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp.grad, want, rtol=0, atol=1e-12)


def test_loss_is_a_sum_over_tokens_that_splits_by_rows():
    """The loss of a batch is the sum of its rows' losses (so an engine may accumulate batches
    and divide once by the step's global token count)."""
    logp, mu, adv, mask = _case()
    whole = grpo_loss(logp, mu, adv, mask).loss
    halves = grpo_loss(logp[:2], mu[:2], adv[:2], mask[:2]).loss + grpo_loss(logp[2:], mu[2:], adv[2:], mask[2:]).loss
    assert whole.item() == pytest.approx(halves.item(), abs=1e-12)
    assert grpo_loss(logp, mu, adv, torch.zeros_like(mask)).loss.item() == 0.0  # no tokens, nothing to divide


def test_kl_term_by_hand():
    logp, mu, adv, mask = _case()
    ref = (logp + 0.1).detach()
    base = grpo_loss(logp, mu, adv, mask, eps_low=0.2, eps_high=0.28)
    with_kl = grpo_loss(logp, mu, adv, mask, eps_low=0.2, eps_high=0.28, ref_logp=ref, kl_coef=0.5)
    k3 = math.exp(0.1) - 0.1 - 1
    assert (with_kl.loss - base.loss).item() == pytest.approx(0.5 * k3 * 7, abs=1e-12)
    assert with_kl.metrics["kl_sum"].item() == pytest.approx(7 * k3, abs=1e-12)
    g_base = torch.autograd.grad(base.loss, logp)[0]
    g_kl = torch.autograd.grad(with_kl.loss, logp)[0]
    # d k3 / d logp = 1 - exp(ref - logp)
    want = mask.double() * 0.5 * (1 - math.exp(0.1))
    assert torch.allclose(g_kl - g_base, want, rtol=0, atol=1e-12)
    # A token the reference cannot produce: the clamped estimate (as verl's low_var_kl), not inf.
    assert k3_kl(torch.tensor([0.0]), torch.tensor([float("-inf")])).item() == 10.0
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logp, mu, adv, mask, kl_coef=0.1)


def test_equal_rewards_give_zero_loss_and_gradient():
    logp, mu, _, mask = _case()
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0]), 4).double()
    out = grpo_loss(logp, mu, adv, mask)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))


def test_token_outside_support_has_ratio_zero():
    logp = torch.tensor([[float("-inf"), math.log(0.25)]], requires_grad=True)
    mu = torch.tensor([[math.log(0.1), math.log(0.25)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = grpo_loss(logp, mu, torch.tensor([-1.0]), mask, eps_low=0.2, eps_high=0.2)
    # token 0: min(0 * -1, 0.8 * -1) = -0.8 (no gradient); token 1: r = 1 -> -1
    assert out.loss.item() == pytest.approx(-(-0.8 - 1.0))
    out.loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 0] == 0 and logp.grad[0, 1] == pytest.approx(1.0)
    assert out.metrics["support_miss"] == 1 and out.metrics["ratio_min"] == 0


def test_hybrid_keeps_the_replay_bits_where_the_additive_trick_does_not():
    dense = torch.tensor([-17.3], requires_grad=True)
    replay = torch.tensor([-1.1920929e-07])
    additive = dense + (replay - dense).detach()
    assert not torch.equal(additive, replay)  # why docs/design.md forbids it
    hybrid = hybrid_logprobs(dense, replay)
    assert torch.equal(hybrid, replay)
    (hybrid * 3.0).sum().backward()
    assert dense.grad.item() == 3.0
