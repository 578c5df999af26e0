"""On-policy distillation (grpo.teacher, learner/distill.py): the per-token advantage and the
loss against an independent float64 computation (1e-12) and against verl 0.9.1's own pieces
(its distillation with use_policy_gradient: advantages = -kl_penalty(student, teacher, "kl"),
then compute_policy_loss_vanilla); a GRPO run with a teacher whose replay stays mu bit for bit
(ratio/onpolicy_max_dev 0) and whose teacher scores equal the teacher's own replay; observation
and padding tokens carry no loss; LoRA; a teacher of another vocabulary, or an export that does
not load, refused before step 1; a run with a teacher and the stochastic bf16 cast resumed mid-run
bit for bit. The top-k forward-KL term (grpo.teacher_topk): against a float64 computation (1e-12)
and verl 0.9.1's compute_forward_kl_topk; the teacher's top-k from the same replay as its scores;
bad values refused in one line naming the key."""

import json
import math

import pytest
import torch

from rlt_mega.checkpoint_tools.export import export_model
from rlt_mega.config import ConfigError, ModelConfig
from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.learner.aggregation import loss_count
from rlt_mega.learner.distill import DISTILL_FLOOR, distill_advantages, forward_kl_topk
from rlt_mega.learner.logprob import dense_logprobs_at, dense_logprobs_from_logits
from rlt_mega.learner.grpo import grpo_loss
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.rollout import replay
from rlt_mega.rollout.sampler import Sampler
from rlt_mega.train.grpo import build_trainer, grpo_config
from tests.distributed.grpo_scenarios import MODEL, grpo_cfg, odd, records
from tests.verl_reference import actor_config, core_algos, distillation_fsdp_losses

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


def _topk_case(seed=3, B=4, N=5, V=11, k=4, dtype=torch.float64):
    """Student logits (B, N, V), the teacher's top-k ids and log-probs (B, N, k), a mask (B, N)."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, N, V, generator=g, dtype=dtype) * 2
    top = torch.topk(torch.log_softmax(torch.randn(B, N, V, generator=g, dtype=dtype) * 2, -1), k, dim=-1)
    mask = torch.arange(N)[None, :] < torch.tensor([5, 2, 4, 0])[:B, None]
    return student, top.indices, top.values, mask


def test_forward_kl_topk_equals_a_float64_per_token_computation():
    logits, ids, teacher, mask = _topk_case()
    teacher[0, 1, -1] = -math.inf  # outside the teacher's kept set: p_T = 0 adds nothing
    logits[2, 0, ids[2, 0, 1]] = -60.0  # the student's log-prob below the floor: held at -DISTILL_FLOOR
    student = torch.log_softmax(logits, -1).gather(-1, ids).requires_grad_()
    ours = forward_kl_topk(student, teacher, mask)
    B, N, k = ids.shape
    for b in range(B):
        for t in range(N):
            want = 0.0
            for j in range(k):
                lt, ls = float(teacher[b, t, j]), float(student.detach()[b, t, j])
                if mask[b, t] and lt != -math.inf:
                    want += math.exp(lt) * (lt - max(ls, -DISTILL_FLOOR))
            assert float(ours.detach()[b, t]) == pytest.approx(want, rel=1e-12, abs=1e-12)
    (grad,) = torch.autograd.grad(ours.sum(), student)  # d F / d log p_S = -p_T where it is not held
    held = student.detach() < -DISTILL_FLOOR
    want = torch.where(mask[..., None] & torch.isfinite(teacher) & ~held, -teacher.exp(), torch.zeros_like(teacher))
    assert bool(held[2, 0, 1]) and torch.allclose(grad, want, rtol=1e-12, atol=0)


def test_forward_kl_topk_matches_verl():
    """verl 0.9.1 verl/trainer/distillation/fsdp/losses.py compute_forward_kl_topk (loss_mode
    forward_kl_topk, no clamp) on the same student logits and teacher top-k: the per-token loss and
    its gradient in the student's logits (verl computes its KL in float32: compared at float32's
    precision)."""
    from types import SimpleNamespace

    verl = distillation_fsdp_losses()
    logits, ids, teacher, mask = _topk_case(4, dtype=torch.float32)
    B, N, V = logits.shape
    cfg = SimpleNamespace(distillation_loss=SimpleNamespace(use_chunked_topk=False, log_prob_min_clamp=None))
    nested = lambda x: torch.nested.nested_tensor([x[b] for b in range(B)], layout=torch.jagged)  # noqa: E731
    theirs_in = logits.reshape(1, B * N, V).clone().requires_grad_()
    theirs = verl.compute_forward_kl_topk(theirs_in, nested(teacher), nested(ids), cfg, "thd")["distillation_losses"]
    ours_in = logits.clone().requires_grad_()
    ours = forward_kl_topk(torch.log_softmax(ours_in, -1).gather(-1, ids), teacher, torch.ones(B, N, dtype=torch.bool))
    assert torch.allclose(ours.reshape(1, -1), theirs, rtol=1e-6, atol=1e-6)
    (g_ours,) = torch.autograd.grad(ours.sum(), ours_in)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), theirs_in)
    assert torch.allclose(g_ours.reshape(1, B * N, V), g_theirs, rtol=1e-5, atol=1e-6)


def test_grpo_with_a_teacher_topk_adds_the_forward_kl_term(tmp_path):
    path = _export(tmp_path)
    trainer = _trainer(path, grpo={"teacher_topk": 3, "teacher_topk_coef": 0.5})
    seen = []
    original = trainer.engine.train_step
    trainer.engine.train_step = lambda batches, loss: seen.append((batches, loss)) or original(batches, loss)
    scalars = trainer.job.step(0)
    assert scalars["ratio/onpolicy_max_dev"] == 0.0  # the student's replay is still mu, bit for bit
    assert math.isfinite(scalars["distill/forward_kl_topk"]) and 0 < scalars["distill/teacher_topk_mass"] <= 1
    teacher_model = build_model(ModelConfig(**TEACHER), "cpu", seed=7)
    (batches, objective), = seen[:1]
    part = batches[0]["parts"][0]
    ro = part.rollout
    values, ids, lp = Sampler(teacher_model).replay_topk([ro], 3)[0]
    assert torch.equal(part.teacher, replay(teacher_model, ro)) and torch.equal(values, part.teacher)
    assert torch.equal(part.teacher_topk[0], ids) and torch.equal(part.teacher_topk[1], lp)
    mask = ro.mask.bool()
    assert bool((lp[mask][:, :-1] >= lp[mask][:, 1:]).all())  # descending
    # k = the whole vocabulary: the sampled token's entry is its score, and the mass is 1
    _, all_ids, all_lp = Sampler(teacher_model).replay_topk([ro], 260)[0]
    hit = (all_ids == ro.tokens.gather(1, completion_steps(ro) + 1)[..., None]) & mask[..., None]
    assert torch.equal(hit.sum(-1), mask.long()) and torch.equal(all_lp[hit], part.teacher[mask])
    assert torch.allclose(all_lp[mask].exp().sum(-1), torch.ones(int(mask.sum())), atol=1e-5)
    # the objective: the plain GRPO loss + coef * loss_sum(F) with the student's processed log-probs
    logits = torch.randn(ro.batch_size, ro.schedule.num_steps, 260, generator=torch.Generator().manual_seed(0))
    one = {"inputs": batches[0]["inputs"][:ro.batch_size], "parts": [part]}
    from rlt_mega.learner.aggregation import loss_sum
    from rlt_mega.loss import WHOLE_VOCAB

    with_term = objective.logits_loss(logits, one, WHOLE_VOCAB)
    saved, part.teacher_topk = part.teacher_topk, None
    without = objective.logits_loss(logits, one, WHOLE_VOCAB)
    student = dense_logprobs_at(logits, ro, saved[0])
    term = loss_sum(forward_kl_topk(student, saved[1], part.loss_mask()), part.loss_mask(), "token_mean")
    assert float(with_term - without) == pytest.approx(0.5 * float(term), rel=1e-5, abs=1e-6)
    first = dense_logprobs_at(logits, ro, ro.tokens.gather(1, completion_steps(ro) + 1)[..., None])[..., 0]
    assert torch.equal(first, dense_logprobs_from_logits(logits, ro))  # the same log-probs as the policy's


def completion_steps(ro):
    from rlt_mega.rollout.sampler import completion_positions

    return completion_positions(ro.schedule.prompt_lens, ro.completion_lens, ro.tokens.device)[0]


@pytest.mark.parametrize("grpo,key", [({"teacher_topk": -1}, "grpo.teacher_topk=-1"),
                                      ({"teacher_topk": 3, "teacher": None}, "grpo.teacher_topk=3 needs grpo.teacher"),
                                      ({"teacher_topk": 3, "teacher_topk_coef": -0.5}, "grpo.teacher_topk_coef=-0.5"),
                                      ({"teacher_topk": 300}, "grpo.teacher_topk=300 exceeds the vocabulary of 260")])
def test_bad_teacher_topk_values_are_refused_naming_the_key(tmp_path, grpo, key):
    path = _export(tmp_path)
    with pytest.raises(ConfigError) as err:
        _trainer(path, grpo=grpo)
    assert "\n" not in str(err.value) and key in str(err.value), str(err.value)
