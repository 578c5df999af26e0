"""The row schedule (schedule/rows.py): shared prompts forked into their rows, compaction and
continuous batching. Its replay repeats every recorded event and is torch.equal to mu (fp32 and
bf16, C in {1, 3}, ragged prompts, G in {1, 4}, stop tokens at different steps, slots < rows, the
model's decoder step and the reference's); mu is still the real sampling distribution; every
completion agrees with the same completion replayed alone in a batch of one (lockstep), and with
the lockstep rollout of the same seeds; the host reads device values only at checks."""

import dataclasses
import json

import pytest
import torch

from rlt_mega.config import ConfigError, ModelConfig, SamplingConfig, load_config
from rlt_mega.model.rlt import build_model
from rlt_mega.reference import ReferenceDecoder
from rlt_mega.rollout import Processing, Rollout, Sampler, SamplingParams, Schedule, generate, process_logits, replay
from rlt_mega.schedule.rows import (LOCKSTEP, Encode, Enter, Fork, Leave, RowPlan, RowSwitches, planned_record,
                                 record_from_json, record_to_json, row_layout)
from tests.unit.test_rollout import chi_square_pvalue
from tests.unit.test_sampler_checks import HostReads

V = 64
# G = 4 for two ragged prompts (one of length 6 = 2C at C = 3: its prefill ends at a block
# boundary; one of 4 does not), G = 1 for two more.
PROMPTS = [[1, 2, 3, 4]] * 4 + [[6, 7, 8, 9, 10, 11]] * 4 + [[5]] + [[3, 5, 7, 9, 11]]
SEEDS = list(range(200, 200 + len(PROMPTS)))
SWITCHES = {"all": RowSwitches(), "slots": RowSwitches(slots=3), "unshared_slots": RowSwitches(share_prompts=False, slots=4),
            "no_compact": RowSwitches(compact=False)}


def tiny(C: int, init_std: float = 0.1):
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, memory_block=C, max_seq_len=64,
                      init_std=init_std)
    return build_model(cfg, seed=3)


def params(max_new: int = 10) -> SamplingParams:
    # stop tokens common enough to end rows at different steps
    return SamplingParams(Processing(temperature=1.0), max_new_tokens=max_new, stop_token_ids=(0, 1, 2, 4))


@pytest.mark.parametrize("decoder", ["fused", "reference"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("C", [1, 3])
def test_replay_repeats_the_events_bit_for_bit(C, dtype, decoder):
    model = tiny(C)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    for name, sw in SWITCHES.items():
        if decoder == "reference" and name in ("all", "no_compact"):  # the reference: the harder cases only
            continue
        step = ReferenceDecoder() if decoder == "reference" else None
        sampler = Sampler(model, check_every=2, rows=sw, decoder=step)
        ro = sampler.generate([PROMPTS], params(), [SEEDS], pad_id=0, dtype=dtype)[0]
        kinds = {type(e) for e in ro.schedule.rows.log}
        assert {Enter, Leave, Encode} <= kinds, name
        assert (Fork in kinds) == sw.share_prompts, name
        assert len(set(ro.completion_lens)) > 2 and max(ro.completion_lens) == 10  # ends at different steps
        assert torch.equal(sampler.replay([ro])[0], ro.mu), name
        assert torch.equal(replay(model, ro, decoder=step), ro.mu), name  # a fresh sampler, any switches: the record rules


def test_slots_bound_the_batch_and_rows_enter_freed_slots():
    model = tiny(3)
    ro = generate(model, PROMPTS, params(), SEEDS, pad_id=0, rows=RowSwitches(slots=3), check_every=2)
    rec = ro.schedule.rows
    late = []
    for e in rec.log:
        if isinstance(e, Enter):
            assert 0 <= e.slot < 3
            late += [e.seq] if e.step > 0 else []
    assert late, "no row waited for a slot"
    plan = RowPlan(rec.layout, recorded=rec)
    k, widths, positions = 0, [], set()
    while (sp := plan.begin(k)) is not None:
        widths.append(len(sp.seqs))
        positions.add(len(set(sp.positions)))
        k += 1
    assert max(widths) <= 3 and k == rec.num_steps and sum(widths) == rec.row_steps
    assert max(positions) > 1  # rows at different positions in one batch
    lockstep = generate(model, PROMPTS, params(), SEEDS, pad_id=0, check_every=2, rows=LOCKSTEP)
    assert rec.row_steps < lockstep.schedule.rows.row_steps


def _alone(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The completion replayed alone in a batch of one (the lockstep plan, tokens forced)."""
    C, n = model.cfg.memory_block, len(completion)
    layout = row_layout([prompt], n, C, None, share_prompts=False, compact=False, check_every=1)
    rec = planned_record(layout, lambda b: 10**9)  # never finished: the row runs its n draws
    schedule = Schedule(prompt_lens=[len(prompt)], memory_block=C, capacity=len(prompt) + n,
                        num_steps=len(prompt) + n - 1, encoder_calls=[(e.start, e.end) for e in rec.log if isinstance(e, Encode)],
                        processing=Processing(temperature=1.0), dtype="fp32", pad_id=0, rows=rec)
    ro = Rollout(torch.tensor([prompt + completion]), torch.zeros(1, n), torch.ones(1, n, dtype=torch.bool), [n],
                 ["length"], schedule)
    return replay(model, ro)[0]


@pytest.mark.parametrize("C", [1, 3])
def test_each_completion_agrees_with_itself_alone_and_with_lockstep(C):
    model = tiny(C)
    lockstep = generate(model, PROMPTS, params(), SEEDS, pad_id=0, check_every=2, rows=LOCKSTEP)
    for sw in (RowSwitches(), RowSwitches(slots=3), RowSwitches(share_prompts=False, slots=4)):
        ro = generate(model, PROMPTS, params(), SEEDS, pad_id=0, rows=sw, check_every=2)
        # the same draws (each row's own uniforms), so the same completions as lockstep
        assert ro.completion_lens == lockstep.completion_lens and ro.finish_reasons == lockstep.finish_reasons
        for b in range(len(PROMPTS)):
            assert ro.completion(b) == lockstep.completion(b)
            n = ro.completion_lens[b]
            alone = _alone(model, PROMPTS[b], ro.completion(b))
            assert (ro.mu[b, :n] - alone).abs().max() <= 1e-5
        assert (ro.mu - lockstep.mu).abs().max() <= 1e-5


def test_mu_is_the_real_sampling_distribution_of_a_forked_prompt():
    """Many rows of one prompt: the prompt runs once and forks; each row draws its first two
    tokens. The first tokens' frequencies agree with exp(mu) (chi-square), mu of the first
    token is one value per token (one state), and it is the lockstep sampler's value."""
    model = tiny(3, init_std=0.3)
    n = 1500
    processing = Processing(temperature=0.7, top_k=30, top_p=0.9)
    p = SamplingParams(processing, max_new_tokens=2)
    ro = generate(model, [[5, 6, 7, 8, 9]] * n, p, seeds=list(range(n)), pad_id=0, rows=RowSwitches(slots=64))
    assert sum(isinstance(e, Fork) for e in ro.schedule.rows.log) == 1
    drawn, mu = ro.tokens[:, 5], ro.mu[:, 0]
    for token in drawn.unique():
        assert mu[drawn == token].unique().numel() == 1
    prob = torch.zeros(V, dtype=torch.float64)
    prob[drawn] = mu.double().exp()
    counts = torch.bincount(drawn, minlength=V).double()
    seen = counts > 0
    observed = torch.cat([counts[seen], torch.zeros(1, dtype=torch.float64)])
    expected = torch.cat([n * prob[seen], (n * (1 - prob[seen].sum())).clamp_min(1e-9).view(1)])
    assert chi_square_pvalue(observed, expected) > 1e-3
    with torch.no_grad():
        state = process_logits(model(torch.tensor([[5, 6, 7, 8, 9]]))[:, -1], processing)[0]
    assert torch.isfinite(state[drawn]).all()
    assert (state[drawn] - mu).abs().max() <= 1e-5
    assert torch.equal(replay(model, ro), ro.mu)


def test_host_reads_happen_at_checks_only():
    model = tiny(3)
    every = 4
    sampler = Sampler(model, check_every=every, rows=RowSwitches(slots=3))
    p = SamplingParams(Processing(temperature=0.9, top_p=0.9), max_new_tokens=40)
    with torch.no_grad(), HostReads() as counter:
        ro = sampler.generate([PROMPTS], p, [SEEDS], pad_id=0)[0]
    steps = ro.schedule.rows.num_steps
    assert steps > 40
    checks = steps // every + 1
    # one read of the flags per check, the record's reads at the end (a handful)
    assert counter.count <= checks + 12, (counter.count, checks)


def test_stop_strings_and_max_new_tokens_one():
    model = tiny(3)
    decode = lambda ids: "".join("ab"[i % 2] for i in ids)  # noqa: E731
    p = SamplingParams(Processing(temperature=1.0), max_new_tokens=12, stop_strings=("abb",))
    lock = generate(model, PROMPTS, p, SEEDS, pad_id=0, decode=decode, check_every=3, rows=LOCKSTEP)
    ro = generate(model, PROMPTS, p, SEEDS, pad_id=0, decode=decode, check_every=3, rows=RowSwitches(slots=4))
    assert "stop_string" in ro.finish_reasons
    assert ro.finish_reasons == lock.finish_reasons and ro.completion_lens == lock.completion_lens
    assert torch.equal(replay(model, ro), ro.mu)
    one = generate(model, PROMPTS, dataclasses.replace(p, max_new_tokens=1, stop_strings=()), SEEDS, pad_id=0,
                   rows=RowSwitches(slots=2))
    assert one.completion_lens == [1] * len(PROMPTS) and torch.equal(replay(model, one), one.mu)


def test_a_replay_with_other_events_is_refused():
    model = tiny(3)
    ro = generate(model, PROMPTS, params(), SEEDS, pad_id=0, rows=RowSwitches(slots=3), check_every=2)
    rec = ro.schedule.rows
    k = min(rec.checks)
    tampered = dataclasses.replace(rec, checks={**rec.checks, k: rec.checks[k][:-1]})
    bad = dataclasses.replace(ro, schedule=dataclasses.replace(ro.schedule, rows=tampered))
    with pytest.raises(RuntimeError, match="row events differ"):
        replay(model, bad)


def test_switches_and_their_errors():
    for key in ("sampling.share_prompts", "sampling.compact", "sampling.fast_decode"):
        with pytest.raises(ConfigError, match=f"{key} was removed"):
            load_config(None, [f"{key}=false"])
    with pytest.raises(ConfigError, match="sampling.slots"):
        SamplingConfig(slots=-1)
    # a planned call without device: G rows wait for slots freed by finished rows
    layout = row_layout([[1, 2]] * 6, 5, 2, slots=2, share_prompts=True, compact=True, check_every=1)
    rec = planned_record(layout, lambda b: 3 + b)
    assert [e.seq for e in rec.log if isinstance(e, Enter)] == [6, 0, 1, 2, 3, 4, 5]  # the entry, then rows in order
    # the record travels as JSON (the NCCL checks, a replay on other ranks) and comes back typed
    back = record_from_json(json.loads(json.dumps(record_to_json(rec))))
    assert back == rec and {type(e) for e in back.log} >= {Enter, Fork, Leave, Encode}
