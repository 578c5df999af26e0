"""Bounded staleness under TP=2 and PP=2 (colocated, 2 gloo ranks; tests/distributed/
async_scenarios.py ``stale_layout``): with max_staleness 1 and the token_tis correction, every
step's first minibatch learns with ratio exactly 1 against its proximal replay (the stale
samples' replay is exact on the layout), step k's staleness is min(k, 1), a run stopped after
step 1 (checkpoint with every rank's queue) and resumed ends with the uninterrupted run's
parameters (every rank's shard) and logged losses bit for bit, and the losses follow the
one-process run of the same config."""

import pytest

GRPO = {"max_staleness": 1, "is_correction": "token_tis", "minibatches": 2, "verify_onpolicy": True}
LAYOUTS = [{"tp": 2, "zero_stage": 1}, {"pp": 2, "zero_stage": 1, "micro_batches": 2}]
ARGS = [{"parallel": p, "grpo": GRPO, "out_dir": f"{{shared}}/async/layout{i}"} for i, p in enumerate(LAYOUTS)]
SCENARIOS = {2: [("async_scenarios.stale_layout", a) for a in ARGS]}


@pytest.mark.parametrize("args", ARGS)
def test_stale_grpo_on_a_layout_is_exact_and_resumes_exactly(ranks, args):
    results = ranks(2).each("async_scenarios.stale_layout", args)
    for r in results:
        assert r["whole"] == r["resumed"]
    r = results[0]
    whole, cut, single = r["logged_whole"], r["logged_cut"], r["logged_single"]
    assert [x["train/loss"] for x in cut] == [x["train/loss"] for x in whole] and len(whole) == 2
    assert [x["async/staleness_max"] for x in whole] == [0.0, 1.0]
    assert all(x["ratio/onpolicy_max_dev"] == 0.0 for x in whole)
    assert whole[0]["reward/mean"] == single[0]["reward/mean"]
    for x, y in zip(whole, single):
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-3, abs=1e-5)
