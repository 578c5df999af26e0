"""Low-rank adapters (issue 30): one GRPO step (two minibatches, the second off-policy) of the
trainer with model.lora under DP=2 ZeRO-1, -2 and -3, TP=2 (adapters split like their layer)
and PP=2, and two SFT (LM) steps under DP=2 ZeRO-2 and -3, equal the one-process steps with the
same adapters (fp32 tolerance); the on-policy ratio is exactly 1 (under ZeRO-3 the sampler and
the replay run on the gathered sampling copy, the learner on the partitioned module), only the
adapters train and are in the optimizer (its state holds no element of the frozen base), and the
base does not move."""

import pytest

TWO = [("lora_scenarios.lora_grpo_step", {"parallel": {"zero_stage": z}}) for z in (1, 2, 3)] + [
       ("lora_scenarios.lora_grpo_step", {"parallel": {"tp": 2, "zero_stage": 1}}),
       ("lora_scenarios.lora_grpo_step", {"parallel": {"pp": 2, "zero_stage": 1, "micro_batches": 2},
                                          "train": {"grad_accum": 2}})]
SFT = [("lora_scenarios.lora_sft_steps", {"parallel": {"zero_stage": z}}) for z in (2, 3)]
CHECKPOINTS = [("lora_scenarios.lora_checkpoint_round_trip", {"parallel": p, "shared": "{shared}"})
               for p in ({"tp": 2, "zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3})]
REPLAYS = [("lora_scenarios.lora_replay_exact", {"parallel": p, "dtype": dtype})
           for p in ({"tp": 2}, {"pp": 2, "micro_batches": 2}) for dtype in ("fp32", "bf16")]
SCENARIOS = {2: TWO + SFT + CHECKPOINTS + REPLAYS}


def only_adapters_optimised(r: dict) -> None:
    """Adam's state (over the data-parallel partitions) covers the adapters, padded at most by
    DeepSpeed's alignment, and no element of the frozen base."""
    assert r["adapter_numel"] <= r["optimizer_numel"] < r["adapter_numel"] + r["base_numel"] // 10, r


@pytest.mark.parametrize("name,args", TWO)
def test_a_lora_grpo_step_on_two_ranks_matches_one_process(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert r["onpolicy_dev"] == 0.0
        assert r["only_adapters_train"] and r["base_unchanged"]
        assert r["adapters"] > 0 and r["adapter_moved"] > 1e-3
        assert r["adapter_diff"] < 5e-5, r
        only_adapters_optimised(r)


@pytest.mark.parametrize("name,args", SFT)
def test_lora_sft_steps_under_zero_2_and_3_match_one_process(ranks, name, args):
    for r in ranks(2).each(name, args):
        for norm, ref in zip(r["norm"], r["ref_norm"]):
            assert norm == pytest.approx(ref, rel=1e-5)
        assert r["adapter_moved"] > 1e-3 and r["adapter_diff"] < 5e-5, r
        only_adapters_optimised(r)


@pytest.mark.parametrize("name,args", CHECKPOINTS)
def test_a_lora_checkpoint_holds_adapters_only_and_resumes_exactly(ranks, name, args):
    """DeepSpeed's files hold the adapters (the frozen base excluded), no consolidated full
    model; a resumed engine has the same adapters and takes the same next step; another base
    is refused."""
    for r in ranks(2).each(name, args):
        assert r["module_keys"] and all(k.endswith(("lora_A", "lora_B")) for k in r["module_keys"]), r["module_keys"]
        assert not r["consolidated"]
        assert r["loaded_equal"] and r["stepped_equal"]
        assert "trained on another base" in r["refused"]


@pytest.mark.parametrize("name,args", REPLAYS)
def test_lora_replay_is_mu_under_tp_and_pp(ranks, name, args):
    """Adapters with B != 0, split like their layers: the sampler ring's replay is torch.equal to
    mu (fp32 and bf16), and the rollout agrees with one process on the merged weights."""
    results = ranks(2).each(name, args)
    assert any(r["has_values"] for r in results)
    for r in results:
        assert r["exact"] and r["tokens"] > 0
        if args["dtype"] == "fp32":
            assert r["tokens_equal"] and r["mu_diff"] < 1e-4, r
