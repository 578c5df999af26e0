"""Partial rollouts at the sampler (rollout/sampler.py, schedule/rows.py ``Switch``): a call that
starts under policy version A and switches to version B before step k* (a memory-block
boundary). Every token's mu comes from the version that drew it: tokens drawn before k* equal a
replay under A alone, and the replay that repeats the switch (A, then B at k*) equals mu on every
token, bit for bit, in fp32 and bf16, with ragged prompts, slots below the rows (rows entering
late, at their own positions) and the reference decoder step. The learner's replay under one
set of parameters equals a replay that switches between two copies of them (the switch itself
changes nothing), the switch is a recorded event (JSON round trip) and a record whose switch
differs is refused."""

import copy
import json

import pytest
import torch

from rlt_mega.schedule.rows import RowSwitches, Switch, record_from_json, record_to_json, row_layout
from rlt_mega.reference import ReferenceDecoder
from rlt_mega.rollout import Sampler
from tests.unit.test_row_schedule import PROMPTS, SEEDS, params, tiny

C = 3
SWITCH_STEP = 6  # a multiple of C: the steps < 6 draw with version 4, the rest with version 5


def two_versions(dtype: str):
    """(model, {version: parameters}): version 5 is version 4 moved by a small random step."""
    a = tiny(C)
    if dtype == "bf16":
        a = a.to(torch.bfloat16)
    b = copy.deepcopy(a)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
    versions = {4: [p.detach().clone() for p in a.parameters()], 5: [p.detach().clone() for p in b.parameters()]}
    return a, versions


def loader(model, versions):
    def load(v: int) -> None:
        with torch.no_grad():
            for p, x in zip(model.parameters(), versions[v]):
                p.copy_(x)
    return load


def drawn_steps(ro) -> torch.Tensor:
    """(B, N) the call step that drew each completion token, when no row waited (slots = 0):
    a row is at position k at step k, and its j-th token (at position P + j) came from step P + j - 1."""
    P = torch.tensor(ro.schedule.prompt_lens)[:, None]
    return P - 1 + torch.arange(ro.mu.shape[1])[None, :]


@pytest.mark.parametrize("dtype,decoder", [("fp32", "fused"), ("bf16", "fused"), ("bf16", "reference")])
def test_each_token_comes_from_the_version_that_drew_it(dtype, decoder):
    model, versions = two_versions(dtype)
    load = loader(model, versions)
    step = ReferenceDecoder() if decoder == "reference" else None
    for rows in (RowSwitches(), RowSwitches(slots=3))[1 if step else 0:]:
        sampler = Sampler(model, check_every=2, rows=rows, decoder=step)
        ro = sampler.generate([PROMPTS], params(12), [SEEDS], pad_id=0, dtype=dtype, version=4,
                              switch=(SWITCH_STEP, 5), load=load)[0]
        assert Switch(SWITCH_STEP, 5) in ro.schedule.rows.log
        mask = ro.mask.bool()
        old, new = mask & (ro.version == 4), mask & (ro.version == 5)
        assert old.any() and new.any() and torch.equal(old | new, mask)  # the call spans the switch
        if rows.slots == 0:
            assert torch.equal(old, mask & (drawn_steps(ro) < SWITCH_STEP))
        # the replay that repeats the switch: mu on every token, bit for bit
        assert torch.equal(sampler.replay([ro], load=load)[0], ro.mu)
        # before the switch: version 4's own values; after it, version 4 would have drawn otherwise
        load(4)
        under_a = sampler.replay([ro])[0]
        assert torch.equal(under_a[old], ro.mu[old])
        assert not torch.equal(under_a[new], ro.mu[new])
        # one set of parameters (the learner's replay) = the switch between two copies of them
        load(5)
        under_b = sampler.replay([ro])[0]
        assert torch.equal(under_b, sampler.replay([ro], load=lambda v: load(5))[0])


def test_the_switch_is_a_recorded_event_of_the_schedule():
    model, versions = two_versions("fp32")
    load = loader(model, versions)
    sampler = Sampler(model, check_every=2)
    ro = sampler.generate([PROMPTS], params(12), [SEEDS], pad_id=0, version=4, switch=(SWITCH_STEP, 5), load=load)[0]
    record = ro.schedule.rows
    assert record.layout.version == 4 and record.layout.switch == (SWITCH_STEP, 5)
    assert record_from_json(json.loads(json.dumps(record_to_json(record)))) == record
    # a call that ends before the switch step runs under the start version only: no event
    short = sampler.generate([PROMPTS], params(1), [SEEDS], pad_id=0, version=4, switch=(12, 5), load=load)[0]
    assert not any(isinstance(e, Switch) for e in short.schedule.rows.log)
    assert bool((short.version[short.mask.bool()] == 4).all())
    # a record whose switch moved is refused by the replay (its events differ)
    moved = copy.deepcopy(ro)
    moved.schedule.rows.layout = row_layout(PROMPTS, 12, C, None, True, True, 2, version=4, switch=(3, 5))
    with pytest.raises(RuntimeError, match="row events differ"):
        sampler.replay([moved], load=load)
    with pytest.raises(ValueError, match="needs load"):
        sampler.generate([PROMPTS], params(4), [SEEDS], pad_id=0, version=4, switch=(SWITCH_STEP, 5))
    with pytest.raises(ValueError, match="positive multiple of the memory block"):
        row_layout(PROMPTS, 12, C, None, True, True, 2, version=4, switch=(4, 5))
