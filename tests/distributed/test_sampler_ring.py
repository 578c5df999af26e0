"""The sampler ring under TP=2 and PP=2 on two gloo ranks (tests/distributed/grpo_scenarios.py):
its replay is torch.equal to mu (fp32 and bf16, C in {1, 2, 4}, ragged prompts, two batches in
flight), and its rollout is the one-process rollout (same tokens; mu equal up to TP's
rounding)."""

import pytest

REPLAY = [("grpo_scenarios.replay_exact", {"parallel": {"tp": 2}}),
          ("grpo_scenarios.replay_exact", {"parallel": {"tp": 2}, "dtype": "bf16", "model": {"memory_block": 1}}),
          ("grpo_scenarios.replay_exact", {"parallel": {"pp": 2}, "model": {"memory_block": 4}}),
          ("grpo_scenarios.replay_exact", {"parallel": {"pp": 2}, "dtype": "bf16"})]
SCENARIOS = {2: REPLAY}


@pytest.mark.parametrize("name,args", REPLAY)
def test_sampler_ring_replay_is_bit_exact_and_follows_one_process(ranks, name, args):
    rs = ranks(2).each(name, args)
    assert sum(r["has_values"] for r in rs) == (2 if "tp" in args["parallel"] else 1)  # the last stage(s)
    for r in rs:
        assert r["num_tokens"] > 10
        assert r["exact"] and r["exact_again"]
        assert r["calls_equal_one_process"]
        if args.get("dtype") != "bf16":  # bf16 rounding may move a draw; fp32 must not
            assert r["tokens_equal_one_process"]
        if r["tokens_equal_one_process"]:
            # the pipeline runs the one-process operations on the same shapes: no difference;
            # tensor parallelism splits the GEMMs (row-parallel sums in another order)
            assert r["mu_diff_one_process"] <= (1e-5 if args.get("dtype") != "bf16" else 0.05)
            if "pp" in args["parallel"] and args.get("dtype") != "bf16":
                assert r["mu_diff_one_process"] == 0.0
