"""The GRPO options on the real trainer (one process, every phase): dynamic sampling keeps
prompts_per_step informative groups out of several rounds, a step whose rounds find none
still runs and says so, the exactness contract (on-policy ratios exactly 1, fp32 and bf16)
holds with every new option on, and one process's step loss does not depend on grad_accum
under any aggregation mode."""

import logging

import pytest
import torch

from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.learner.aggregation import LOSS_AGG_MODES
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.train.grpo import build_trainer, grpo_config
from tests.distributed.grpo_scenarios import grpo_cfg, odd, records

LETTERS = list("abcdefghijklmnopqrstuvwxyz")  # stop strings: about one completion in ten per token ends


def constant_for_most(completion: str, answer) -> float:
    """Constant (1.0) for two prompts in three, the odd-character fraction for the others."""
    return odd(completion, answer) if int(answer.split()[-1]) % 3 == 0 else 1.0


def always_one(completion: str, answer) -> float:
    return 1.0


def run_step(grpo: dict, reward=odd, train: dict | None = None, sampling: dict | None = None, steps: int = 1):
    """The scalars of the last of ``steps`` GRPO steps, and every (batches, stats) the engine saw."""
    cfg = grpo_cfg({}, train, grpo)
    if sampling:
        import dataclasses

        cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, **sampling))
    cfg = grpo_config(cfg)
    dims = ParallelDims.single(cfg.model, "cpu")
    trainer = build_trainer(cfg, dims, load_tokenizer("byte"), reward, records(30), [])
    seen = []
    original = trainer.engine.train_step

    def spy(batches, loss):
        stats = original(batches, loss)
        seen.append((batches, stats))
        return stats

    trainer.engine.train_step = spy
    for step in range(steps):
        scalars = trainer.job.step(step)
    return scalars, seen


def test_dynamic_sampling_learns_from_prompts_per_step_informative_groups():
    G = 4
    scalars, seen = run_step({"dynamic_sampling": True, "max_sampling_rounds": 6, "prompts_per_step": 2,
                              "group_size": G}, constant_for_most)
    assert scalars["sampling/groups_kept"] == 2 and scalars["sampling/groups_dropped"] >= 1
    assert scalars["sampling/prompts_drawn"] == 2 * scalars["sampling/rounds"] >= 4
    assert scalars["ratio/onpolicy_max_dev"] == 0.0  # every kept batch of the first minibatch: exactly 1
    assert len(seen) == 2 and all(len(b) == 1 for b, _ in seen)  # the engine steps over grad_accum batches
    kept_rows = 0
    for batches, stats in seen:
        for part in batches[0]["parts"]:
            rows = part.rows.view(-1, G)
            assert (rows.all(1) | ~rows.any(1)).all()  # whole groups are kept or dropped
            for keep, adv in zip(rows.unbind(0), part.advantages.view(-1, G).unbind(0)):
                if keep.all():
                    assert adv.abs().max() > 0  # a kept group is informative
            kept_rows += int(part.rows.sum())
    assert kept_rows == 2 * G


def test_dynamic_sampling_that_finds_nothing_still_steps(caplog):
    with caplog.at_level(logging.WARNING, logger="rlt_mega"):
        scalars, seen = run_step({"dynamic_sampling": True, "max_sampling_rounds": 2}, always_one)
    assert scalars["sampling/groups_kept"] == 0 and scalars["sampling/rounds"] == 2
    assert any("kept 0 informative groups" in r.getMessage() for r in caplog.records)
    assert all(s.loss == 0.0 for _, s in seen)


EVERY_OPTION = [
    {"policy_loss": "clip", "clip_ratio_c": 3.0, "advantage": "rloo", "kl_coef": 0.1, "kl_estimator": "k2",
     "kl_in_reward": True, "entropy_coef": 0.01, "dynamic_sampling": True, "mask_truncated": True,
     "overlong_buffer": 4, "loss_agg": "seq_mean_token_sum_norm", "eps_high": 0.28},
    {"policy_loss": "gspo", "advantage": "dr_grpo", "kl_coef": 0.1, "kl_estimator": "k1", "entropy_coef": 0.01,
     "dynamic_sampling": True, "overlong_buffer": 4, "overlong_penalty": 0.5, "loss_agg": "seq_mean_token_mean"},
]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("options", EVERY_OPTION, ids=["clip", "gspo"])
def test_every_option_keeps_on_policy_ratios_exactly_one(options, dtype):
    # Two steps: at the first the reference is the policy itself, so a KL in the reward is 0.
    scalars, seen = run_step(options, train={"dtype": dtype},
                             sampling={"max_new_tokens": 12, "stop_strings": LETTERS}, steps=2)
    assert scalars["ratio/onpolicy_max_dev"] == 0.0
    assert scalars["ratio/max"] > 1.0 or scalars["ratio/min"] < 1.0  # later minibatches are off-policy
    assert all(torch.isfinite(torch.tensor(s.loss)) for _, s in seen)
    assert scalars["policy/entropy"] > 0.0 and scalars["reward/overlong_penalty"] < 0.0
    tokens = sum(int(p.loss_mask().sum()) for b, _ in seen for batch in b for p in batch["parts"])
    assert tokens > 0  # the check is not vacuous: rows carried loss
    if options.get("kl_in_reward"):
        assert scalars["kl/reward_penalty"] != 0.0 and "kl/reference" not in scalars
        assert all(p.ref is None for b, _ in seen for batch in b for p in batch["parts"])
        for b, _ in seen:  # mask_truncated: no row cut at max_new_tokens carries loss
            for p in (p for batch in b for p in batch["parts"]):
                cut = torch.tensor([f == "length" for f in p.rollout.finish_reasons])
                assert not (p.rows & cut).any()
    else:
        assert scalars["kl/reference"] != 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_one_process_step_loss_does_not_depend_on_grad_accum(mode):
    """The first minibatch of a grad_accum=2 step (two rollout batches), learned by fresh
    engines as two batches and as one (both parts stacked in one dense call): the same loss
    and gradient norm, as the normalisation is the step's."""
    from rlt_mega.learner.objective import GRPOObjective, grpo_batch
    from rlt_mega.train.builders import build_engine
    from rlt_mega.train.grpo import engine_config, loss_settings

    _, seen = run_step({"loss_agg": mode}, train={"grad_accum": 2})
    batches, stats = seen[0]
    parts = [p for b in batches for p in b["parts"]]
    assert len(batches) == 2 and len(parts) == 2
    cfg = grpo_config(grpo_cfg({}, {"grad_accum": 2}, {"loss_agg": mode}))
    objective = GRPOObjective(settings=loss_settings(cfg))
    losses = []
    for layout in ([grpo_batch([parts[0]]), grpo_batch([parts[1]])], [grpo_batch(parts)]):
        engine = build_engine(cfg, ParallelDims.single(cfg.model, "cpu"), engine_config(cfg))
        losses.append(engine.train_step(layout, objective))
    for s in losses:
        assert s.loss == pytest.approx(stats.loss, rel=1e-6) and s.grad_norm == pytest.approx(stats.grad_norm, rel=1e-5)
        assert s.num_tokens == stats.num_tokens


def test_periodic_eval_reports_sampled_figures_by_k_and_n():
    import dataclasses

    from rlt_mega.config import EvalConfig

    cfg = grpo_cfg({}, None, {"eval_size": 3})
    cfg = grpo_config(dataclasses.replace(cfg, eval=EvalConfig(samples=3, k=[1, 2], temperature=1.0)))
    trainer = build_trainer(cfg, ParallelDims.single(cfg.model, "cpu"), load_tokenizer("byte"), odd, records(8),
                            records(5))
    out = trainer.job.evaluate(0)
    assert set(out) == {"eval/accuracy", "eval/pass@1_n3", "eval/pass@2_n3", "eval/maj@1_n3", "eval/maj@2_n3",
                        "eval/mean@3"}
    assert all(0.0 <= v <= 1.0 for v in out.values())
    assert out["eval/pass@2_n3"] >= out["eval/pass@1_n3"] == pytest.approx(out["eval/mean@3"])
