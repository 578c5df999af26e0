"""The off-policy corrections (grpo.is_correction, learner/correction.py) against hand-computed
cases and against verl 0.9.1's own rollout_corr_helper (compute_rollout_correction_weights,
compute_rollout_rejection_mask) and compute_policy_loss_vanilla / _gspo with its
rollout_is_weights; on the real trainer: a stale step with a correction replays its proximal
policy (ratio exactly 1 on the first minibatch) and logs rho and the weights."""

import math

import pytest
import torch

from rlt_mega.config import ConfigError
from rlt_mega.learner.aggregation import loss_count
from rlt_mega.learner.correction import Correction, is_weights
from rlt_mega.learner.grpo import grpo_loss
from tests.unit.test_async_grpo import trainer_for
from tests.unit.test_grpo_toolbox import VERL_MODE
from tests.verl_reference import actor_config, core_algos, rollout_corr_helper


def _hand_case():
    """rho = pi_old / mu: row 0 (3, 0.25, 1), row 1 (1.5, 0 (pi_old = -inf), pad), row 2 (4, 4, 1)."""
    mu = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0], [-0.3, -0.2, -0.1]], dtype=torch.float64)
    rho = torch.tensor([[3.0, 0.25, 1.0], [1.5, 0.0, 1.0], [4.0, 4.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    return mu + torch.log(rho), mu, mask


@pytest.mark.parametrize("mode,want", [
    ("token_tis", [[2.0, 0.25, 1.0], [1.5, 0.0, 0.0], [2.0, 2.0, 1.0]]),  # min(rho, 2), 0 off the mask
    ("token_mask", [[0, 0, 1], [1, 0, 0], [0, 0, 1]]),  # rho in [0.5, 2]
    # geometric means: 0.75^(1/3) = 0.909 kept; row 1 holds a 0; 16^(1/3) = 2.52 > 2
    ("seq_mask", [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),
])
def test_weights_by_hand(mode, want):
    proximal, mu, mask = _hand_case()
    w = is_weights(proximal, mu, mask, Correction(mode, cap=2.0, band_low=0.5, band_high=2.0))
    assert torch.allclose(w, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert not w.requires_grad


def test_an_unmoved_policy_makes_every_correction_the_identity():
    g = torch.Generator().manual_seed(1)
    mu = -torch.rand(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    for mode in ("token_tis", "token_mask", "seq_mask"):
        assert torch.equal(is_weights(mu.clone(), mu, mask, Correction(mode)), mask.float())


def _random_log_ratio(seed: int = 0, B: int = 8, N: int = 9):
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(B, N, generator=g) * 0.9
    lens = torch.tensor([9, 1, 4, 7, 2, 9, 5, 3])[:B]
    mask = torch.arange(N)[None, :] < lens[:, None]
    return log_ratio, mask


@pytest.mark.parametrize("cap", [1.5, 2.0, 5.0])
def test_token_tis_is_verls_token_is(cap):
    helper = rollout_corr_helper()
    log_ratio, mask = _random_log_ratio()
    theirs, _ = helper.compute_rollout_correction_weights(log_ratio, mask.float(), rollout_is="token",
                                                          rollout_is_threshold=cap)
    ours = is_weights(log_ratio, torch.zeros_like(log_ratio), mask, Correction("token_tis", cap=cap))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("low,high", [(0.5, 2.0), (0.8, 1.25), (0.25, 1.5)])
@pytest.mark.parametrize("mode,verl_option", [("token_mask", "token_k1"), ("seq_mask", "seq_mean_k1")])
def test_band_masks_are_verls_k1_rejection(low, high, mode, verl_option):
    helper = rollout_corr_helper()
    for seed in range(3):
        log_ratio, mask = _random_log_ratio(seed)
        # verl's k1 is log(mu / pi_old) = -log rho: the band [low, high] of rho is [1/high, 1/low] of its k1
        theirs, _ = helper.compute_rollout_rejection_mask(log_ratio, mask.float(), rollout_rs=verl_option,
                                                          rollout_rs_threshold=f"{1 / high}_{1 / low}")
        ours = is_weights(log_ratio, torch.zeros_like(log_ratio), mask, Correction(mode, band_low=low, band_high=high))
        assert torch.equal(ours, theirs)
        assert 0 < float(ours.sum()) < float(mask.sum())  # the case rejects some, keeps some


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("loss", ["clip", "gspo"])
def test_weighted_policy_loss_matches_verl(mode, loss):
    """The loss against the proximal policy, weighted by the truncated IS weights, and its gradient."""
    core = core_algos()
    g = torch.Generator().manual_seed(3)
    B, N = 6, 5
    mu = -torch.rand(B, N, generator=g, dtype=torch.float64) * 3
    proximal = mu + torch.randn(B, N, generator=g, dtype=torch.float64) * 0.5
    logp = (proximal + torch.randn(B, N, generator=g, dtype=torch.float64) * 0.2).requires_grad_()
    adv = torch.tensor([1.5, -2.0, 0.5, -0.7, 1.0, -1.2], dtype=torch.float64)
    mask = torch.arange(N)[None, :] < torch.tensor([5, 3, 4, 1, 2, 5])[:, None]
    w = is_weights(proximal, mu, mask, Correction("token_tis", cap=1.5))
    eps = (3e-4, 4e-4) if loss == "gspo" else (0.2, 0.28)
    out = grpo_loss(logp, proximal, adv, mask, eps_low=eps[0], eps_high=eps[1], loss=loss, loss_agg=mode, is_weights=w)
    ours = out.loss / loss_count(mask, mode)
    (g_ours,) = torch.autograd.grad(ours, logp)
    fn = core.compute_policy_loss_gspo if loss == "gspo" else core.compute_policy_loss_vanilla
    theirs, _ = fn(proximal, logp, adv[:, None].expand_as(mu), mask.double(), VERL_MODE[mode],
                   actor_config(eps[0], eps[1], clip_ratio_c=1e9, loss_scale_factor=N), rollout_is_weights=w)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-7, abs=1e-12)
    assert torch.allclose(g_ours, g_theirs, rtol=1e-7, atol=1e-12)
    assert float(w.min()) < 1.0 and float(w[mask].max()) == 1.5  # the weights act, the cap binds


def test_a_proximal_support_miss_carries_no_loss():
    """pi_old = -inf at a token (outside its top-k) while pi_theta is finite: the token is a
    support miss (ratio 0, weight 0), never inf * 0 = nan."""
    mu = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    proximal = torch.tensor([[-1.0, -math.inf]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    w = is_weights(proximal, mu, mask, Correction("token_tis"))
    out = grpo_loss(logp, proximal, torch.tensor([1.0], dtype=torch.float64), mask, is_weights=w)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.equal(w, torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    assert float(out.loss.detach()) == -1.0 and float(out.metrics["support_miss"]) == 1.0 and torch.isfinite(grad).all()


def test_a_stale_step_learns_against_its_proximal_policy():
    trainer = trainer_for({"max_staleness": 1, "is_correction": "seq_mask", "minibatches": 2, "verify_onpolicy": True})
    first = trainer.job.step(0)  # lag 0: no proximal replay, no is/ metrics
    assert "is/rho_mean" not in first and first["ratio/onpolicy_max_dev"] == 0.0
    stale = trainer.job.step(1)  # lag 1: the first minibatch's ratio is against pi_old, exactly 1
    # verified against the version that sampled it (0); the policy moved since (rho = pi_old / mu)
    assert stale["async/staleness_max"] == 1.0 and stale["ratio/onpolicy_max_dev"] == 0.0
    assert stale["is/rho_min"] < 1.0 < stale["is/rho_max"]  # the policy moved since the samples were drawn
    assert stale["ratio/policy_change_max_dev"] == max(1.0 - stale["is/rho_min"], stale["is/rho_max"] - 1.0)
    assert 0.0 < stale["is/weight_mean"] <= 1.0
    assert stale["is/rejected_fraction"] == pytest.approx(1.0 - stale["is/weight_mean"])
    uncorrected = trainer_for({"max_staleness": 1, "minibatches": 2})
    uncorrected.job.step(0)
    unchecked = uncorrected.job.step(1)
    assert unchecked["ratio/policy_change_max_dev"] > 0.0  # against mu: the staleness shows
    assert "ratio/onpolicy_max_dev" not in unchecked  # nothing replayed under the sampling version


def test_a_correction_without_staleness_is_refused():
    with pytest.raises(ConfigError, match=r"grpo\.is_correction='token_tis' .*set grpo\.max_staleness >= 1"):
        trainer_for({"is_correction": "token_tis"})
    with pytest.raises(ConfigError, match=r"grpo\.is_correction='tis'"):
        trainer_for({"max_staleness": 1, "is_correction": "tis"})


def test_a_stale_step_that_keeps_no_row_still_reports_its_correction():
    """Dynamic sampling with groups that all score alike keeps no row: the step's batches carry
    no loss and no proximal replay, and the correction's metrics reduce over no tokens (rho 1)."""
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.train.grpo import build_trainer, grpo_config
    from tests.distributed.grpo_scenarios import grpo_cfg, records
    from tests.unit.test_async_grpo import LAYOUT

    cfg = grpo_config(grpo_cfg({}, {"steps": 2}, {**LAYOUT, "max_staleness": 1, "is_correction": "token_tis",
                                                  "dynamic_sampling": True, "max_sampling_rounds": 1}))
    trainer = build_trainer(cfg, ParallelDims.single(cfg.model, "cpu"), load_tokenizer("byte"),
                            lambda completion, answer: 0.0, records(24), [])
    trainer.job.step(0)
    stale = trainer.job.step(1)
    assert stale["sampling/groups_kept"] == 0.0 and stale["train/loss"] == 0.0
    assert (stale["is/rho_min"], stale["is/rho_max"], stale["is/weight_mean"]) == (1.0, 1.0, 0.0)
