"""The GRPO toolbox on two gloo ranks (tests/distributed/grpo_scenarios.py): for every loss
aggregation mode a DP=2, grad_accum=2 step (ZeRO-1) matches the one-process step on the
combined batch (per-update loss, gradient norm, parameters), as the normalisation is the
step's, over every batch and replica; and dynamic sampling on DP=2 learns from
prompts_per_step informative groups per replica with on-policy ratios exactly 1, on DP=2 and
on the PP=2 ring."""

import pytest

from tests.distributed.test_grpo_step import check_grpo_step

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
AGG = [("grpo_scenarios.grpo_step_vs_reference",
        {"parallel": {"zero_stage": 1}, "train": {"grad_accum": 2}, "grpo": {"loss_agg": mode}}) for mode in MODES]
DYNAMIC = ("grpo_scenarios.dynamic_sampling_step", {"parallel": {"zero_stage": 1}})
DYNAMIC_PP = ("grpo_scenarios.dynamic_sampling_step", {"parallel": {"pp": 2, "zero_stage": 1, "micro_batches": 2}})
SCENARIOS = {2: AGG + [DYNAMIC, DYNAMIC_PP]}


@pytest.mark.parametrize("name,args", AGG, ids=MODES)
def test_step_loss_is_the_same_on_dp2_with_grad_accum_for_every_aggregation(ranks, name, args):
    for r in ranks(2).each(name, args):
        check_grpo_step(r, args)


def test_dynamic_sampling_on_two_replicas(ranks):
    for r in ranks(2).each(*DYNAMIC):
        s = r["scalars"]
        assert s["sampling/groups_kept"] == 2 * r["dp"]  # prompts_per_step = 2 per replica
        assert s["sampling/groups_dropped"] >= 1
        assert s["ratio/onpolicy_max_dev"] == 0.0
        assert sum(r["kept_rows"]) == 2 * 4  # this replica's minibatches: 2 groups x G = 4 rows


def test_dynamic_sampling_on_the_pipeline_ring(ranks):
    """PP=2: the stacked parts of a batch run through the ring as one micro-batch each."""
    for r in ranks(2).each(*DYNAMIC_PP):
        s = r["scalars"]
        assert s["sampling/groups_kept"] == 2 and s["sampling/groups_dropped"] >= 1
        assert s["ratio/onpolicy_max_dev"] == 0.0
