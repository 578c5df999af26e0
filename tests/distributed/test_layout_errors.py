"""A layout that does not fit fails on every rank before any process group exists, with the
message that says what to change (tests/unit/test_layout_rules.py: the rules themselves)."""

import pytest

BAD = [("bad_layout", {"parallel": {"tp": 3}}),
       ("bad_layout", {"parallel": {"tp": 1, "dp": 4}}),
       ("bad_layout", {"model": {"n_heads": 2, "n_kv_heads": 1}, "parallel": {"tp": 2}}),
       ("bad_layout", {"model": {"vocab_size": 33}, "parallel": {"tp": 2}}),
       ("bad_layout", {"model": {"n_layers": 1}, "parallel": {"pp": 2}}),
       ("bad_layout", {"parallel": {"pp": 2, "zero_stage": 3}})]
SCENARIOS = {2: BAD}


@pytest.mark.parametrize("name,args,needle", [
    (*BAD[0], "does not divide the world size 2"),
    (*BAD[1], "set parallel.dp=2"),
    (*BAD[2], "model.n_kv_heads=1 is not divisible by parallel.tp=2"),
    (*BAD[3], "model.vocab_size=33 is not divisible"),
    (*BAD[4], "some stages would have no layers"),
    (*BAD[5], "zero_stage=3 with parallel.pp > 1 is not supported"),
])
def test_a_layout_that_does_not_fit_fails_on_every_rank_with_a_clear_message(ranks, name, args, needle):
    for r in ranks(2).each(name, args):
        assert r["raised"] and needle in r["message"], r["message"]
