"""On-policy distillation (grpo.teacher, learner/distill.py): the per-token advantage and the
loss against an independent float64 computation (1e-12) and against verl 0.9.1's own pieces
(its distillation with use_policy_gradient: advantages = -kl_penalty(student, teacher, "kl"),
then compute_policy_loss_vanilla); a GRPO run with a teacher whose replay stays mu bit for bit
(ratio/onpolicy_max_dev 0) and whose teacher scores equal the teacher's own replay; observation
and padding tokens carry no loss; LoRA; a teacher of another vocabulary, or an export that does
not load, refused before step 1; a run with a teacher and the stochastic bf16 cast resumed mid-run
bit for bit."""

import json
import math

import pytest
import torch

from rlt_mega.checkpoint_tools.export import export_model
from rlt_mega.config import ConfigError, ModelConfig
from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.learner.aggregation import loss_count
from rlt_mega.learner.distill import DISTILL_FLOOR, distill_advantages
from rlt_mega.learner.grpo import grpo_loss
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.rollout import replay
from rlt_mega.train.grpo import build_trainer, grpo_config
from tests.distributed.grpo_scenarios import MODEL, grpo_cfg, odd, records
from tests.verl_reference import actor_config, core_algos

TEACHER = {**MODEL, "d_model": 48, "n_layers": 3, "ffn_hidden": 96}  # a larger RLT, the student's vocabulary


def _case(seed: int = 0, B: int = 5, N: int = 6):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, N, generator=g, dtype=torch.float64) * 3
    teacher = -torch.rand(B, N, generator=g, dtype=torch.float64) * 3
    logp = (mu + torch.randn(B, N, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    task = torch.randn(B, generator=g, dtype=torch.float64)
    lens = torch.tensor([6, 3, 4, 1, 0])[:B]
    mask = torch.arange(N)[None, :] < lens[:, None]
    return logp, mu, teacher, task, mask


def _float64_loss(logp, mu, teacher, task, mask, coef, eps_low=0.2, eps_high=0.28):
    """Token by token in Python floats: A = coef (teacher - mu) + (1 - coef) task, the clipped
    surrogate -min(r A, clip(r) A), the mean over the loss tokens."""
    total, count = 0.0, 0
    B, N = mu.shape
    for b in range(B):
        for t in range(N):
            if not mask[b, t]:
                continue
            a = coef * (float(teacher[b, t]) - float(mu[b, t])) + (1 - coef) * float(task[b])
            r = math.exp(float(logp[b, t]) - float(mu[b, t]))
            rc = min(max(r, 1 - eps_low), 1 + eps_high)
            total += -min(r * a, rc * a)
            count += 1
    return total / count


@pytest.mark.parametrize("coef", [1.0, 0.3, 0.0])
def test_distillation_loss_equals_a_float64_per_token_computation(coef):
    logp, mu, teacher, task, mask = _case()
    adv = distill_advantages(teacher, mu, task, mask, coef)
    assert adv.shape == mu.shape and bool((adv[~mask] == 0).all())  # no loss off the completion tokens
    out = grpo_loss(logp, mu, adv, mask, eps_low=0.2, eps_high=0.28, loss_agg="token_mean")
    ours = float(out.loss.detach()) / loss_count(mask, "token_mean")
    assert ours == pytest.approx(_float64_loss(logp, mu, teacher, task, mask, coef), rel=1e-12, abs=1e-12)


def test_distillation_matches_verl():
    """verl 0.9.1 (verl/trainer/distillation/losses.py, use_policy_gradient, loss_mode "kl"):
    distillation_losses = kl_penalty(student, teacher, "kl"), then the policy loss
    compute_policy_loss_vanilla with advantages = -distillation_losses; ``old_log_prob`` is the
    student's value, which here is mu."""
    core = core_algos()
    logp, mu, teacher, task, mask = _case(1)
    losses = core.kl_penalty(logprob=mu, ref_logprob=teacher, kl_penalty="kl")
    adv = distill_advantages(teacher, mu, task, mask, 1.0)
    assert torch.allclose(adv[mask], -losses[mask], rtol=0, atol=1e-15)
    out = grpo_loss(logp, mu, adv, mask, eps_low=0.2, eps_high=0.28, loss_agg="token_mean")
    ours = out.loss / loss_count(mask, "token_mean")
    (g_ours,) = torch.autograd.grad(ours, logp)
    cfg = actor_config(0.2, 0.28, clip_ratio_c=1e9, loss_scale_factor=7)
    theirs, _ = core.compute_policy_loss_vanilla(mu, logp, -losses.detach(), mask.double(), "token-mean", cfg)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12, abs=1e-14)
    assert torch.allclose(g_ours, g_theirs, rtol=1e-12, atol=1e-15)


def test_a_token_outside_the_teachers_support_is_held_at_the_floor():
    _, mu, teacher, task, mask = _case(2)
    teacher[0, 1] = -math.inf
    adv = distill_advantages(teacher, mu, task, mask, 1.0)
    assert float(adv[0, 1]) == -DISTILL_FLOOR and bool(torch.isfinite(adv).all())


def _export(tmp_path, name="teacher", seed=7, **model) -> str:
    cfg = ModelConfig(**{**TEACHER, **model})
    return str(export_model(build_model(cfg, "cpu", seed=seed), cfg, tmp_path / name))


def _trainer(teacher: str, tmp_path=None, train=None, grpo=None, model=None):
    """``model``: {config section: {field: value}} replaced after the GRPO config is built."""
    train = {"steps": 3, **(train or {})}
    if tmp_path is not None:
        train["resume"] = "auto"
    cfg = grpo_cfg({}, train, {"teacher": teacher, "prompts_per_step": 2, "group_size": 2, **(grpo or {})})
    if model:
        import dataclasses

        cfg = dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in model.items()})
    if tmp_path is not None:
        cfg.checkpoint.dir, cfg.logging.dir = str(tmp_path / "ckpt"), str(tmp_path / "log")
    cfg = grpo_config(cfg)
    return build_trainer(cfg, ParallelDims.single(cfg.model, "cpu"), load_tokenizer("byte"), odd, records(24), [])


@pytest.mark.parametrize("options", [{}, {"teacher_coef": 0.5, "policy_loss": "gspo"}], ids=["pure", "mixed-gspo"])
def test_grpo_with_a_teacher_keeps_replay_equal_to_mu_and_scores_with_the_teacher(tmp_path, options):
    path = _export(tmp_path)
    trainer = _trainer(path, grpo=options)  # grpo_cfg: verify_onpolicy, so a first replay != mu fails
    seen = []
    original = trainer.engine.train_step
    trainer.engine.train_step = lambda batches, loss: seen.append(batches) or original(batches, loss)
    teacher_model = build_model(ModelConfig(**TEACHER), "cpu", seed=7)
    for step in range(2):
        scalars = trainer.job.step(step)
        assert scalars["ratio/onpolicy_max_dev"] == 0.0
        assert scalars["distill/reverse_kl"] != 0.0 and math.isfinite(scalars["distill/reverse_kl"])
    parts = [p for batches in seen for b in batches for p in b["parts"]]
    assert parts and all(p.teacher is not None for p in parts)
    for p in parts[:2]:  # the teacher's scores: its own replay of the rollout
        assert torch.equal(p.teacher, replay(teacher_model, p.rollout))
        assert not torch.equal(p.teacher, p.rollout.mu)


def test_distillation_of_stale_samples_with_a_correction(tmp_path):
    """Bounded staleness with token_tis: the teacher scores the stale rollouts all the same, and the
    correction weighs the distillation's per-token advantages."""
    path = _export(tmp_path)
    trainer = _trainer(path, grpo={"max_staleness": 1, "is_correction": "token_tis", "verify_onpolicy": False})
    seen = []
    original = trainer.engine.train_step
    trainer.engine.train_step = lambda batches, loss: seen.append(batches) or original(batches, loss)
    for step in range(2):
        scalars = trainer.job.step(step)
    assert scalars["async/staleness_max"] == 1.0 and math.isfinite(scalars["train/loss"])
    assert math.isfinite(scalars["is/rho_mean"]) and math.isfinite(scalars["distill/reverse_kl"])
    stale = [p for b in seen[-1] for p in b["parts"]]
    assert stale and all(p.proximal is not None and p.teacher is not None for p in stale)
    teacher_model = build_model(ModelConfig(**TEACHER), "cpu", seed=7)
    assert torch.equal(stale[0].teacher, replay(teacher_model, stale[0].rollout))


def test_distillation_with_lora_and_an_environment(tmp_path):
    """LoRA: only the adapters learn; the environment's observation tokens carry no loss."""
    path = _export(tmp_path)
    from rlt_mega.config import LoraConfig

    trainer = _trainer(path, model={"model": {"lora": LoraConfig(rank=4)}, "sampling": {"check_every": 1}},
                       grpo={"env": "tests.distributed.grpo_scenarios:EveryThird"})
    seen = []
    original = trainer.engine.train_step
    trainer.engine.train_step = lambda batches, loss: seen.append(batches) or original(batches, loss)
    scalars = trainer.job.step(0)
    assert scalars["ratio/onpolicy_max_dev"] == 0.0 and math.isfinite(scalars["train/loss"])
    parts = [p for batches in seen for b in batches for p in b["parts"]]
    forced = sum(int((~p.rollout.mask.bool()[b, :n]).sum()) for p in parts
                 for b, n in enumerate(p.rollout.completion_lens))
    assert forced > 0  # observations were inserted, and the loss mask leaves them out
    for p in parts:
        adv = distill_advantages(p.teacher, p.rollout.mu, p.advantages, p.loss_mask(), 1.0)
        assert bool((adv[~p.loss_mask()] == 0).all())


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(tmp_path):
    path = _export(tmp_path, vocab_size=300)
    with pytest.raises(ConfigError) as err:
        _trainer(path)
    message = str(err.value)
    assert "\n" not in message and "300" in message and "model.vocab_size=260" in message and path in message


def test_a_teacher_with_its_own_other_tokenizer_is_refused(tmp_path):
    path = _export(tmp_path)
    (tmp_path / "teacher" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}, "added_tokens": []}))
    with pytest.raises(ValueError, match="grpo.teacher") as err:
        _trainer(path)
    assert "\n" not in str(err.value) and "data.tokenizer=byte" in str(err.value)


@pytest.mark.parametrize("damage", ["missing", "config", "tensor"])
def test_a_teacher_export_that_does_not_load_is_refused_before_step_one(tmp_path, damage):
    path = _export(tmp_path)
    teacher = tmp_path / "teacher"
    if damage == "missing":
        path = str(tmp_path / "nowhere")
    elif damage == "config":
        (teacher / "config.json").write_text("{not json")
    else:  # a tensor changed after export: its sha256 no longer matches
        from safetensors.torch import load_file, save_file

        f = next(teacher.glob("*.safetensors"))
        sd = load_file(f)
        k = next(iter(sd))
        sd[k] = sd[k] + 1
        save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="grpo.teacher=.* does not load") as err:
        _trainer(path)
    assert "\n" not in str(err.value)


def test_a_teacher_of_another_memory_block_is_refused(tmp_path):
    path = _export(tmp_path, memory_block=4)
    with pytest.raises(ConfigError, match="memory_block"):
        _trainer(path)


def test_resume_with_a_teacher_and_the_stochastic_cast_is_bit_for_bit(tmp_path):
    path = _export(tmp_path)
    train = {"dtype": "bf16", "bf16_cast": "stochastic", "log_every": 1, "steps": 2}
    whole = _trainer(path, tmp_path / "whole", train)
    whole.run()
    _trainer(path, tmp_path / "cut", {**train, "stop_after": 1}).run()
    resumed = _trainer(path, tmp_path / "cut", train)
    assert resumed.run()["step"] == 2
    a = {n: p.detach() for n, p in whole.engine.sampling_module().named_parameters()}
    b = {n: p.detach() for n, p in resumed.engine.sampling_module().named_parameters()}
    assert all(torch.equal(a[n], b[n]) for n in a)
    for run in ("whole", "cut"):
        lines = [json.loads(x) for x in (tmp_path / run / "log" / "metrics.jsonl").read_text().splitlines()]
        assert all(0 <= x["precision/stale_fraction"] <= 1 for x in lines if "train/loss" in x)

    def losses(run):
        lines = (tmp_path / run / "log" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["train/loss"] for x in lines if "train/loss" in x]

    assert losses("whole") == losses("cut") and len(losses("whole")) == 2
