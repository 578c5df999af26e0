"""DeepSpeed ZeRO over the data-parallel group against one process on the combined batch:
ZeRO-0..3 on DP=2 (with DeepSpeed's gradient accumulation, tied copies on two stages), and on
four ranks TP=2 x PP=2 (ZeRO-0 and -2), PP=2 x DP=2 (ZeRO-1, -2) and TP=2 x DP=2 (ZeRO-3): the
gradient norm (clipping acts, so a wrong norm would change the update), the losses and the
parameters after three optimizer steps."""

import pytest

TWO = [("steps_vs_reference", {"parallel": {"zero_stage": z}, "optim": {"lr": 1e-3, "grad_clip": 0.5}})
       for z in (0, 1, 2, 3)] + \
      [("steps_vs_reference", {"parallel": {"zero_stage": 2, "micro_batches": 2},  # DeepSpeed accumulates 2
                               "optim": {"lr": 1e-3, "grad_clip": 0.3}, "train": {"grad_accum": 2}}),
       # tied copies on two stages: counted once in the norm, same weight decay, kept equal
       ("steps_vs_reference", {"model": {"tie_embeddings": True}, "parallel": {"pp": 2, "zero_stage": 1},
                               "optim": {"lr": 1e-3, "grad_clip": 0.5}})]
FOUR = [("steps_vs_reference", {"parallel": {"tp": 2, "pp": 2, "micro_batches": 2},
                                "optim": {"lr": 1e-3, "grad_clip": 0.5}}),
        ("steps_vs_reference", {"parallel": {"tp": 2, "pp": 2, "micro_batches": 2, "zero_stage": 2},
                                "model": {"tie_embeddings": True}, "optim": {"lr": 1e-3, "grad_clip": 0.5}})] + \
       [("steps_vs_reference", {"parallel": {"pp": 2, "zero_stage": z, "micro_batches": 2},
                                "optim": {"lr": 1e-3, "grad_clip": 0.3}, "train": {"grad_accum": 2}})
        for z in (1, 2)] + \
       [("steps_vs_reference", {"parallel": {"tp": 2, "zero_stage": 3}, "optim": {"lr": 1e-3, "grad_clip": 0.5}})]
SCENARIOS = {2: TWO, 4: FOUR}


def check_steps(r: dict, args: dict, with_losses: bool) -> None:
    assert r["ref_norm"][0] > args["optim"]["grad_clip"]  # clipping acts
    for norm, ref in zip(r["norm"], r["ref_norm"]):
        assert norm == pytest.approx(ref, rel=1e-5)
    if with_losses:
        for loss, ref in zip(r["loss"], r["ref_loss"]):
            assert loss == pytest.approx(ref, abs=1e-5)
    assert r["param_moved"] > 1e-3
    assert r["param_diff"] < 1e-5, r["param_worst"]


@pytest.mark.parametrize("name,args", TWO)
def test_zero_optimizer_steps_equal_one_process_on_the_combined_batch(ranks, name, args):
    for r in ranks(2).each(name, args):
        check_steps(r, args, with_losses=True)


@pytest.mark.parametrize("name,args", FOUR)
def test_optimizer_steps_on_four_rank_layouts_equal_one_process(ranks, name, args):
    for r in ranks(4).each(name, args):
        check_steps(r, args, with_losses=False)
