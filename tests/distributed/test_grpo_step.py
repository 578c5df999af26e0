"""One GRPO step of the trainer (every phase, two minibatches: the second off-policy after the
first update) against a one-process GRPO step on the combined batch
(tests/distributed/grpo_scenarios.py): same tokens, mu, per-update loss and gradient norm
(clipping acts), parameters after the step, on-policy ratios exactly 1. On two ranks: DP=2
ZeRO-1, TP=2 (with the k3 KL to a reference built in the same layout), PP=2 (grad_accum 2,
the KL) and DP=2 ZeRO-3 with every parameter partitioned; on four: TP=2 x PP=2 (the KL) and
PP=2 x DP=2 ZeRO-2. The trainer's learner runs compaction and shared prompts (the defaults),
the reference the padded dense schedule (the encoder too: with shared prompts the trainer's
encodes each batch's prompt pack, every pipeline stage included); PP=2 once more with both off. With an
environment (observations inserted and masked out of the loss): TP=2 with the KL, PP=2. TP=2 x PP=2
once more with the head over chunks of positions (train.checkpointing.head_chunk)."""

import math

import pytest

TWO = [("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"zero_stage": 1}}),
       ("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"tp": 2, "zero_stage": 1}, "grpo": {"kl_coef": 0.1}}),
       ("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"pp": 2, "zero_stage": 1, "micro_batches": 2},
                                                  "train": {"grad_accum": 2}, "grpo": {"kl_coef": 0.1}}),
       ("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"zero_stage": 3}, "persistence_threshold": 0})]
FOUR = [("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"tp": 2, "pp": 2, "zero_stage": 1, "micro_batches": 2},
                                                   "train": {"grad_accum": 2}, "grpo": {"kl_coef": 0.1}}),
        ("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"pp": 2, "zero_stage": 2, "micro_batches": 2},
                                                   "train": {"grad_accum": 2}}),
        # the head over chunks of 7 positions (train.checkpointing.head_chunk): each chunk's vocab
        # shards gathered for the processing, on the last stage, against the one-process whole head
        ("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"tp": 2, "pp": 2, "zero_stage": 1, "micro_batches": 2},
                                                   "train": {"grad_accum": 2, "checkpointing": {"head_chunk": 7}},
                                                   "grpo": {"kl_coef": 0.1}})]
# An environment inside the rollouts (observations inserted, masked out of the loss): TP=2 with
# the KL, PP=2 with grad_accum 2
ENV = {"grpo": {"env": "tests.distributed.grpo_scenarios:EveryThird"},
       "sampling": {"check_every": 1, "max_new_tokens": 10}}
TWO += [("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"tp": 2, "zero_stage": 1},
                                                   "grpo": {**ENV["grpo"], "kl_coef": 0.1},
                                                   "sampling": ENV["sampling"]}),
        ("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"pp": 2, "zero_stage": 1, "micro_batches": 2},
                                                   "train": {"grad_accum": 2}, **ENV})]
# grpo.teacher (learner/distill.py): a larger teacher's scores and its top-5 (grpo.teacher_topk)
# under TP=2 and PP=2 (its three layers split 2 + 1) against the whole teacher on one process
TEACHER = [("grpo_scenarios.teacher_scores", {"parallel": {"tp": 2, "zero_stage": 1}, "grpo": {"teacher_topk": 5},
                                              "teacher_dir": "{shared}/teacher_tp2"}),
           ("grpo_scenarios.teacher_scores", {"parallel": {"pp": 2, "zero_stage": 1, "micro_batches": 2},
                                              "grpo": {"teacher_topk": 5}, "train": {"grad_accum": 2},
                                              "teacher_dir": "{shared}/teacher_pp2"})]
SCENARIOS = {2: TWO + TEACHER, 4: FOUR}


def check_grpo_step(r: dict, args: dict) -> None:
    """One rank's grpo_step_vs_reference against the one-process step."""
    assert r["same_tokens"]
    assert r["mu_diff"] <= 1e-5
    assert r["scalars"]["ratio/onpolicy_max_dev"] == 0.0  # every rank's first minibatch: exactly 1
    assert r["scalars"]["ratio/max"] > 1.0 + 1e-4  # the second minibatch is off-policy
    assert r["scalars"]["reward/mean"] == pytest.approx(r["ref_reward_mean"], abs=1e-12)
    assert r["ref_norm"][0] > 0.5  # grad_clip=0.5 acts: a wrong norm would change the update
    for norm, ref in zip(r["norm"], r["ref_norm"]):
        assert norm == pytest.approx(ref, rel=1e-5)
    for loss, ref in zip(r["loss"], r["ref_loss"]):
        assert loss == pytest.approx(ref, abs=1e-6)
    assert r["param_moved"] > 1e-3
    chunked = args.get("train", {}).get("checkpointing", {}).get("head_chunk", 0)
    assert (r["head_chunks"] > 0) == (chunked > 0 and r["last_stage"]), r["head_chunks"]
    # Adam's first steps divide by |g|: TP's reordered sums move tiny gradients' updates most
    assert r["param_diff"] < 5e-5, r["param_worst"]
    if args.get("grpo", {}).get("kl_coef"):
        assert r["scalars"]["kl/reference"] > 0.0
    if args.get("grpo", {}).get("env"):  # observations went in, the step matched all the same
        assert r["scalars"]["env/turns"] > 0.5 and r["scalars"]["env/observation_tokens"] > 1.0
        return
    steps, padded = r["row_steps"]  # the learner ran fewer decoder row-steps than the padded schedule
    assert steps < 0.8 * padded, r["row_steps"]
    # the encoder's prompt packs (on every stage under PP): fewer positions than the padded batch
    assert r["packs"] and all(total < padded for total, padded in r["packs"]), r["packs"]


@pytest.mark.parametrize("name,args", TWO)
def test_a_grpo_step_on_two_ranks_matches_one_process(ranks, name, args):
    for r in ranks(2).each(name, args):
        check_grpo_step(r, args)


@pytest.mark.parametrize("name,args", FOUR)
def test_a_grpo_step_on_four_ranks_matches_one_process(ranks, name, args):
    for r in ranks(4).each(name, args):
        check_grpo_step(r, args)


@pytest.mark.parametrize("name,args", TEACHER)
def test_teacher_scores_on_two_ranks_match_one_process(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert r["scalars"]["ratio/onpolicy_max_dev"] == 0.0  # the student's replay is mu with a teacher
        assert r["num_parts"] > 0
        if r["is_loss_rank"]:  # (the scores live where the loss is computed)
            assert r["num_scored"] == r["num_parts"] and r["tokens"] > 0
            assert r["teacher_diff_one_process"] <= 1e-5, r["teacher_diff_one_process"]
            assert r["topk_ids_equal"] and r["topk_diff_one_process"] <= 1e-5, r["topk_diff_one_process"]
            assert math.isfinite(r["scalars"]["distill/forward_kl_topk"])  # the forward-KL term (top-5)
        assert r["scalars"]["distill/reverse_kl"] != 0.0
