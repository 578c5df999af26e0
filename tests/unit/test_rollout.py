"""The rollout schedule: replay is bit-exact, mu is the real sampling distribution, dense
and rollout are the same function up to rounding, stopping rules, schedule bookkeeping."""

import dataclasses

import pytest
import torch

from rlt_mega.config import ModelConfig
from rlt_mega.learner.logprob import dense_logprobs
from rlt_mega.model.rlt import build_model
from rlt_mega.rollout import (Processing, SamplingParams, draw_uniforms, generate, make_generators, process_logits,
                              replay, sample)

V = 64
# Ragged prompts; with C=4 no length is a multiple of C except 8.
PROMPTS = [[1, 2, 3], [6, 7, 8, 9, 10], [8, 9, 10, 11, 12, 13, 14, 15], [3, 5, 7, 9, 11, 13]]


def tiny(C: int, seed: int = 0, init_std: float = 0.1, **kw):
    # init_std 0.1 (not 0.02) so that memory, recurrence and attention all move the logits
    # visibly: a schedule bug then shows as a large gap, not one hidden under rounding.
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, memory_block=C, max_seq_len=64,
                      init_std=init_std, **kw)
    return build_model(cfg, seed=seed)


def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; p-value from the regularized upper incomplete gamma."""
    stat = ((observed - expected) ** 2 / expected).sum()
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("C", [1, 4])
def test_replay_is_bit_exact(C, dtype):
    model = tiny(C)
    params = SamplingParams(Processing(temperature=0.7, top_p=0.9), max_new_tokens=9, stop_token_ids=(0,))
    rollout = generate(model, PROMPTS, params, seeds=[11, 12, 13, 14], pad_id=0, dtype=dtype)
    assert rollout.num_completion_tokens() > 0 and torch.isfinite(rollout.mu[rollout.mask]).all()
    again = replay(model, rollout)
    assert again.dtype == torch.float32
    assert torch.equal(again, rollout.mu)
    assert torch.equal(replay(model, rollout), rollout.mu)  # a second replay: fresh caches, same bits


def test_replay_with_top_k_and_greedy():
    model = tiny(4)
    for processing in (Processing(temperature=1.3, top_k=5), Processing(temperature=0.0)):
        params = SamplingParams(processing, max_new_tokens=6)
        rollout = generate(model, PROMPTS, params, seeds=[1, 2, 3, 4], pad_id=0)
        assert torch.equal(replay(model, rollout), rollout.mu)
        if processing.greedy:
            assert torch.equal(rollout.mu, torch.zeros_like(rollout.mu))  # one-hot: log 1


def test_schedule_records_encoder_calls_per_block():
    model = tiny(4)
    params = SamplingParams(Processing(), max_new_tokens=7)
    rollout = generate(model, PROMPTS, params, seeds=[0, 1, 2, 3], pad_id=0)
    s = rollout.schedule
    assert s.prompt_lens == [3, 5, 8, 6] and s.capacity == 8 + 7 and s.dtype == "fp32"
    # P_min = 3 < C: no prefill; every block [4k, 4k+4) encoded at step 4k+3, as it completes.
    assert s.num_steps == 8 + 7 - 1
    assert s.encoder_calls == [(0, 4), (4, 8), (8, 12)]
    assert rollout.tokens.shape == (4, s.num_steps + 1)
    # Longer prompts: the prefill covers the blocks inside every prompt.
    long = generate(model, [[1] * 9, [2] * 11], params, seeds=[0, 1], pad_id=0)
    assert long.schedule.encoder_calls[0] == (0, 8)
    assert long.schedule.encoder_calls[1:] == [(8, 12), (12, 16)]


def test_replay_rejects_a_tampered_schedule():
    model = tiny(4)
    rollout = generate(model, PROMPTS, SamplingParams(max_new_tokens=5), seeds=[0, 1, 2, 3], pad_id=0)
    rollout.schedule.encoder_calls = [(0, 3)] + rollout.schedule.encoder_calls
    with pytest.raises(RuntimeError, match="encoder calls"):
        replay(model, rollout)


def test_dense_and_rollout_agree_structurally():
    """Same function, different GEMM shapes: within 1e-4 in fp32 for prompt lengths that are
    not multiples of C. A model that sees memory earlier than vis(t) (the same weights with
    C=1) is far away, so a prompt-bounds mismatch would show."""
    model = tiny(4)
    params = SamplingParams(Processing(temperature=1.0), max_new_tokens=12)
    rollout = generate(model, PROMPTS, params, seeds=[5, 6, 7, 8], pad_id=0)
    with torch.no_grad():
        dense = dense_logprobs(model, rollout)
    gap = (dense - rollout.mu).abs().max()
    assert gap < 1e-4, gap
    eager = tiny(1)
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        wrong = dense_logprobs(eager, rollout)
    assert (wrong - rollout.mu).abs().max() > 1e-2


def test_stop_tokens_strings_and_length():
    model = tiny(2, seed=3)
    base = generate(model, PROMPTS, SamplingParams(max_new_tokens=10), seeds=[1, 2, 3, 4], pad_id=63)
    assert base.finish_reasons == ["length"] * 4 and base.completion_lens == [10] * 4
    # Stop on the token row 0 drew third: it ends there, the stop token included.
    stop = base.completion(0)[2]
    stopped = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, stop_token_ids=(stop,)),
                       seeds=[1, 2, 3, 4], pad_id=63)
    assert stopped.finish_reasons[0] == "stop_token"
    assert stopped.completion(0) == base.completion(0)[:base.completion(0).index(stop) + 1]
    # A finished row is fed the pad token after its end, and replay still matches.
    end = stopped.schedule.prompt_lens[0] + stopped.completion_lens[0]
    assert (stopped.tokens[0, end:] == 63).all()
    assert torch.equal(replay(model, stopped), stopped.mu)
    # Stop strings, over the decoded completion (here: one character per token).
    decode = lambda ids: "".join(chr(65 + i % 26) for i in ids)  # noqa: E731
    target = decode(base.completion(1)[3:5])
    by_string = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, stop_strings=(target,)),
                         seeds=[1, 2, 3, 4], pad_id=63, decode=decode)
    assert by_string.finish_reasons[1] == "stop_string"
    text = decode(by_string.completion(1))
    assert text.endswith(target) and target not in text[:-1]


def test_per_request_seeds():
    model = tiny(1)
    params = SamplingParams(Processing(temperature=1.0), max_new_tokens=8)
    a = generate(model, PROMPTS, params, seeds=[1, 2, 3, 4], pad_id=0)
    b = generate(model, PROMPTS, params, seeds=[1, 2, 3, 4], pad_id=0)
    c = generate(model, PROMPTS, params, seeds=[9, 2, 3, 4], pad_id=0)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mu, b.mu)
    assert a.completion(0) != c.completion(0)
    assert [a.completion(b) for b in (1, 2, 3)] == [c.completion(b) for b in (1, 2, 3)]


def test_bad_requests_are_refused():
    model = tiny(1)
    with pytest.raises(ValueError, match="one seed per prompt"):
        generate(model, PROMPTS, SamplingParams(), seeds=[1], pad_id=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, PROMPTS, SamplingParams(max_new_tokens=60), seeds=[1, 2, 3, 4], pad_id=0)
    with pytest.raises(ValueError, match="decode"):
        generate(model, PROMPTS, SamplingParams(stop_strings=("x",)), seeds=[1, 2, 3, 4], pad_id=0)
    with pytest.raises(ValueError, match="top_p"):
        Processing(top_p=0.0)
    rollout = generate(model, PROMPTS, SamplingParams(max_new_tokens=2), seeds=[1, 2, 3, 4], pad_id=0)
    with pytest.raises(ValueError, match="memory_block"):
        replay(tiny(4), rollout)


def test_sample_draws_the_processed_distribution():
    """From one fixed state: 20000 draws match exp(processed log-probs) (chi-square), and no
    token outside the top-k/top-p set is ever drawn."""
    torch.manual_seed(0)
    logits = torch.randn(1, V) * 0.5
    processing = Processing(temperature=0.7, top_k=40, top_p=0.9)
    logprobs = process_logits(logits, processing)
    kept = torch.isfinite(logprobs[0])
    assert 3 <= int(kept.sum()) < 40
    n = 20000
    draws = sample(logprobs.expand(n, V), draw_uniforms(make_generators(range(n)), 1, "cpu")[:, 0])
    counts = torch.bincount(draws, minlength=V).double()
    assert counts[~kept].sum() == 0
    expected = n * logprobs[0].exp().double()
    assert chi_square_pvalue(counts[kept], expected[kept]) > 1e-3


def test_sampler_mu_is_the_real_sampling_distribution():
    """At the sampler level: many requests from one fixed state (the same prompt), one token
    each at temperature 0.7, top-k and top-p. The empirical frequencies agree with exp(mu)
    (chi-square, with the unobserved kept tokens pooled), and no drawn token lies outside the
    top-p set of that state."""
    model = tiny(4, seed=1, init_std=0.3)
    n = 1500
    processing = Processing(temperature=0.7, top_k=30, top_p=0.9)
    rollout = generate(model, [[5, 6, 7, 8, 9]] * n, SamplingParams(processing, max_new_tokens=1),
                       seeds=list(range(n)), pad_id=0)
    drawn = rollout.tokens[:, 5]
    mu = rollout.mu[:, 0]
    for token in drawn.unique():  # every row drew from the same state: one mu per token
        assert mu[drawn == token].unique().numel() == 1
    prob = torch.zeros(V, dtype=torch.float64)
    prob[drawn] = mu.double().exp()
    counts = torch.bincount(drawn, minlength=V).double()
    seen = counts > 0
    observed = torch.cat([counts[seen], torch.zeros(1, dtype=torch.float64)])
    expected = torch.cat([n * prob[seen], (n * (1 - prob[seen].sum())).clamp_min(1e-9).view(1)])
    assert chi_square_pvalue(observed, expected) > 1e-3
    with torch.no_grad():
        state_logits = model(torch.tensor([[5, 6, 7, 8, 9]]))[:, -1]
    kept = torch.isfinite(process_logits(state_logits, processing)[0])
    assert kept[drawn].all() and int(kept.sum()) < V
