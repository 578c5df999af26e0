"""No on-policy replay (issue 12, deliverable 6): the first minibatch of a GRPO step learns
with the rollout's own parameters, so the trainer uses mu as the hybrid's value and skips that
replay. On the real trainer (one process, several minibatches, epochs and grad_accum): the step
is bit for bit the one that replays (grpo.skip_onpolicy_replay=false), exactly the first
minibatch's replays are skipped, and grpo.verify_onpolicy replays them all the same and stops
the run, naming the step and the deviation, when a replay is not torch.equal to mu. The
distributed layouts (DP x ZeRO, TP, PP, grad_accum) run with verify_onpolicy on in
tests/distributed/test_grpo_step.py and test_grpo_toolbox.py."""

import pytest
import torch

from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.rollout.sampler import Sampler
from rlt_mega.train.grpo import build_trainer, grpo_config
from rlt_mega.train.grpo_learn import onpolicy_deviation
from tests.distributed.grpo_scenarios import grpo_cfg, odd, records

LAYOUT = {"minibatches": 2, "epochs": 2, "prompts_per_step": 2, "group_size": 4}  # 4 optimizer steps a step


def run(grpo: dict, monkeypatch, steps: int = 2, corrupt_call: int | None = None):
    """Parameters after ``steps`` GRPO steps (grad_accum 2), the last step's scalars, and how many
    rollout batches each step replayed. ``corrupt_call``: that replay call (0-based) returns its
    values nudged by one ulp at one token, as a replay that broke the exactness contract would."""
    cfg = grpo_config(grpo_cfg({}, {"grad_accum": 2}, {**LAYOUT, **grpo}))
    dims = ParallelDims.single(cfg.model, "cpu")
    trainer = build_trainer(cfg, dims, load_tokenizer("byte"), odd, records(30), [])
    original, calls = Sampler.replay, []

    def spy(self, rollouts, load=None):
        out = original(self, rollouts, load)
        if self.model is trainer.engine.sampling_module():  # the policy's replays, not the reference's
            if len(calls) == corrupt_call:
                out = [o.clone() for o in out]
                out[0].view(-1)[0] = torch.nextafter(out[0].view(-1)[0], torch.tensor(1.0))
            calls.append(len(rollouts))
        return out

    monkeypatch.setattr(Sampler, "replay", spy)
    per_step = []
    for step in range(steps):
        before = sum(calls)
        scalars = trainer.job.step(step)
        per_step.append(sum(calls) - before)
    params = {n: p.detach().clone() for n, p in trainer.engine.sampling_module().named_parameters()}
    return params, scalars, per_step


def test_skipping_the_onpolicy_replay_changes_nothing_but_the_work(monkeypatch):
    skipped, s_skip, n_skip = run({"verify_onpolicy": False}, monkeypatch)
    replayed, s_all, n_all = run({"skip_onpolicy_replay": False, "verify_onpolicy": False}, monkeypatch)
    # 2 batches (grad_accum) a minibatch, 2 minibatches x 2 epochs: the first minibatch's 2 are skipped
    assert n_all == [8, 8] and n_skip == [6, 6]
    assert all(torch.equal(skipped[n], replayed[n]) for n in replayed)  # bit for bit the same training
    assert s_skip["train/loss"] == s_all["train/loss"] and s_skip["train/grad_norm"] == s_all["train/grad_norm"]
    assert s_all["ratio/onpolicy_max_dev"] == 0.0  # measured: the replay ran
    assert "ratio/onpolicy_max_dev" not in s_skip  # not measured: mu - mu is no check
    assert s_skip["ratio/max"] > 1.0  # later minibatches are off-policy: their replays were run
    verified, s_ver, n_ver = run({"verify_onpolicy": True}, monkeypatch)
    assert n_ver == [8, 8] and all(torch.equal(verified[n], replayed[n]) for n in replayed)


def test_verify_onpolicy_fails_loudly_on_a_replay_that_is_not_mu(monkeypatch):
    # One replay call a minibatch (its 2 batches together), 4 a step: call 4 is step 1's first minibatch.
    with pytest.raises(RuntimeError, match=r"GRPO step 1: grpo\.verify_onpolicy.*max \|replay - mu\| = [1-9]"):
        run({"verify_onpolicy": True}, monkeypatch, corrupt_call=4)
    # A deviation off the first minibatch (call 1: step 0's second minibatch) is the policy's own
    # drift, not a failure.
    run({"verify_onpolicy": True}, monkeypatch, steps=1, corrupt_call=1)


def test_onpolicy_deviation():
    mu = torch.tensor([[-1.0, 0.0, float("-inf")]])
    assert onpolicy_deviation(mu.clone(), mu) == 0.0
    assert onpolicy_deviation(torch.tensor([[-1.5, 0.0, float("-inf")]]), mu) == 0.5
    assert onpolicy_deviation(torch.tensor([[-1.0, 0.0, -3.0]]), mu) == float("inf")  # -inf vs finite
    assert onpolicy_deviation(torch.tensor([[float("nan"), 0.0, float("-inf")]]), mu) == float("inf")
