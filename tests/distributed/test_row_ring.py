"""The rollout and replay under TP=2, PP=2 and TP=2 x PP=2 on gloo ranks
(tests/distributed/grpo_scenarios.py), with every plan (the lockstep plan on ragged prompts; shared
prompts, compaction and slots < rows on grouped prompts): every rank of the replica follows the
same events (with an environment, rows leave their slot while its call runs), the replay is
torch.equal to mu (fp32 and bf16, C in {1, 2, 3, 4}, two batches in flight), the rollout is the one-process rollout of the same plan (same tokens; mu equal up to TP's
rounding, equal under PP), a partial rollout's weight switch (two policy versions) is replayed
bit for bit too, and every rank ran the model's decoder step (model/decoder.py
StepRunner) in the rollout and in the replay, under tensor parallelism too."""

import pytest

SLOTS = {"slots": 5}  # fewer than the 9 and 8 rows: rows wait for a freed slot
REPLAY = "grpo_scenarios.replay_exact"
LOCKSTEP = [(REPLAY, {"parallel": {"tp": 2}}),
            (REPLAY, {"parallel": {"tp": 2}, "dtype": "bf16", "model": {"memory_block": 1}}),
            (REPLAY, {"parallel": {"pp": 2}, "model": {"memory_block": 4}}),
            (REPLAY, {"parallel": {"pp": 2}, "dtype": "bf16"})]
ROWS = [(REPLAY, {"parallel": {"tp": 2}, "rows": SLOTS}),
        (REPLAY, {"parallel": {"tp": 2}, "dtype": "bf16", "model": {"memory_block": 3}, "rows": {}}),
        (REPLAY, {"parallel": {"pp": 2}, "model": {"memory_block": 3}, "rows": SLOTS}),
        (REPLAY, {"parallel": {"pp": 2}, "dtype": "bf16", "model": {"memory_block": 1}, "rows": SLOTS})]
FOUR = [(REPLAY, {"parallel": {"tp": 2, "pp": 2}, "model": {"memory_block": 3}, "rows": SLOTS}),
        (REPLAY, {"parallel": {"tp": 2, "pp": 2}, "dtype": "bf16", "rows": {}})]
ENV = [(REPLAY, {"parallel": {"tp": 2}, "model": {"memory_block": 3}, "rows": SLOTS, "env": True}),
       (REPLAY, {"parallel": {"pp": 2}, "model": {"memory_block": 3}, "rows": {}, "env": True}),
       (REPLAY, {"parallel": {"pp": 2}, "dtype": "bf16", "rows": SLOTS, "env": True})]
SWITCH = [(REPLAY, {"parallel": {"tp": 2}, "model": {"memory_block": 3}, "rows": SLOTS, "switch": True}),
          (REPLAY, {"parallel": {"pp": 2}, "dtype": "bf16", "rows": {}, "switch": True})]
FOUR_ENV = [(REPLAY, {"parallel": {"tp": 2, "pp": 2}, "model": {"memory_block": 3}, "rows": SLOTS, "env": True})]
SCENARIOS = {2: LOCKSTEP + ROWS + ENV + SWITCH, 4: FOUR + FOUR_ENV}


def check(rs: list[dict], args: dict) -> None:
    tp = args["parallel"].get("tp", 1)
    assert sum(r["has_values"] for r in rs) == tp  # the last stage's ranks
    for r in rs:
        assert r["num_tokens"] > 10
        assert r["decoder"] == ["fused"] and r["steps"]["rollout"] > 0 and r["steps"]["replay"] > 0
        if "rows" in args:
            assert {"Fork", "Enter", "Leave", "Encode"} <= set(r["events"])
        assert ("Force" in r["events"]) == bool(args.get("env"))  # observations inserted, replayed
        if args.get("env"):  # rows left their slot while their environment call ran, and came back
            assert "env" in r["leaves"]
        assert ("Switch" in r["events"]) == bool(args.get("switch"))  # a weight switch, replayed
        assert r["exact"] and r["exact_again"]
        assert r["calls_equal_one_process"]
        if args.get("dtype") != "bf16":  # bf16 rounding may move a draw; fp32 must not
            assert r["tokens_equal_one_process"]
        if r["tokens_equal_one_process"]:
            # the pipeline runs the one-process operations on the same shapes: no difference;
            # tensor parallelism splits the GEMMs (row-parallel sums in another order)
            assert r["mu_diff_one_process"] <= (1e-5 if args.get("dtype") != "bf16" else 0.05)
            if tp == 1 and args.get("dtype") != "bf16":
                assert r["mu_diff_one_process"] == 0.0


@pytest.mark.parametrize("name,args", LOCKSTEP + ROWS + ENV + SWITCH)
def test_replay_is_bit_exact_on_every_rank_of_two(ranks, name, args):
    check(ranks(2).each(name, args), args)


@pytest.mark.parametrize("name,args", FOUR + FOUR_ENV)
def test_replay_is_bit_exact_on_every_rank_of_four(ranks, name, args):
    check(ranks(4).each(name, args), args)
