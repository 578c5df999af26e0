"""model.arch dense and looped (rlt_mega/model/baselines.py): the dense model against HF transformers'
Llama and Qwen2 with the same weights (through the export, which must load without custom
code), the looped model against the dense one and against a naive loop, the K/V cache per
(loop, layer) against the full forward, parameter and FLOP counts against the modules and
torch.utils.flop_counter, the export and import round trips, and the refusals."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rlt_mega.checkpoint_tools import import_hf, load_exported
from rlt_mega.checkpoint_tools.export import export_model, init_from, read_config
from rlt_mega.config import CheckpointingConfig, ConfigError, ModelConfig, ParallelConfig
from rlt_mega.model.rlt import build_model, param_counts
from rlt_mega.model.baselines import DenseLM, require_rlt
from rlt_mega.parallel.dims import resolve_layout
from rlt_mega.cost.flops import flop_rows, summarize
from rlt_mega.cost.params import rank_param_counts, rank_tensor_numels

transformers = pytest.importorskip("transformers")

V = 64


def cfg_of(arch="dense", **kw):
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64,
                norm_eps=1e-5, rope_theta=5000.0)
    return ModelConfig(arch=arch, **{**base, **kw})


def perturbed(cfg, seed=0):
    """A model whose norms and biases are not at their init (1, 0): every tensor matters."""
    model = build_model(cfg, seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("kind,kw", [
    ("llama", dict(tie_embeddings=False)),
    ("llama", dict(tie_embeddings=True, n_kv_heads=1)),
    ("qwen2", dict(qkv_bias=True)),
    ("qwen2", dict(qkv_bias=True, tie_embeddings=True, n_kv_heads=4)),
])
def test_dense_equals_hf_llama_and_qwen2_through_its_export(tmp_path, kind, kw):
    cfg = cfg_of(**kw)
    ours = perturbed(cfg)
    out = export_model(ours, cfg, tmp_path / "export", tokenizer_dir="byte" if V >= 260 else None)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == kind and "auto_map" not in config
    assert not (out / "modeling_rlt.py").exists()  # nothing custom: plain transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    expected = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    assert type(hf) is expected
    tokens = torch.randint(0, V, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # and back: the export reads as the same dense model (train.init_from) ...
    assert read_config(out) == cfg
    again = build_model(cfg, seed=9)
    init_from(again, out)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))
    # ... and imports as an RLT that reproduces it (docs/design.md's conversion)
    rlt_dir = import_hf(out, tmp_path / "rlt", tokenizer=None)
    rcfg, sd = load_exported(rlt_dir)
    rlt = build_model(rcfg, seed=0).eval()
    rlt.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(rlt(tokens), ref, atol=1e-5, rtol=1e-5)


def test_import_as_dense_holds_exactly_the_weights(tmp_path):
    cfg = cfg_of(qkv_bias=True)
    ours = perturbed(cfg, seed=3)
    out = export_model(ours, cfg, tmp_path / "export")
    dense_dir = import_hf(out, tmp_path / "dense", arch="dense", tokenizer=None)
    dcfg, sd = load_exported(dense_dir)
    assert dcfg.arch == "dense" and set(sd) == set(ours.state_dict())
    assert all(torch.equal(sd[n], t) for n, t in ours.state_dict().items())


def test_looped_with_one_loop_is_dense_and_two_loops_a_naive_loop():
    dense = build_model(cfg_of(), seed=5).eval()
    one = build_model(cfg_of("looped", loops=1), seed=5).eval()
    two = build_model(cfg_of("looped", loops=2), seed=5).eval()
    tokens = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(one(tokens), dense(tokens))
        # the naive loop: the dense blocks applied twice, written out with plain attention
        two.load_state_dict(dense.state_dict())
        h = dense.embed(tokens)
        T = tokens.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for _ in range(2):
            for blk in dense.blocks:
                x = blk.attn_norm(h)
                q, k, v = blk.attn.qkv(x)
                q, k = dense.rotary(q, 0), dense.rotary(k, 0)
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
                scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
                a = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
                h = h + blk.attn.out(a)
                h = h + blk.mlp(blk.mlp_norm(h))
        naive = dense.head(h)
        torch.testing.assert_close(two(tokens), naive, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(two(tokens), dense(tokens), atol=1e-3)


@pytest.mark.parametrize("arch,loops", [("dense", 1), ("looped", 3)])
def test_kv_cache_per_loop_and_layer_equals_the_full_forward(arch, loops):
    model = build_model(cfg_of(arch, loops=loops), seed=2).eval()
    assert model.num_cache_layers == loops * 2
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(12)
        parts = [model(tokens[:, :5], cache, 0)] + [model(tokens[:, t:t + 1], cache, t) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="no_grad"):
        model(tokens, model.new_cache(12), 0)


def test_checkpointing_gives_the_same_gradients():
    model = build_model(cfg_of("looped", loops=2), seed=4)
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    grads = []
    for ck in (CheckpointingConfig(), CheckpointingConfig(encoder=True)):
        model.zero_grad()
        model.set_checkpointing(ck)
        model(tokens).logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("arch,loops,kw", [
    ("rlt", 1, {}), ("dense", 1, dict(qkv_bias=True)), ("dense", 1, dict(tie_embeddings=True)),
    ("looped", 2, {}), ("looped", 3, dict(qkv_bias=True))])
def test_parameter_counts_match_the_modules(arch, loops, kw):
    cfg = cfg_of(arch, loops=loops, **kw)
    model = build_model(cfg, "meta")
    real = sum(p.numel() for p in model.parameters())
    assert param_counts(cfg)["total"] == real == rank_param_counts(cfg)["total"] == sum(rank_tensor_numels(cfg))
    tp2 = rank_param_counts(cfg, tp=2)["total"]
    assert tp2 < real  # the shards: the TP plan's patterns hold the same names
    if arch != "rlt":
        assert set(n.split(".")[0] for n, _ in model.named_parameters()) <= {"embed", "blocks", "final_norm",
                                                                            "lm_head"}
        assert real == param_counts(cfg_of("dense", **kw))["total"]  # the loops share the weights


@pytest.mark.parametrize("arch,loops,ck", [("dense", 1, False), ("looped", 2, False), ("looped", 3, True)])
def test_flop_counts_match_torch_flop_counter(arch, loops, ck):
    """The cost model's forward, backward and recomputation matmul FLOPs against what torch
    counts (the "math" attention kernel: the full T x T score matrix)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = cfg_of(arch, loops=loops, d_model=64, ffn_hidden=96)
    model = build_model(cfg, seed=0)
    checkpointing = CheckpointingConfig(encoder=ck)
    model.set_checkpointing(checkpointing)
    B, T = 2, 16
    tokens = torch.randint(0, V, (B, T))
    s = summarize(flop_rows(cfg, T, checkpointing, kernel="math"), T)
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            logits = model(tokens)
        with FlopCounterMode(display=False) as bwd:
            logits.sum().backward()
    assert fwd.get_total_flops() == pytest.approx(B * s["forward"], rel=1e-9)
    assert bwd.get_total_flops() == pytest.approx(B * (s["backward"] + s["recompute"]), rel=1e-9)
    assert (s["recompute"] > 0) == ck


def test_flops_per_token_order_the_families():
    """Per token: looped R=2 is twice dense's blocks; the RLT's decoder costs more than its encoder."""
    T = 64
    per = {a: summarize(flop_rows(cfg_of(a, loops=r), T), T)["per_token"]["model"]
           for a, r in (("dense", 1), ("looped", 2), ("rlt", 1))}
    head = summarize(flop_rows(cfg_of("dense"), T), T)["per_token_by_part"]["head"]
    assert per["looped"] - head == pytest.approx(2 * (per["dense"] - head))
    assert per["rlt"] > per["looped"]


def test_refusals_name_model_arch():
    with pytest.raises(ConfigError, match="model.loops=2 with model.arch=dense"):
        cfg_of("dense", loops=2)
    with pytest.raises(ConfigError, match="share_weights=false with model.arch=looped"):
        cfg_of("looped", share_weights=False)
    with pytest.raises(ConfigError, match="parallel.pp=2 with model.arch=dense"):
        resolve_layout(ParallelConfig(pp=2), cfg_of(), world_size=2)
    resolve_layout(ParallelConfig(tp=2), cfg_of(), world_size=4)  # TP x DP is fine
    with pytest.raises(ConfigError, match="GRPO runs the RLT sampler.*model.arch=looped"):
        require_rlt(cfg_of("looped", loops=2), "GRPO")
    with pytest.raises(ValueError, match="dense or looped"):
        DenseLM(cfg_of("rlt"))


def test_looped_export_has_no_modeling_code(tmp_path):
    cfg = cfg_of("looped", loops=2)
    model = build_model(cfg, seed=1)
    out = export_model(model, cfg, tmp_path / "looped")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "rlt" and config["arch"] == "looped" and "auto_map" not in config
    assert not (out / "modeling_rlt.py").exists()
    rcfg, sd = load_exported(out)
    assert rcfg == cfg and all(torch.equal(sd[n], t) for n, t in model.state_dict().items())
