"""The decoder-ring pipeline against one process: loss and every gathered gradient on two
stages with M = 1, 2, 4 micro-batches in flight (and two rounds of two), tied embeddings across
stages, checkpointing; on four ranks PP=4 (L=4), TP=2 x PP=2 and PP=2 x DP=2 with an uneven
split."""

import pytest

PP2 = [("gradients_vs_reference", {"parallel": {"pp": 2, "micro_batches": m}}) for m in (1, 2, 4)] + \
      [("gradients_vs_reference", {"parallel": {"pp": 2, "micro_batches": 2},  # two rounds of two
                                   "train": {"grad_accum": 4, "micro_batch_size": 2}})]
PP2_VARIANTS = [("gradients_vs_reference", {"model": {"tie_embeddings": True, "memory_block": 3},
                                            "parallel": {"pp": 2, "micro_batches": 2},
                                            "train": {"checkpointing": {"decoder": "step", "encoder": True}}})]
L4 = {"n_layers": 4}
FOUR = [("gradients_vs_reference", {"model": L4, "parallel": {"pp": 4, "micro_batches": m}}) for m in (1, 2, 4)] + \
       [("gradients_vs_reference", {"model": {"tie_embeddings": True, "qkv_bias": True},
                                    "parallel": {"tp": 2, "pp": 2, "micro_batches": 2}}),
        ("gradients_vs_reference", {"model": L4, "parallel": {"pp": 2, "pp_split": [3, 1], "micro_batches": 2}})]
SCENARIOS = {2: PP2 + PP2_VARIANTS, 4: FOUR}


@pytest.mark.parametrize("name,args", PP2 + PP2_VARIANTS)
def test_two_stage_ring_loss_and_gradients_equal_one_process(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert abs(r["loss"] - r["ref_loss"]) < 1e-6
        assert r["grad_diff"] < 1e-6, r["grad_worst"]
        if "tied_diff" in r:  # the tied copies on the first and last stage got the same gradient
            assert r["tied_diff"] == 0.0


@pytest.mark.parametrize("name,args", FOUR)
def test_four_rank_pipelines_loss_and_gradients_equal_one_process(ranks, name, args):
    for r in ranks(4).each(name, args):
        assert abs(r["loss"] - r["ref_loss"]) < 1e-6
        assert r["grad_diff"] < 1e-6, r["grad_worst"]
        if "tied_diff" in r:
            assert r["tied_diff"] == 0.0
