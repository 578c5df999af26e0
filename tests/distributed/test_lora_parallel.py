"""Low-rank adapters (issue 30): one GRPO step (two minibatches, the second off-policy) of the
trainer with model.lora under DP=2 ZeRO-1, TP=2 (adapters split like their layer) and PP=2
equals the one-process step with the same adapters (fp32 tolerance); the on-policy ratio is
exactly 1, only the adapters train and the frozen base does not move."""

import pytest

TWO = [("lora_scenarios.lora_grpo_step", {"parallel": {"zero_stage": 1}}),
       ("lora_scenarios.lora_grpo_step", {"parallel": {"tp": 2, "zero_stage": 1}}),
       ("lora_scenarios.lora_grpo_step", {"parallel": {"pp": 2, "zero_stage": 1, "micro_batches": 2},
                                          "train": {"grad_accum": 2}})]
SCENARIOS = {2: TWO}


@pytest.mark.parametrize("name,args", TWO)
def test_a_lora_grpo_step_on_two_ranks_matches_one_process(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert r["onpolicy_dev"] == 0.0
        assert r["only_adapters_train"] and r["base_unchanged"]
        assert r["adapters"] > 0 and r["adapter_moved"] > 1e-3
        assert r["adapter_diff"] < 5e-5, r
