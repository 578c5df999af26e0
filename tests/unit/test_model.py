"""The RLT model on one device: gradients, BPTT paths, checkpointing, causality, visibility,
incremental schedule, weight sharing and parameter counts (docs/design.md: "The model", "One
transition, three schedules", "Gradients")."""

import pytest
import torch
from reference import reference_logits

from rlt_mega.config import CheckpointingConfig, ModelConfig
from rlt_mega.model.rlt import build_model, param_counts, vis
from rlt_mega.model.cache import KVCache


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=23, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=24, memory_block=2,
                max_seq_len=64)
    base.update(kw)
    return ModelConfig(**base)


def tokens(B=2, T=6, V=23, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def scalar_loss(logits, seed=1):
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed), dtype=logits.dtype)
    return (logits * w).sum()


# ------------------------------------------------------------------ gradients
@pytest.mark.parametrize("name", ["blocks.0.attn.q.weight", "blocks.1.mlp.down.weight", "blocks.0.attn_norm.weight",
                                  "cross.0.attn.k.weight", "cross.1.attn.o.weight", "cross.0.cross_norm.weight",
                                  "recur_proj.weight", "recur_norm.weight", "embed.weight", "z_init",
                                  "null_memory", "memory_norm.weight", "lm_head.weight"])
def test_gradient_matches_finite_differences(name):
    torch.manual_seed(0)
    model = build_model(tiny(), seed=0).double()
    x = tokens()
    param = dict(model.named_parameters())[name]
    loss = scalar_loss(model(x))
    (grad,) = torch.autograd.grad(loss, [param])
    flat = param.data.view(-1)
    idx = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(3))[:6]
    if name == "embed.weight":  # rows of tokens that occur, so the entries matter
        row = int(x[0, 0])
        idx = torch.arange(row * param.shape[1], row * param.shape[1] + 6)
    eps = 1e-6
    for i in idx.tolist():
        orig = flat[i].item()
        with torch.no_grad():
            flat[i] = orig + eps
            up = scalar_loss(model(x)).item()
            flat[i] = orig - eps
            down = scalar_loss(model(x)).item()
            flat[i] = orig
        fd = (up - down) / (2 * eps)
        analytic = grad.view(-1)[i].item()
        assert abs(fd - analytic) <= 1e-6 * max(1.0, abs(fd)), (name, i, fd, analytic)


def test_model_matches_independent_reference_values_and_gradients():
    model = build_model(tiny(memory_block=3, qkv_bias=True), seed=0).double()
    x = tokens(T=7)
    ours, ref = model(x), reference_logits(model, x)
    assert (ours - ref).abs().max() < 1e-12
    params = list(model.parameters())
    g_ours = torch.autograd.grad(scalar_loss(ours), params)
    g_ref = torch.autograd.grad(scalar_loss(ref), params, allow_unused=True)
    for p, a, b in zip(params, g_ours, g_ref):
        assert torch.allclose(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("path", ["detach_recurrence", "detach_decoder_kv", "detach_memory"])
def test_every_bptt_path_carries_gradient(path):
    model = build_model(tiny(), seed=0).double()
    x = tokens()
    params = list(model.parameters())
    full = torch.autograd.grad(scalar_loss(reference_logits(model, x)), params, allow_unused=True)
    cut = torch.autograd.grad(scalar_loss(reference_logits(model, x, **{path: True})), params, allow_unused=True)
    ours = torch.autograd.grad(scalar_loss(model(x)), params)
    differs = any((a - (b if b is not None else 0)).abs().max() > 1e-8 for a, b in zip(full, cut))
    assert differs, f"{path} left the gradient unchanged: that path carries no gradient"
    # and the model itself detaches none: it equals the full reference
    for a, b in zip(ours, full):
        assert torch.allclose(a, b if b is not None else torch.zeros_like(a), atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("mode", [dict(decoder="step"), dict(decoder="every_k", decoder_k=3),
                                  dict(decoder="none", encoder=True), dict(decoder="every_k", decoder_k=2, encoder=True)])
def test_checkpointing_gradients_are_bit_identical(mode):
    cfg = tiny(memory_block=3)
    x = tokens(T=9)

    def grads(ckpt):
        model = build_model(cfg, seed=0)
        model.set_checkpointing(ckpt)
        loss = scalar_loss(model(x))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    base_loss, base = grads(CheckpointingConfig())
    loss, other = grads(CheckpointingConfig(**mode))
    assert torch.equal(base_loss, loss)
    for a, b in zip(base, other):
        assert torch.equal(a, b)


def test_a_second_backward_through_the_same_graph_gives_the_same_gradients():
    # The decoder K/V and memory K/V gradients accumulate in buffers outside autograd
    # (DecoderKV, MemoryKV); each backward must start them from zero.
    model = build_model(tiny(memory_block=3), seed=0)
    loss = scalar_loss(model(tokens(T=9)))
    params = list(model.parameters())
    first = torch.autograd.grad(loss, params, retain_graph=True)
    second = torch.autograd.grad(loss, params)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ structure
def test_causality():
    model = build_model(tiny(), seed=0)
    x = tokens(T=8)
    base = model(x)
    for s in range(8):
        y = x.clone()
        y[:, s] = (y[:, s] + 1) % 23
        out = model(y)
        assert torch.equal(out[:, :s], base[:, :s]), f"changing x_{s} changed earlier logits"
        assert not torch.equal(out[:, s], base[:, s])


@pytest.mark.parametrize("C", [1, 3, 4])
def test_decoder_sees_exactly_null_plus_visible_memory(C):
    model = build_model(tiny(memory_block=C), seed=0).double()
    x = tokens(B=1, T=9)
    with torch.no_grad():
        m = model.memory_norm(model.encode(model.embed(x)))
    m = m.clone().requires_grad_(True)
    null = model.null_memory
    z = model.decode_dense(model.embed(x), model.memory_kv(m))
    logits = model.head(z)
    for t in range(9):
        g_m, g_null = torch.autograd.grad(logits[0, t].sum(), [m, null], retain_graph=True)
        seen = (g_m[0].abs().sum(-1) > 0).nonzero().flatten().tolist()
        assert seen == list(range(vis(t, C))), (t, seen)
        assert g_null.abs().sum() > 0, "the null memory slot must always be visible"


@pytest.mark.parametrize("C", [1, 3, 4])
@pytest.mark.parametrize("first_chunk", [1, 2, 5])
def test_incremental_schedule_equals_dense(C, first_chunk):
    """Encoder chunk by chunk (a first 'prompt' chunk of any length, then whatever new
    tokens exist when a memory block completes) and the rollout's decoder step by step (the
    decoder step's no-grad form over a K/V state, model/decoder.py StepRunner) give the dense
    logits: the prompt length plays no part."""
    model = build_model(tiny(memory_block=C, vocab_size=31, d_model=32), seed=0)
    x = tokens(B=3, T=11, V=31)
    B, T = x.shape
    with torch.no_grad():
        dense = model(x)
        emb = model.embed(x)
        enc = KVCache(2, T)
        (runner,) = model.decoder.runners(model, range(2), True, [(B, T)], torch.float32, torch.float32)
        encoded, committed = 0, 0
        h_all = []
        z, outs = model.initial_state(B), []
        for t in range(T):
            known = max(first_chunk, t + 1)  # tokens whose values are known at step t
            if vis(t, C) > committed:
                if known > encoded:
                    h_all.append(model.encode(emb[:, encoded:known], start=encoded, cache=enc))
                    encoded = known
                m = model.memory_norm(torch.cat(h_all, 1)[:, committed:vis(t, C)])
                runner.write_memory(m, committed)
                committed = vis(t, C)
            z = runner.step(runner.at(t, t, B), z, emb[:, t].contiguous())
            outs.append(model.head(z))
    assert (torch.stack(outs, 1) - dense).abs().max() < 1e-5


# ------------------------------------------------------------------ weights
def test_weight_sharing_one_tensor_two_uses():
    cfg = tiny()
    shared = build_model(cfg, seed=0)
    for i in range(cfg.n_layers):
        assert shared.decoder_block(i) is shared.blocks[i]
    # the same weights split into separate encoder and decoder copies
    split = build_model(tiny(share_weights=False), seed=0)
    with torch.no_grad():
        for name, p in shared.named_parameters():
            dict(split.named_parameters())[name].copy_(p)
            if name.startswith("blocks."):
                dict(split.named_parameters())["dec_" + name].copy_(p)
    x = tokens()
    assert torch.equal(shared(x), split(x))
    scalar_loss(shared(x)).backward()
    scalar_loss(split(x)).backward()
    sp = dict(split.named_parameters())
    for name, p in shared.named_parameters():
        if name.startswith("blocks."):
            both = sp[name].grad + sp["dec_" + name].grad
            assert torch.allclose(p.grad, both, atol=1e-6, rtol=1e-5), name
            assert sp["dec_" + name].grad.abs().sum() > 0 and sp[name].grad.abs().sum() > 0


@pytest.mark.parametrize("kw", [{}, dict(share_weights=False), dict(tie_embeddings=True), dict(qkv_bias=True),
                                dict(n_kv_heads=1), dict(n_kv_heads=4, ffn_hidden=40)])
def test_parameter_count_closed_form(kw):
    cfg = tiny(**kw)
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg)["total"]


def test_cluster_config_on_meta_device():
    from rlt_mega.config import load_config

    cfg = load_config("configs/rlt_48x48.yaml")
    model = build_model(cfg.model, "meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert n == param_counts(cfg.model)["total"]
    assert 3.0e9 < n < 4.0e9  # 48 shared blocks + 48 cross blocks + 2 x 49152 x 2048 embeddings


def test_bf16_autocast_forward_backward():
    model = build_model(tiny(), seed=0)
    x = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    assert logits.dtype == torch.float32
    scalar_loss(logits).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        assert (logits - model(x)).abs().max() < 0.1
