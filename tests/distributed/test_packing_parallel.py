"""Packed SFT rows with document resets under tensor parallelism (two gloo ranks, megatron-core
layers, the vocab-sharded loss) and on two pipeline stages (the decoder ring, whose first stage
resets the state it receives): loss and every gathered gradient equal one process training the
same pairs one per row (tests/distributed/packing_scenarios.py)."""

import pytest

PACKED = [("packing_scenarios.packed_vs_unpacked", {"parallel": {"tp": 2}}),
          ("packing_scenarios.packed_vs_unpacked", {"parallel": {"pp": 2, "micro_batches": 1},
                                                    "train": {"checkpointing": {"decoder": "step"}}})]
SCENARIOS = {2: PACKED}


@pytest.mark.parametrize("name,args", PACKED)
def test_packed_rows_on_a_layout_equal_unpacked_pairs_on_one_process(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert r["tokens"] == r["ref_tokens"]
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5
        assert r["grad_diff"] < 1e-5 * max(1.0, r["grad_scale"]), r["grad_worst"]
