"""The GRPO learner's dense schedule following the data (schedule/dense.py): compaction (each
position on the rows still inside their sequence) and shared prompts (a group's prompt run once,
then forked), against the plain padded dense schedule: the logits the loss reads and every
parameter's gradient in float64 (1e-12) and fp32 (1e-5 relative, norm-wise); C in {1, 3}, G in
{1, 4}, ragged prompts with one ending on a memory-block boundary and one not; the checkpointed
run; the learner's log-probs and a GRPO loss's gradient on sampled rollouts; the capture-ready
form (which runs every row); the plan's row counts; bad input."""

import dataclasses

import random

import pytest
import torch

from rlt_mega.config import CheckpointingConfig, ConfigError, load_config
from rlt_mega.learner.grpo import group_advantages, grpo_loss
from rlt_mega.learner.logprob import dense_logprobs, dense_rows
from rlt_mega.learner.objective import GRPOPart, grpo_batch
from rlt_mega.model.rlt import build_model
from rlt_mega.model.dense_decode import Decoder
from rlt_mega.loss import DENSE_ROWS
from rlt_mega.schedule.dense import DenseRows, DensePlan
from rlt_mega.rollout import Processing, SamplingParams, generate
from rlt_mega.train.grpo import grpo_config
from tests.unit.test_fused_decoder import V, cfg_of, rel

SWITCHES = [(True, False), (False, True), (True, True)]  # (compact, share_prompts)


def grouped_batch(prompt_lens, G, seed=0):
    """Groups of G rows with the same prompt (prompt_lens[g] tokens) and completions of 1-8
    tokens -> dense inputs (B, T), lengths (positions each row needs), prompt lens, group ids."""
    g = torch.Generator().manual_seed(seed)
    seqs, plens, lengths, groups = [], [], [], []
    for gi, p in enumerate(prompt_lens):
        prompt = torch.randint(1, V, (p,), generator=g)
        for _ in range(G):
            n = int(torch.randint(1, 9, (1,), generator=g))
            seqs.append(torch.cat([prompt, torch.randint(1, V, (n,), generator=g)]))
            plens.append(p)
            lengths.append(p + n - 1)
            groups.append(gi)
    x = torch.zeros(len(seqs), max(len(s) for s in seqs) - 1, dtype=torch.long)
    for b, s in enumerate(seqs):
        x[b, :len(s) - 1] = s[:-1]
    return x, lengths, plens, groups


def logits_and_grads(cfg, x, reads, rows, dtype, decoder="none", static=False, autocast=False):
    """A loss of the logits of the positions the GRPO loss reads, row b's [P_b - 1, L_b) with
    reads = (L, P) (with compaction the others are not computed)."""
    lengths, plens = reads
    model = build_model(cfg, seed=0).to(dtype)
    model.set_checkpointing(CheckpointingConfig(decoder=decoder))
    if static:
        model.decoder = Decoder(static=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(x, rows=rows)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=logits.dtype)
    t = torch.arange(x.shape[1])[None, :]
    needed = ((t < torch.tensor(lengths)[:, None]) & (t >= torch.tensor(plens)[:, None] - 1))[..., None]
    (logits * w * needed).sum().backward()
    return (logits * needed).detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("C", [1, 3])
@pytest.mark.parametrize("G", [1, 4])
def test_logits_and_gradients_equal_the_padded_schedule_in_float64(C, G):
    # prompts of 3 and 6 tokens end on a memory-block boundary (C = 3), 5 and 2 do not
    x, lengths, plens, groups = grouped_batch([3, 5, 6, 2], G, seed=C + G)
    cfg = cfg_of(memory_block=C)
    ref_logits, ref_grads = logits_and_grads(cfg, x, (lengths, plens), None, torch.float64)
    for compact, share in SWITCHES:
        rows = DenseRows(tuple(lengths), tuple(plens), tuple(groups) if share else None, compact)
        logits, grads = logits_and_grads(cfg, x, (lengths, plens), rows, torch.float64)
        assert rel(logits, ref_logits) <= 1e-12, (compact, share)
        for n, g in ref_grads.items():
            assert rel(grads[n], g) <= 1e-12, (compact, share, n)


@pytest.mark.parametrize("decoder", ["none", "step", "every_k"])
def test_fp32_gradients_within_1e5_and_the_checkpointed_run_is_the_same(decoder):
    x, lengths, plens, groups = grouped_batch([4, 7, 3], 4, seed=5)
    cfg = cfg_of(memory_block=3, qkv_bias=True)
    _, ref = logits_and_grads(cfg, x, (lengths, plens), None, torch.float32)
    rows = DenseRows(tuple(lengths), tuple(plens), tuple(groups), True)
    _, grads = logits_and_grads(cfg, x, (lengths, plens), rows, torch.float32, decoder=decoder)
    for n, g in ref.items():
        assert rel(grads[n], g) <= 1e-5, n
    if decoder != "none":  # every checkpointing mode gives the same gradients, bit for bit
        _, saved = logits_and_grads(cfg, x, (lengths, plens), rows, torch.float32, decoder="none")
        assert all(torch.equal(saved[n], grads[n]) for n in grads)


def test_bf16_autocast_gradients_within_bf16_rounding():
    x, lengths, plens, groups = grouped_batch([4, 6], 4, seed=6)
    cfg = cfg_of(memory_block=3)
    _, ref = logits_and_grads(cfg, x, (lengths, plens), None, torch.float32, autocast=True)
    _, grads = logits_and_grads(cfg, x, (lengths, plens), DenseRows(tuple(lengths), tuple(plens), tuple(groups)),
                                torch.float32, autocast=True)
    for n, g in ref.items():
        assert rel(grads[n], g) <= 2e-2, n


def test_the_plan_runs_only_the_row_steps_the_data_needs():
    x, lengths, plens, groups = grouped_batch([3, 5, 6, 2], 4, seed=1)
    B, T = x.shape
    compact = DensePlan(DenseRows(tuple(lengths), tuple(plens), None, True), T, torch.device("cpu"))
    assert compact.active == sum(lengths)
    # compaction alone: rows sorted by length, the live rows of every position a prefix
    assert all(s is None or s.idx is None for s in compact.steps)
    both = DensePlan(DenseRows(tuple(lengths), tuple(plens), tuple(groups), True), T, torch.device("cpu"))
    assert both.active == sum(lengths) - sum(3 * p for p in (3, 5, 6, 2))  # G - 1 = 3 rows skip each prompt
    assert sum(len(s.forks) for s in both.steps if s is not None) == 4
    # positions after the last fork are a prefix again; some before it run rows by index
    assert all(s.idx is None for s in both.steps[6:] if s is not None)
    assert any(s.idx is not None for s in both.steps[:6] if s is not None)
    shared = DensePlan(DenseRows(tuple(lengths), tuple(plens), tuple(groups), False), T, torch.device("cpu"))
    assert shared.active == B * T - sum(3 * p for p in (3, 5, 6, 2))


def test_the_dense_plan_is_the_row_schedule_run_over_the_batch():
    """DensePlan's rows come from the sampler's RowPlan (schedule/rows.py); against the rule written
    directly: row b runs [0, L_b), a shared group's other rows only [p, L_b), the representative
    (longest) row runs the prefix; rows of length 0 never run; forks at p."""
    rng = random.Random(0)
    for _ in range(60):
        B, T = rng.randint(1, 7), rng.randint(2, 12)
        plens = [0] * B
        groups = [rng.randint(0, 3) for _ in range(B)]
        for g in set(groups):
            p = rng.randint(1, T)
            for b in range(B):
                plens[b] = p if groups[b] == g else plens[b]
        lengths = [0 if rng.random() < 0.15 else rng.randint(plens[b], T + 2) for b in range(B)]
        compact = rng.random() < 0.7
        plan = DensePlan(DenseRows(tuple(lengths), tuple(plens), tuple(groups), compact), T, torch.device("cpu"))
        L = [min(x, T) for x in lengths] if compact else [T] * B
        start, forks = [0] * B, set()
        for g in set(groups):
            members = sorted((b for b in range(B) if groups[b] == g and L[b] > 0), key=lambda b: (-L[b], b))
            for b in members[1:]:
                start[b] = min(plens[b], L[b])
                if L[b] > plens[b] and plens[b] < T:
                    forks.add(plens[b])
        for t in range(T):
            want = sorted(b for b in range(B) if start[b] <= t < L[b])
            s = plan.step(t)
            got = list(range(B)) if s is None else sorted(s.caller.tolist())
            assert got == want, (t, lengths, plens, groups, compact)
            assert (t in forks) == bool(s is not None and s.forks)


def test_the_capture_ready_form_runs_every_row():
    """Its decoder ignores the rows (the encoder's prompt pack and the head's positions are the
    model's, around any decoder): z and every gradient are those of the padded decoder."""
    x, lengths, plens, groups = grouped_batch([3, 5], 4, seed=2)
    rows = DenseRows(tuple(lengths), tuple(plens), tuple(groups), True)
    w = torch.randn(*x.shape, 64, generator=torch.Generator().manual_seed(1))

    def decoder_grads(cfg, rows):
        model = build_model(cfg, seed=0)
        model.decoder = Decoder(static=True)
        emb = model.embed(x)
        z = model.decode_dense(emb, model.memory_kv(model.memory_norm(model.encode(emb))), rows=rows)
        (z * w[..., :z.shape[-1]]).sum().backward()
        return [z.detach()] + [p.grad for p in model.parameters() if p.grad is not None]

    cfg = cfg_of(memory_block=3)
    assert all(torch.equal(a, b) for a, b in zip(decoder_grads(cfg, rows), decoder_grads(cfg, None)))


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_the_prompt_pack_encodes_each_prompt_once_and_equals_the_padded_encoder(kv_heads):
    """MQA and MHA (the other tests run GQA); a row whose completion is one token (no own
    positions), one with none (L = 0: not packed); float64 against every row encoded whole."""
    from rlt_mega.schedule.prompt_pack import PromptPack

    x, lengths, plens, groups = grouped_batch([3, 5, 4], 3, seed=7)
    lengths[1], lengths[4] = plens[1], 0
    rows = DenseRows(tuple(lengths), tuple(plens), tuple(groups), True)
    B, T = x.shape
    pack = PromptPack(rows, T, torch.device("cpu"))
    live = {g for g, n in zip(groups, lengths) if n > 0}
    assert pack.total == sum(plens[groups.index(g)] for g in live) + sum(n - p for n, p in zip(lengths, plens) if n > 0)
    model = build_model(cfg_of(memory_block=3, n_kv_heads=kv_heads), seed=0).to(torch.float64)
    with torch.no_grad():
        emb = model.embed(x)
        ref = model.encode(emb)
        packed = pack.unpack(model.encode(pack.pack(emb), documents=pack))
    read = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # row b's memory positions [0, L_b)
    assert rel(packed[read], ref[read]) <= 1e-12
    assert not packed[~read].any()
    with pytest.raises(ValueError, match="fewer than its prompt"):
        PromptPack(DenseRows((2, 6), (3, 3), (0, 0)), 6, torch.device("cpu"))


def test_with_compaction_the_head_runs_on_the_positions_the_loss_reads_only():
    x, lengths, plens, groups = grouped_batch([3, 5], 4, seed=3)
    rows = DenseRows(tuple(lengths), tuple(plens), tuple(groups), True)
    T = x.shape[1]
    idx = rows.read_index(T, torch.device("cpu"))
    assert idx.tolist() == [b * T + t for b in range(len(lengths)) for t in range(plens[b] - 1, lengths[b])]
    model = build_model(cfg_of(memory_block=3), seed=0)
    calls = []
    model.lm_head.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    logits = model(x, rows=rows)
    assert calls == [idx.numel()]  # one head GEMM over the read positions, fewer than B x T
    full = model(x).reshape(len(lengths) * T, -1)
    flat = logits.reshape(len(lengths) * T, -1)
    torch.testing.assert_close(flat[idx], full[idx], rtol=1e-6, atol=1e-6)
    unread = torch.ones(flat.shape[0], dtype=torch.bool).index_fill_(0, idx, False)
    assert idx.numel() < flat.shape[0] and not flat[unread].any()
    from tests.unit.test_baselines import cfg_of as baseline_cfg  # the dense and looped baselines: the same head

    for arch in ("dense", "looped"):
        baseline = build_model(baseline_cfg(arch, vocab_size=V, **({"loops": 2} if arch == "looped" else {})), seed=0)
        trimmed = baseline(x, rows=rows).reshape(len(lengths) * T, -1)
        torch.testing.assert_close(trimmed[idx], baseline(x).reshape(len(lengths) * T, -1)[idx], rtol=1e-6, atol=1e-6)
        assert not trimmed[unread].any()


def grouped_rollout(model, G=4, max_new_tokens=8):
    prompts = [[1, 2, 3]] * G + [[6, 7, 8, 9, 10]] + [[3, 5, 7, 9, 11, 13]] * G
    return generate(model, prompts, SamplingParams(Processing(temperature=0.9, top_p=0.95), max_new_tokens=max_new_tokens,
                                                   stop_token_ids=tuple(range(8))),
                    seeds=list(range(1, len(prompts) + 1)), pad_id=0)


def test_the_learners_log_probs_and_a_grpo_gradient_equal_the_padded_schedule():
    cfg = cfg_of(vocab_size=48, memory_block=3, max_seq_len=48)
    rollout = grouped_rollout(build_model(cfg, seed=0))
    assert len(set(rollout.completion_lens)) > 2  # ragged completions (the stop token)
    rows = dense_rows(rollout, True, True)
    assert rows.groups == (0,) * 4 + (1,) + (2,) * 4
    assert rows.lengths == tuple(p + n - 1 for p, n in zip(rollout.schedule.prompt_lens, rollout.completion_lens))
    adv = group_advantages(torch.linspace(0.0, 1.0, rollout.batch_size), group_size=rollout.batch_size)
    out = {}
    for switches in [(False, False), *SWITCHES]:
        model = build_model(cfg, seed=0)
        logp = dense_logprobs(model, rollout, *switches)
        loss = grpo_loss(logp, rollout.mu, adv, rollout.mask, eps_low=0.2, eps_high=0.28).loss
        (loss / rollout.num_completion_tokens()).backward()
        out[switches] = (logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    ref_logp, ref_grads = out[(False, False)]
    for switches in SWITCHES:
        logp, grads = out[switches]
        assert (logp - ref_logp)[rollout.mask].abs().max() <= 1e-5
        for n, g in ref_grads.items():
            assert rel(grads[n], g) <= 1e-5, (switches, n)


def test_grpo_batches_carry_their_rows():
    cfg = cfg_of(vocab_size=48, memory_block=3, max_seq_len=48)
    model = build_model(cfg, seed=0)
    a, b = grouped_rollout(model, G=2, max_new_tokens=5), grouped_rollout(model, G=3, max_new_tokens=7)
    parts = [GRPOPart(ro, ro.mu, torch.zeros(ro.batch_size)) for ro in (a, b)]
    assert DENSE_ROWS not in grpo_batch(parts, compact=False, share_prompts=False)  # the padded arm
    batch = grpo_batch(parts)
    rows = batch[DENSE_ROWS]
    assert rows.batch_size == batch["inputs"].shape[0] == a.batch_size + b.batch_size
    assert rows.groups == (0, 0, 1, 2, 2, 3, 3, 3, 4, 5, 5, 5)  # a part's groups stay its own
    assert rows.lengths[:a.batch_size] == dense_rows(a, True, True).lengths


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="group 0 has prompts of lengths 3 and 4"):
        DenseRows((5, 6), (3, 4), (0, 0))
    with pytest.raises(ValueError, match="one entry a row"):
        DenseRows((5, 6), (3,))
    with pytest.raises(ValueError, match="dense rows describe 2 rows, the batch has 3"):
        build_model(cfg_of(), seed=0)(torch.ones(3, 6, dtype=torch.long), rows=DenseRows((5, 6), (3, 3)))


def test_the_removed_switches_say_so():
    """The learner always follows the data (no key chooses the padded schedule), and with CUDA
    graphs the captured form runs every row instead of refusing."""
    for key in ("grpo.dense_compact", "grpo.dense_share_prompts"):
        with pytest.raises(ConfigError, match=f"{key} was removed"):
            load_config(None, [f"{key}=false"])
    cfg = load_config(None, ["grpo.prompts_per_step=2", "grpo.group_size=2"])
    grpo_config(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cuda_graphs=True)))


def test_rows_a_position_skips_never_read_stale_buffers():
    """The run's buffers come from a reused workspace: fill every free slab with NaN bytes
    before the run; rows a position does not run must still contribute exactly nothing."""
    from rlt_mega.model.workspace import WORKSPACE

    x, lengths, plens, groups = grouped_batch([3, 5, 6], 4, seed=4)
    cfg = cfg_of(memory_block=3)
    rows = DenseRows(tuple(lengths), tuple(plens), tuple(groups), True)
    for decoder in ("none", "step", "every_k"):
        ref = logits_and_grads(cfg, x, (lengths, plens), rows, torch.float32, decoder=decoder)[1]
        for free in WORKSPACE._free.values():
            for slab in free:
                slab.fill_(255)
        grads = logits_and_grads(cfg, x, (lengths, plens), rows, torch.float32, decoder=decoder)[1]
        assert all(torch.equal(grads[n], ref[n]) for n in ref), decoder
