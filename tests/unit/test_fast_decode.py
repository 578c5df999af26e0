"""The fast no-grad decoder step (model/fast_decode.py) against the module path it replaces:
the same function up to rounding (fp64: to 1e-12), bit-exact replay on it, a fresh weight
snapshot on every run, and the module path for projections that are not plain nn.Linear."""

import dataclasses
from unittest import mock

import pytest
import torch
from torch import nn

from rlt_mega.config import ModelConfig
from rlt_mega.model import build_model
from rlt_mega.model.fast_decode import DecodeWeights
from rlt_mega.rollout import Processing, SamplingParams, generate, replay

V = 64
PROMPTS = [[1, 2, 3], [6, 7, 8, 9, 10], [8, 9, 10, 11, 12, 13, 14, 15], [3, 5, 7, 9, 11, 13]]
PARAMS = SamplingParams(Processing(temperature=0.8, top_p=0.9), max_new_tokens=9)


def tiny(C=3, **kw):
    # init_std 0.1: memory, recurrence and attention all move the logits visibly.
    cfg = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, memory_block=C, max_seq_len=64,
               init_std=0.1)
    return build_model(ModelConfig(**{**cfg, **kw}), seed=0)


def on_module_path(rollout):
    """The rollout's schedule, replayed on the modules' decoder step (what a tensor-parallel
    model runs) instead of the fused one it was sampled with."""
    return dataclasses.replace(rollout, schedule=dataclasses.replace(rollout.schedule, fast_decode=False))


CASES = {
    "gqa": {},
    "qkv_bias_own_decoder_blocks": dict(qkv_bias=True, share_weights=False, n_kv_heads=4),
    "mqa_C1": dict(n_kv_heads=1, C=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_path_computes_the_module_path(case):
    """fp64: the two paths differ only by rounding of a 53-bit mantissa; fp32 within 1e-5 on
    a log-prob; both replay their own rollout bit for bit."""
    model = tiny(**CASES[case]).double()
    rollout = generate(model, PROMPTS, PARAMS, seeds=[1, 2, 3, 4], pad_id=0)
    assert rollout.schedule.fast_decode
    slow = replay(model, on_module_path(rollout))
    slow_rollout = generate(model, PROMPTS, PARAMS, seeds=[1, 2, 3, 4], pad_id=0, fast_decode=False)
    assert not slow_rollout.schedule.fast_decode
    assert torch.equal(replay(model, slow_rollout), slow_rollout.mu)
    mask = rollout.mask
    assert rollout.num_completion_tokens() > 10 and torch.isfinite(rollout.mu[mask]).all()
    assert torch.equal(torch.isfinite(slow), torch.isfinite(rollout.mu))
    finite = mask & torch.isfinite(slow)
    assert (slow - rollout.mu)[finite].abs().max() < 1e-12
    assert torch.equal(replay(model, rollout), rollout.mu)
    assert torch.equal(slow_rollout.tokens, rollout.tokens)

    model = model.float()
    rollout = generate(model, PROMPTS, PARAMS, seeds=[1, 2, 3, 4], pad_id=0)
    slow = replay(model, on_module_path(rollout))
    finite = mask & torch.isfinite(slow) & torch.isfinite(rollout.mu)
    assert (slow - rollout.mu)[finite].abs().max() < 1e-5
    assert torch.equal(replay(model, rollout), rollout.mu)


@pytest.mark.parametrize("dtype", ["bf16_autocast", "bf16_parameters"])
def test_fast_path_in_bf16(dtype):
    """Under autocast the GEMMs run in bf16 over an fp32 residual stream; with bf16
    parameters everything is bf16 but the norm statistics and softmax. Replay is bit-exact,
    and the log-probs stay within bf16 rounding of the module path's."""
    model = tiny()
    if dtype == "bf16_parameters":
        model = model.to(torch.bfloat16)
    run_dtype = "bf16" if dtype == "bf16_autocast" else "fp32"
    rollout = generate(model, PROMPTS, PARAMS, seeds=[1, 2, 3, 4], pad_id=0, dtype=run_dtype)
    assert torch.equal(replay(model, rollout), rollout.mu)
    slow = replay(model, on_module_path(rollout))
    both = rollout.mask & torch.isfinite(slow) & torch.isfinite(rollout.mu)
    assert both.sum() > 10
    assert (slow - rollout.mu)[both].abs().max() < 0.1


def test_every_run_snapshots_the_current_parameters():
    """An in-place update between the rollout and the replay is seen by the replay: it equals
    a fresh model's replay with the updated weights, bit for bit."""
    model = tiny()
    rollout = generate(model, PROMPTS, PARAMS, seeds=[1, 2, 3, 4], pad_id=0)
    with torch.no_grad():
        model.blocks[0].mlp.up.weight.add_(0.05)
        model.cross[1].attn.k.weight.mul_(1.5)
        model.blocks[1].attn_norm.weight.add_(0.2)
    moved = replay(model, rollout)
    fresh = tiny()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(moved, replay(fresh, rollout))
    assert not torch.equal(moved, rollout.mu)


def test_the_executor_runs_the_fast_path():
    model = tiny()
    calls = []
    original = DecodeWeights.decoder_layers

    def spy(self, *args):
        calls.append(args[1])
        return original(self, *args)

    with mock.patch.object(DecodeWeights, "decoder_layers", spy):
        rollout = generate(model, PROMPTS, PARAMS, seeds=[1, 2, 3, 4], pad_id=0)
    assert calls == list(range(rollout.schedule.num_steps))


class ShardedLinear(nn.Linear):
    """Stands in for a megatron-core layer: not a plain nn.Linear."""


def test_other_projections_run_the_module_path():
    model = tiny()
    fused = generate(model, PROMPTS, PARAMS, seeds=[1, 2, 3, 4], pad_id=0)
    old = model.blocks[1].mlp.down
    model.blocks[1].mlp.down = ShardedLinear(old.in_features, old.out_features, bias=False)
    model.blocks[1].mlp.down.load_state_dict(old.state_dict())
    assert DecodeWeights.build(model) is None
    rollout = generate(model, PROMPTS, PARAMS, seeds=[1, 2, 3, 4], pad_id=0)
    assert not rollout.schedule.fast_decode
    assert torch.equal(replay(model, rollout), rollout.mu)
    # a rollout of the fused step cannot be replayed bit for bit here: refused, by name
    with pytest.raises(RuntimeError, match="fused decoder step"):
        replay(model, fused)
    # a pipeline stage holding only layer 0 (all plain) gets the fast path
    assert DecodeWeights.build(model, range(0, 1)) is not None
