"""A non-finite step under the distributed engine (ZeRO-0, ZeRO-2, PP=2 with ZeRO-1) is
skipped: no parameter changes and the learning-rate schedule does not move."""

import pytest

NONFINITE = [("nonfinite_skipped", {"parallel": {"zero_stage": 0}}),
             ("nonfinite_skipped", {"parallel": {"zero_stage": 2}}),
             ("nonfinite_skipped", {"parallel": {"pp": 2, "zero_stage": 1}})]
SCENARIOS = {2: NONFINITE}


@pytest.mark.parametrize("name,args", NONFINITE)
def test_a_non_finite_step_is_skipped_without_touching_the_parameters(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert r["skipped"] and r["loss"] != r["loss"]  # NaN
        assert r["others_equal"] and r["steps_taken"] == 0
