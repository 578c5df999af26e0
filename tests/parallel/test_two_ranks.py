"""Two gloo ranks against the single-process reference (one launch runs every scenario; see
tests/parallel/scenarios.py): TP=2, PP=2 with M = 1, 2, 4, ZeRO-0..3 on DP=2, bf16, and
layouts that do not fit; and (tests/parallel/nccl_scenarios.py) the messages the sampler and
training rings really post against the descriptions the NCCL simulation checks, fp32 gradient
accumulation of bf16 ZeRO-1/2/3, and the pipeline's fp32 hand-over to DeepSpeed.

Every point-to-point tag is 0 in this launch (launch.ORDER_ONLY): messages pair by order alone,
as under NCCL."""

import pytest

from tests.parallel.launch import ORDER_ONLY, result, run_ranks
from tests.parallel.ring_checks import check_ring_messages

TP2 = [("gradients_vs_reference", {"parallel": {"tp": 2}, "with_logits": True}),
       ("gradients_vs_reference", {"model": {"qkv_bias": True, "tie_embeddings": True, "share_weights": False},
                                   "parallel": {"tp": 2}, "with_logits": True})]
PP2 = [("gradients_vs_reference", {"parallel": {"pp": 2, "micro_batches": m}}) for m in (1, 2, 4)] + \
      [("gradients_vs_reference", {"parallel": {"pp": 2, "micro_batches": 2},  # two rounds of two
                                   "train": {"grad_accum": 4, "micro_batch_size": 2}})]
PP2_VARIANTS = [("gradients_vs_reference", {"model": {"tie_embeddings": True, "memory_block": 3},
                                            "parallel": {"pp": 2, "micro_batches": 2},
                                            "train": {"checkpointing": {"decoder": "step", "encoder": True}}})]
ZERO = [("steps_vs_reference", {"parallel": {"zero_stage": z}, "optim": {"lr": 1e-3, "grad_clip": 0.5}})
        for z in (0, 1, 2, 3)] + \
       [("steps_vs_reference", {"parallel": {"zero_stage": 2, "micro_batches": 2},  # DeepSpeed accumulates 2
                                "optim": {"lr": 1e-3, "grad_clip": 0.3}, "train": {"grad_accum": 2}}),
        # tied copies on two stages: counted once in the norm, same weight decay, kept equal
        ("steps_vs_reference", {"model": {"tie_embeddings": True}, "parallel": {"pp": 2, "zero_stage": 1},
                                "optim": {"lr": 1e-3, "grad_clip": 0.5}})]
BF16 = [("loss_falls", {"parallel": {"tp": 2, "zero_stage": 0}}),
        ("loss_falls", {"parallel": {"zero_stage": 2}}),
        ("loss_falls", {"parallel": {"pp": 2, "zero_stage": 1, "micro_batches": 2}}),
        ("loss_falls", {"parallel": {"zero_stage": 3}})]
BAD = [("bad_layout", {"parallel": {"tp": 3}}),
       ("bad_layout", {"parallel": {"tp": 1, "dp": 4}}),
       ("bad_layout", {"model": {"n_heads": 2, "n_kv_heads": 1}, "parallel": {"tp": 2}}),
       ("bad_layout", {"model": {"vocab_size": 33}, "parallel": {"tp": 2}}),
       ("bad_layout", {"model": {"n_layers": 1}, "parallel": {"pp": 2}}),
       ("bad_layout", {"parallel": {"pp": 2, "zero_stage": 3}})]
NONFINITE = [("nonfinite_skipped", {"parallel": {"zero_stage": 0}}),
             ("nonfinite_skipped", {"parallel": {"zero_stage": 2}}),
             ("nonfinite_skipped", {"parallel": {"pp": 2, "zero_stage": 1}})]
N = "nccl_scenarios."
MESSAGES = [(N + "ring_messages", {"parallel": {"pp": 2}}),
            (N + "ring_messages", {"parallel": {"pp": 2}, "model": {"memory_block": 1}, "check_every": 1})]
ACCUM = [(N + "bf16_accumulates_in_fp32", {"parallel": {"zero_stage": z}}) for z in (1, 2, 3)]
HANDOVER = [(N + "pipeline_handover_keeps_fp32", {"parallel": {"pp": 2, "zero_stage": z, "micro_batches": 2}})
            for z in (1, 2)]
SCENARIOS = BAD + TP2 + PP2 + PP2_VARIANTS + ZERO + BF16 + NONFINITE + MESSAGES + ACCUM + HANDOVER


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(2, SCENARIOS, tmp_path_factory.mktemp("two_ranks"), timeout=900, env=ORDER_ONLY)


def each_rank(results, name, args):
    return [result(results, name, args, rank) for rank in range(2)]


@pytest.mark.parametrize("name,args", TP2)
def test_tensor_parallel_logits_and_gradients_equal_one_process(results, name, args):
    for r in each_rank(results, name, args):
        assert r["logits_diff"] < 1e-5
        assert r["grad_diff"] < 1e-5, r["grad_worst"]
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5


@pytest.mark.parametrize("name,args", PP2 + PP2_VARIANTS)
def test_two_stage_ring_loss_and_gradients_equal_one_process(results, name, args):
    for r in each_rank(results, name, args):
        assert abs(r["loss"] - r["ref_loss"]) < 1e-6
        assert r["grad_diff"] < 1e-6, r["grad_worst"]
        if "tied_diff" in r:  # the tied copies on the first and last stage got the same gradient
            assert r["tied_diff"] == 0.0


@pytest.mark.parametrize("name,args", ZERO)
def test_zero_optimizer_steps_equal_one_process_on_the_combined_batch(results, name, args):
    for r in each_rank(results, name, args):
        assert r["ref_norm"][0] > args["optim"]["grad_clip"]  # clipping acts, so a wrong norm would change the update
        for norm, ref in zip(r["norm"], r["ref_norm"]):
            assert norm == pytest.approx(ref, rel=1e-5)
        for loss, ref in zip(r["loss"], r["ref_loss"]):
            assert loss == pytest.approx(ref, abs=1e-5)
        assert r["param_moved"] > 1e-3
        assert r["param_diff"] < 1e-5, r["param_worst"]


@pytest.mark.parametrize("name,args", BF16)
def test_bf16_training_reduces_the_loss(results, name, args):
    for r in each_rank(results, name, args):
        assert r["dtype"] == "torch.bfloat16"
        assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]


@pytest.mark.parametrize("name,args,needle", [
    (*BAD[0], "does not divide the world size 2"),
    (*BAD[1], "set parallel.dp=2"),
    (*BAD[2], "model.n_kv_heads=1 is not divisible by parallel.tp=2"),
    (*BAD[3], "model.vocab_size=33 is not divisible"),
    (*BAD[4], "some stages would have no layers"),
    (*BAD[5], "zero_stage=3 with parallel.pp > 1 is not supported"),
])
def test_a_layout_that_does_not_fit_fails_on_every_rank_with_a_clear_message(results, name, args, needle):
    for r in each_rank(results, name, args):
        assert r["raised"] and needle in r["message"], r["message"]


@pytest.mark.parametrize("name,args", NONFINITE)
def test_a_non_finite_step_is_skipped_without_touching_the_parameters(results, name, args):
    for r in each_rank(results, name, args):
        assert r["skipped"] and r["loss"] != r["loss"]  # NaN
        assert r["others_equal"] and r["steps_taken"] == 0


@pytest.mark.parametrize("name,args", MESSAGES)
def test_the_rings_post_the_messages_the_nccl_simulation_checks(results, name, args):
    for r in each_rank(results, name, args):
        check_ring_messages(r)


@pytest.mark.parametrize("name,args", ACCUM)
def test_bf16_zero_accumulates_gradients_in_fp32(results, name, args):
    for r in each_rank(results, name, args):
        # equal to fp32 accumulation of the same bf16 micro-batch gradients (up to the fp32
        # data-parallel mean), and measurably not bf16 accumulation
        assert r["diff_fp32_reference"] < 1e-6, r
        assert r["diff_bf16_reference"] > 1e-4, r


@pytest.mark.parametrize("name,args", HANDOVER)
def test_the_pipeline_hands_its_fp32_sums_to_deepspeed_exactly(results, name, args):
    for r in each_rank(results, name, args):
        assert r["pieces"] == 3 and r["params"] > 0
        assert r["sums_are_not_bf16"]  # so a bf16 hand-over would have changed them
        assert r["equal"], r
