"""The rollout's and the replay's decoder step (model/decoder.py StepRunner: the training step's
forward over a K/V state) against the executable reference (rlt_mega/reference.py: the modules,
plain attention): the same function up to rounding (fp64: to 1e-12; fp32: 1e-5 on a log-prob;
bf16 within bf16 rounding), under every plan (lockstep, shared prompts and compaction, slots: rows
at their own positions), bit-exact replay on both, the current parameters on every run, and the
step that ran recorded (a replay with another step refused)."""

import pytest
import torch

from rlt_mega.config import ModelConfig
from rlt_mega.model.rlt import build_model
from rlt_mega.model.decoder import StepRunner
from rlt_mega.reference import ReferenceDecoder
from rlt_mega.rollout import Processing, SamplingParams, generate, replay
from rlt_mega.schedule.rows import LOCKSTEP, RowSwitches

V = 64
PROMPTS = [[1, 2, 3], [6, 7, 8, 9, 10], [8, 9, 10, 11, 12, 13, 14, 15], [3, 5, 7, 9, 11, 13], [1, 2, 3]]
PARAMS = SamplingParams(Processing(temperature=0.8, top_p=0.9), max_new_tokens=9, stop_token_ids=(4, 5))
SEEDS = [1, 2, 3, 4, 5]
PLANS = {"lockstep": LOCKSTEP, "rows": RowSwitches(), "slots": RowSwitches(slots=2)}


def tiny(C=3, **kw):
    # init_std 0.1: memory, recurrence and attention all move the logits visibly.
    cfg = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, memory_block=C, max_seq_len=64,
               init_std=0.1)
    return build_model(ModelConfig(**{**cfg, **kw}), seed=0)


CASES = {
    "gqa": {},
    "qkv_bias_own_decoder_blocks": dict(qkv_bias=True, share_weights=False, n_kv_heads=4),
    "mqa_C1": dict(n_kv_heads=1, C=1),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_step_computes_the_reference(case, plan):
    """fp64: the two differ only by rounding of a 53-bit mantissa (and draw the same tokens);
    fp32 within 1e-5 on a log-prob; each replays its own rollout bit for bit."""
    rows = PLANS[plan]
    model = tiny(**CASES[case]).double()
    rollout = generate(model, PROMPTS, PARAMS, seeds=SEEDS, pad_id=0, rows=rows, check_every=2)
    ref = generate(model, PROMPTS, PARAMS, seeds=SEEDS, pad_id=0, rows=rows, check_every=2,
                   decoder=ReferenceDecoder())
    assert (rollout.schedule.decoder, ref.schedule.decoder) == ("fused", "reference")
    assert rollout.num_completion_tokens() > 15 and torch.isfinite(rollout.mu[rollout.mask]).all()
    assert torch.equal(ref.tokens, rollout.tokens) and ref.schedule.rows.log == rollout.schedule.rows.log
    assert (ref.mu - rollout.mu)[rollout.mask].abs().max() < 1e-12
    assert torch.equal(replay(model, rollout), rollout.mu)
    assert torch.equal(replay(model, ref, decoder=ReferenceDecoder()), ref.mu)

    model = model.float()
    rollout = generate(model, PROMPTS, PARAMS, seeds=SEEDS, pad_id=0, rows=rows, check_every=2)
    assert torch.equal(replay(model, rollout), rollout.mu)
    slow = replay(model, rollout_as_reference(rollout), decoder=ReferenceDecoder())
    finite = rollout.mask & torch.isfinite(slow) & torch.isfinite(rollout.mu)
    assert (slow - rollout.mu)[finite].abs().max() < 1e-5


def rollout_as_reference(rollout):
    """The rollout's record as if the reference step had run it (its schedule, replayed on the
    reference: the same batches and events, the other step's rounding)."""
    import dataclasses

    return dataclasses.replace(rollout, schedule=dataclasses.replace(rollout.schedule, decoder="reference"))


@pytest.mark.parametrize("dtype", ["bf16_autocast", "bf16_parameters"])
def test_the_step_in_bf16(dtype):
    """Under autocast the products run in bf16 over an fp32 residual stream; with bf16
    parameters everything is bf16 but the norm statistics and softmax. Replay is bit-exact,
    and the log-probs stay within bf16 rounding of the reference's."""
    model = tiny()
    if dtype == "bf16_parameters":
        model = model.to(torch.bfloat16)
    run_dtype = "bf16" if dtype == "bf16_autocast" else "fp32"
    rollout = generate(model, PROMPTS, PARAMS, seeds=SEEDS, pad_id=0, dtype=run_dtype)
    assert torch.equal(replay(model, rollout), rollout.mu)
    slow = replay(model, rollout_as_reference(rollout), decoder=ReferenceDecoder())
    both = rollout.mask & torch.isfinite(slow) & torch.isfinite(rollout.mu)
    assert both.sum() > 10
    assert (slow - rollout.mu)[both].abs().max() < 0.1


def test_every_run_prepares_the_current_parameters():
    """An in-place update between the rollout and the replay is seen by the replay: it equals
    a fresh model's replay with the updated weights, bit for bit."""
    model = tiny()
    rollout = generate(model, PROMPTS, PARAMS, seeds=SEEDS, pad_id=0)
    with torch.no_grad():
        model.blocks[0].mlp.up.weight.add_(0.05)
        model.cross[1].attn.k.weight.mul_(1.5)
        model.blocks[1].attn_norm.weight.add_(0.2)
    moved = replay(model, rollout)
    fresh = tiny()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(moved, replay(fresh, rollout))
    assert not torch.equal(moved, rollout.mu)


def test_the_executor_runs_the_models_decoder_step(monkeypatch):
    """Every decoder step of a rollout is the model's step (StepRunner.step), one per plan step."""
    model = tiny()
    calls = []
    original = StepRunner.step

    def spy(self, step, x, e):
        calls.append(step.n)
        return original(self, step, x, e)

    monkeypatch.setattr(StepRunner, "step", spy)
    rollout = generate(model, PROMPTS, PARAMS, seeds=SEEDS, pad_id=0)
    assert len(calls) == rollout.schedule.rows.num_steps and sum(calls) == rollout.schedule.rows.row_steps


def test_a_replay_with_another_step_is_refused():
    model = tiny()
    rollout = generate(model, PROMPTS, PARAMS, seeds=SEEDS, pad_id=0)
    with pytest.raises(ValueError, match="ran the fused decoder step but this sampler runs the reference one"):
        replay(model, rollout, decoder=ReferenceDecoder())
