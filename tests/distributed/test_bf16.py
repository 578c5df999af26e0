"""DeepSpeed bf16 (bf16 parameters, fp32 masters): the loss of a repeated batch falls under
TP=2, ZeRO-2, PP=2 with ZeRO-1 and ZeRO-3; ZeRO-1/2/3 accumulate the micro-batches' bf16
gradients in fp32 (parallel.grad_accum_dtype, against references that accumulate in fp32 and in
bf16; tests/distributed/nccl_scenarios.py); and the pipeline hands its fp32 gradient sums to
DeepSpeed's fp32 accumulators exactly (three bf16 backwards) under ZeRO-1 and -2. And
train.bf16_cast=stochastic on every DeepSpeed bf16 optimizer (tests/distributed/precision_scenarios.py):
the copy is the stochastic one of the masters, the metrics are reported, a resume is exact."""

import pytest

BF16 = [("loss_falls", {"parallel": {"tp": 2, "zero_stage": 0}}),
        ("loss_falls", {"parallel": {"zero_stage": 2}}),
        ("loss_falls", {"parallel": {"pp": 2, "zero_stage": 1, "micro_batches": 2}}),
        ("loss_falls", {"parallel": {"zero_stage": 3}})]
N = "nccl_scenarios."
ACCUM = [(N + "bf16_accumulates_in_fp32", {"parallel": {"zero_stage": z}}) for z in (1, 2, 3)]
HANDOVER = [(N + "pipeline_handover_keeps_fp32", {"parallel": {"pp": 2, "zero_stage": z, "micro_batches": 2}})
            for z in (1, 2)]
CAST = [("precision_scenarios.stochastic_copy", {"parallel": p})
        for p in ({"tp": 2, "zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
                  {"pp": 2, "zero_stage": 1, "micro_batches": 2})]
SCENARIOS = {2: BF16 + ACCUM + HANDOVER + CAST}


@pytest.mark.parametrize("name,args", BF16)
def test_bf16_training_reduces_the_loss(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert r["dtype"] == "torch.bfloat16"
        assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]


@pytest.mark.parametrize("name,args", ACCUM)
def test_bf16_zero_accumulates_gradients_in_fp32(ranks, name, args):
    for r in ranks(2).each(name, args):
        # equal to fp32 accumulation of the same bf16 micro-batch gradients (up to the fp32
        # data-parallel mean), and measurably not bf16 accumulation
        assert r["diff_fp32_reference"] < 1e-6, r
        assert r["diff_bf16_reference"] > 1e-4, r


@pytest.mark.parametrize("name,args", HANDOVER)
def test_the_pipeline_hands_its_fp32_sums_to_deepspeed_exactly(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert r["pieces"] == 3 and r["params"] > 0
        assert r["sums_are_not_bf16"]  # so a bf16 hand-over would have changed them
        assert r["equal"], r


@pytest.mark.parametrize("name,args", CAST)
def test_stochastic_cast_on_every_deepspeed_optimizer(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert r["pairs_stochastic"] and r["params_stochastic"], r
        assert len(r["stale_fraction"]) == 3 and all(0.0 <= x <= 1.0 for x in r["stale_fraction"]), r
        assert all(x > 0 and x < float("inf") for x in r["copy_lag"]), r
        assert r["resumed_equal"] and r["num_tensors"] > 0, r
