"""DeepSpeed bf16 (bf16 parameters, fp32 masters) trains: the loss of a repeated batch falls
under TP=2, ZeRO-2, PP=2 with ZeRO-1 and ZeRO-3."""

import pytest

BF16 = [("loss_falls", {"parallel": {"tp": 2, "zero_stage": 0}}),
        ("loss_falls", {"parallel": {"zero_stage": 2}}),
        ("loss_falls", {"parallel": {"pp": 2, "zero_stage": 1, "micro_batches": 2}}),
        ("loss_falls", {"parallel": {"zero_stage": 3}})]
SCENARIOS = {2: BF16}


@pytest.mark.parametrize("name,args", BF16)
def test_bf16_training_reduces_the_loss(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert r["dtype"] == "torch.bfloat16"
        assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]
