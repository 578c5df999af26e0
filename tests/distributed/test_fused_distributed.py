"""The decoder step on four gloo ranks against the single-process executable reference (the
shared four-rank launch of tests/distributed/conftest.py; scenarios in fused_scenarios.py):
tensor parallelism with ZeRO-3 and every parameter partitioned (TP=2 x DP=2), the pipeline ring
with per-position recomputation (PP=2 x DP=2), and TP=2 x PP=2, each rank's stage and shard built
from the meta device (parallel/build.py). Each checks that the decoder step ran on every rank and
the reference did not."""

import pytest

S = "fused_scenarios."
GRADIENTS = [
    (S + "fused_vs_module", {"model": {"qkv_bias": True, "n_kv_heads": 2}, "parallel": {"tp": 2, "zero_stage": 3},
                             "persistence_threshold": 0}),
    (S + "fused_vs_module", {"model": {"tie_embeddings": True, "memory_block": 3},
                             "parallel": {"pp": 2, "micro_batches": 2, "zero_stage": 1},
                             "train": {"checkpointing": {"decoder": "every_k", "decoder_k": 3}}}),
    (S + "fused_vs_module", {"model": {"share_weights": False}, "parallel": {"tp": 2, "pp": 2, "micro_batches": 2}}),
    # the head over chunks of positions with ZeRO-3 partitioning lm_head (its gathers in each chunk's recompute)
    (S + "fused_vs_module", {"model": {"n_kv_heads": 2}, "parallel": {"tp": 2, "zero_stage": 3},
                             "train": {"checkpointing": {"head_chunk": 5}}, "persistence_threshold": 0}),
]
CHECKPOINTING = [
    (S + "checkpointing_bit_identical", {"model": {"memory_block": 1, "n_kv_heads": 2}, "parallel": {"tp": 2}}),
    (S + "checkpointing_bit_identical", {"model": {"memory_block": 3}, "parallel": {"pp": 2, "micro_batches": 2},
                                         "train": {"dtype": "bf16"}}),
    (S + "checkpointing_bit_identical", {"model": {"memory_block": 3}, "parallel": {"tp": 2, "pp": 2,
                                                                                    "micro_batches": 2}}),
]
GRAPHS = [
    (S + "graphs_vs_module", {"model": {"n_kv_heads": 2}, "parallel": {"tp": 2}}),
    (S + "graphs_vs_module", {"model": {"memory_block": 3}, "parallel": {"pp": 2, "micro_batches": 2},
                              "train": {"checkpointing": {"decoder": "every_k", "decoder_k": 3}}}),
    (S + "graphs_vs_module", {"parallel": {"tp": 2, "pp": 2, "micro_batches": 2}}),
]
SCENARIOS = {4: GRADIENTS + CHECKPOINTING + GRAPHS}


@pytest.mark.parametrize("name,args", GRADIENTS)
def test_gradients_equal_the_one_process_reference(ranks, name, args):
    for r in ranks(4).each(name, args):
        assert r["fused_positions"] > 0 and r["module_layers"] == 0, r
        assert r["ref_module_layers"] > 0 and r["ref_fused_positions"] == 0
        assert (r["head_chunks"] > 0) == bool(args.get("train", {}).get("checkpointing", {}).get("head_chunk"))
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5
        assert r["grad_diff"] < 1e-5 * max(1.0, r["grad_scale"]), r["grad_worst"]


@pytest.mark.parametrize("name,args", CHECKPOINTING)
def test_checkpointed_gradients_are_bit_identical_in_every_layout(ranks, name, args):
    """Recomputing k-position segments from the kept stage inputs (model/decoder.py) under TP=2
    (the recomputed products' all-reduces run again), PP=2 in bf16 (each stage recomputes from
    what it received) and TP=2 x PP=2: the gradients of "none", "step" and "every_k" equal; and
    those of the checkpointed encoder, which under TP keeps 1/tp of each block's input per rank
    (measured on the one-stage layout: what the planner says, the inputs after the first block
    halved at TP=2). And the head chunked by positions, each chunk's logits recomputed in the
    backward (under TP each chunk's vocab-parallel cross-entropy; under PP on the last stage):
    loss and gradients within rounding of the whole head's."""
    tp = args["parallel"].get("tp", 1)
    tol = 2e-2 if args.get("train", {}).get("dtype") == "bf16" else 1e-5
    for r in ranks(4).each(name, args):
        assert r["compared"] > 0 and r["scale"] > 1e-4 and r["fused_positions"] > 0, r
        for run in ("step", "every_k"):
            got = r[run]
            assert got["loss_equal"] and got["names_equal"] and got["more_positions"], (run, got)
            assert got["unequal"] == [], (run, got["unequal"])
        # the head chunked by 5 positions (train.checkpointing.head_chunk): to rounding of the whole head
        got = r["head"]
        assert got["names_equal"] and (got["chunks"] > 0) == got["last_stage"], got
        assert got["loss_diff"] <= tol * 10 and got["grad_diff"] <= tol * r["scale"], got
        got = r["encoder"]
        assert got["loss_equal"] and got["names_equal"] and got["unequal"] == [], got
        kept = r["encoder_kept"]
        if args["parallel"].get("pp", 1) == 1:
            assert abs(kept["measured"] - kept["predicted"]) <= 0.05 * kept["predicted"], kept
            shards = kept["first"] + (kept["whole"] - kept["first"]) / tp  # blocks after the first: 1/tp
            assert tp == 1 or abs(kept["measured"] - shards) <= 0.05 * shards, kept


@pytest.mark.parametrize("name,args", GRAPHS)
def test_captured_steps_in_every_layout_equal_the_reference(ranks, name, args):
    """train.cuda_graphs under TP=2 (the all-reduces inside the captured bodies), PP=2 (each
    stage's positions captured, checkpointed; sends and receives outside) and TP=2 x PP=2, on
    the CPU with the bodies called directly: the gradients of the one-process reference."""
    pp = args["parallel"].get("pp", 1)
    for r in ranks(4).each(name, args):
        assert r["fused_positions"] > 0 and r["module_layers"] == 0, r
        assert (r["stage_runs"] > 0) == (pp > 1), r
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5
        assert r["grad_diff"] < 1e-5 * max(1.0, r["grad_scale"]), r["grad_worst"]
