"""The messages the sampler ring (generate and replay, the lockstep plan on ragged prompts and the
row plan on grouped ones: a stop token, stop strings, a micro-batch stopping at a check, forks,
rows entering freed slots) and the training ring really post, recorded on every stage, against the
pure descriptions the NCCL simulation checks (tests/unit/test_nccl_rules.py): PP=2 (C = 2, and C = 1
with a check every step) on two ranks, whose launch pairs messages by order alone (every tag 0, as
under NCCL); PP=4 on four ranks, where the middle stages take the finish flags at checks only
(rollout/ring.py)."""

import pytest

from tests.distributed.ring_checks import check_ring_messages

N = "nccl_scenarios.ring_messages"
TWO = [(N, {"parallel": {"pp": 2}}),
       (N, {"parallel": {"pp": 2}, "model": {"memory_block": 1}, "check_every": 1, "train": False}),
       (N, {"parallel": {"pp": 2}, "model": {"memory_block": 3}, "plan": "rows", "train": False})]
FOUR = [(N, {"parallel": {"pp": 4}, "model": {"n_layers": 4}}),
        (N, {"parallel": {"pp": 4}, "model": {"n_layers": 4}, "check_every": 3, "plan": "rows", "train": False})]
SCENARIOS = {2: TWO, 4: FOUR}


@pytest.mark.parametrize("name,args", TWO)
def test_the_rings_post_the_messages_the_nccl_simulation_checks(ranks, name, args):
    for r in ranks(2).each(name, args):
        check_ring_messages(r)


@pytest.mark.parametrize("name,args", FOUR)
def test_four_stage_rings_post_the_messages_the_nccl_simulation_checks(ranks, name, args):
    for r in ranks(4).each(name, args):
        check_ring_messages(r)
