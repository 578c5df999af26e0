"""The row schedule (rollout/rows.py: shared prompts, compaction, slots) under TP=2 and PP=2 on
two gloo ranks (tests/distributed/grpo_scenarios.py): every rank of the replica follows the same
events, the replay is torch.equal to mu (fp32 and bf16), and the rollout is the one-process
rollout of the same switches (same tokens; mu equal up to TP's rounding, equal under PP)."""

import pytest

SLOTS = {"slots": 5}  # fewer than the 9 and 8 rows: rows wait for a freed slot
ROWS = [("grpo_scenarios.replay_exact", {"parallel": {"tp": 2}, "rows": SLOTS}),
        ("grpo_scenarios.replay_exact", {"parallel": {"tp": 2}, "dtype": "bf16", "model": {"memory_block": 3},
                                         "rows": {}}),
        ("grpo_scenarios.replay_exact", {"parallel": {"pp": 2}, "model": {"memory_block": 3}, "rows": SLOTS}),
        ("grpo_scenarios.replay_exact", {"parallel": {"pp": 2}, "dtype": "bf16", "model": {"memory_block": 1},
                                         "rows": SLOTS})]
SCENARIOS = {2: ROWS}


@pytest.mark.parametrize("name,args", ROWS)
def test_row_schedule_replay_is_bit_exact_on_every_rank(ranks, name, args):
    rs = ranks(2).each(name, args)
    assert sum(r["has_values"] for r in rs) == (2 if "tp" in args["parallel"] else 1)
    for r in rs:
        assert r["num_tokens"] > 10
        assert {"fork", "enter", "leave", "enc"} <= set(r["events"])
        assert r["exact"] and r["exact_again"]
        assert r["calls_equal_one_process"]
        if args.get("dtype") != "bf16":
            assert r["tokens_equal_one_process"]
        if r["tokens_equal_one_process"]:
            assert r["mu_diff_one_process"] <= (1e-5 if args.get("dtype") != "bf16" else 0.05)
            if "pp" in args["parallel"] and args.get("dtype") != "bf16":
                assert r["mu_diff_one_process"] == 0.0
