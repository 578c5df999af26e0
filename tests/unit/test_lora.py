"""Low-rank adapters (model/lora.py, issue 30) on the one decoder step: B = 0 leaves the logits
torch.equal to the base; the dense step's gradients of A and B equal the plain-module reference
(rlt_mega/reference.py, plain autograd) in float64 and the chain rule applied to the base
model's weight gradient (dA = s B^T dW, dB = s dW A^T), and central finite differences; the
config's errors; the closed-form adapter count against the modules."""

import dataclasses

import pytest
import torch
from torch.nn.utils import parametrize

from rlt_mega.config import ConfigError, LoraConfig, ModelConfig, from_dict
from rlt_mega.model.rlt import build_model
from rlt_mega.cost.params import adapter_param_count
from rlt_mega.model.lora import adapters, apply_lora
from rlt_mega.parallel.adapter_files import adapter_state, load_adapter_state, merged_state
from rlt_mega.reference import reference_forward

V = 29


def cfg_of(rank=4, **kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, memory_block=3,
                max_seq_len=64, init_std=0.1, lora=LoraConfig(rank=rank, alpha=8.0))
    base.update(kw)
    return ModelConfig(**base)


def tokens(B=3, T=9, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def adapted(cfg, dtype=torch.float32, b_seed=None):
    """The base model of seed 0 with adapters; b_seed: B drawn at random (else 0, as at init)."""
    model = apply_lora(build_model(cfg, seed=0).to(dtype), cfg.lora, seed=5)
    if b_seed is not None:
        g = torch.Generator().manual_seed(b_seed)
        with torch.no_grad():
            for _, a in adapters(model):
                a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=g, dtype=torch.float64) * 0.1)
    return model


def weighted_loss(logits):
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=logits.dtype)
    return (logits * w).sum()


def test_adapters_at_init_leave_the_logits_equal_and_only_adapters_train():
    cfg, x = cfg_of(), tokens()
    base = build_model(cfg, seed=0)
    model = adapted(cfg)
    assert torch.equal(model(x), base(x))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert len(trainable) == 2 * (7 * 2 + 4 * 2 + 1)  # 7 per block, 4 cross per layer, recur_proj
    assert sum(p.numel() for n, p in model.named_parameters() if n in trainable) == adapter_param_count(cfg)
    own = cfg_of(share_weights=False, lora=LoraConfig(rank=3, targets=["q", "down", "cross_v"]))
    assert sum(a.lora_A.numel() + a.lora_B.numel() for _, a in adapters(adapted(own))) == adapter_param_count(own)


@pytest.mark.parametrize("variant", [{}, dict(qkv_bias=True, memory_block=1, share_weights=False)])
def test_adapter_gradients_equal_the_reference_and_the_chain_rule_float64(variant):
    cfg, x = cfg_of(**variant), tokens()
    model = adapted(cfg, torch.float64, b_seed=2)
    weighted_loss(model(x)).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    ref_model = adapted(cfg, torch.float64, b_seed=2)
    weighted_loss(reference_forward(ref_model, x)).backward()
    for n, p in ref_model.named_parameters():
        if p.requires_grad:
            assert (got[n] - p.grad).abs().max() <= 1e-12 * max(1.0, float(p.grad.abs().max())), n
    # the base model with the merged weights: its weight gradient dW, through the chain rule
    merged = build_model(cfg, seed=0).to(torch.float64)
    merged.load_state_dict(merged_state(model))
    weighted_loss(merged(x)).backward()
    for name, a in adapters(model):
        dW = merged.get_submodule(name).weight.grad
        assert torch.allclose(a.lora_A.grad, a.scale * a.lora_B.detach().t() @ dW, rtol=1e-10, atol=1e-12), name
        assert torch.allclose(a.lora_B.grad, a.scale * dW @ a.lora_A.detach().t(), rtol=1e-10, atol=1e-12), name


def test_adapter_gradients_against_finite_differences_float64():
    cfg, x = cfg_of(rank=2, n_layers=1), tokens(B=2, T=5)
    model = adapted(cfg, torch.float64, b_seed=3)
    weighted_loss(model(x)).backward()
    g = torch.Generator().manual_seed(4)
    checked = 0
    for name, a in adapters(model):
        for p in (a.lora_A, a.lora_B):
            idx = tuple(int(torch.randint(0, s, (1,), generator=g)) for s in p.shape)
            with torch.no_grad():
                old = p[idx].item()
                p[idx] = old + 1e-6
                up = weighted_loss(model(x)).item()
                p[idx] = old - 1e-6
                down = weighted_loss(model(x)).item()
                p[idx] = old
            fd = (up - down) / 2e-6
            assert abs(fd - p.grad[idx].item()) <= 1e-6 * max(1.0, abs(fd)), (name, idx)
            checked += 1
    assert checked == 2 * 12


def test_adapter_state_round_trip_and_merge():
    cfg, x = cfg_of(), tokens()
    model = adapted(cfg, b_seed=7)
    other = adapted(cfg)
    load_adapter_state(other, adapter_state(model))
    assert torch.equal(other(x), model(x))
    merged = build_model(cfg, seed=1)
    merged.load_state_dict(merged_state(model))  # a base model's names, every adapted weight merged
    assert torch.allclose(merged(x), model(x), atol=1e-5)
    with pytest.raises(ValueError, match="does not fit the model's adapters"):
        load_adapter_state(adapted(cfg_of(lora=LoraConfig(rank=4, targets=["q"]))), adapter_state(model))
    with pytest.raises(ValueError, match="apply them once"):
        apply_lora(model, cfg.lora)
    assert parametrize.is_parametrized(model.recur_proj)


def test_lora_config_errors():
    with pytest.raises(ConfigError, match="model.lora.dropout=0.1: .*set model.lora.dropout=0"):
        from_dict({"model": {"lora": {"rank": 8, "dropout": 0.1}}})
    with pytest.raises(ConfigError, match=r"model.lora.targets: unknown \['lm_head'\]"):
        from_dict({"model": {"lora": {"rank": 8, "targets": ["lm_head"]}}})
    with pytest.raises(ConfigError, match="model.lora.rank=-1"):
        from_dict({"model": {"lora": {"rank": -1}}})
    with pytest.raises(ConfigError, match="adapters are for the RLT"):
        from_dict({"model": {"arch": "dense", "lora": {"rank": 8}}})
    assert from_dict({"model": {"lora": {"rank": 8}}, "parallel": {"zero_stage": 3}}).parallel.zero_stage == 3
    assert from_dict({"model": {"lora": {"rank": 16, "alpha": 32}}}).model.lora.scale == 2.0


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "bf16_parameters"])
def test_rollout_on_merged_weights_replays_bit_for_bit(dtype):
    """The sampler and the replay build the step's products from the merged weights: replay is
    torch.equal to mu; the adapters move mu away from the base's."""
    from rlt_mega.rollout import Processing, SamplingParams, generate, replay

    model = adapted(cfg_of(vocab_size=64, memory_block=2), b_seed=9)
    base = build_model(cfg_of(vocab_size=64, memory_block=2), seed=0)
    if dtype == "bf16_parameters":
        model, base = model.to(torch.bfloat16), base.to(torch.bfloat16)
    run = "bf16" if dtype == "bf16" else "fp32"
    params = SamplingParams(Processing(temperature=0.7, top_p=0.9), max_new_tokens=7)
    prompts = [[1, 2, 3], [6, 7, 8, 9, 10], [3, 5, 7, 9, 11, 13]]
    rollout = generate(model, prompts, params, seeds=[1, 2, 3], pad_id=0, dtype=run)
    assert rollout.num_completion_tokens() > 0
    assert torch.equal(replay(model, rollout), rollout.mu)
    assert not torch.equal(replay(base, rollout), rollout.mu)


def test_grpo_step_with_adapters_is_on_policy_exactly_and_trains_only_adapters():
    """The real trainer (one process): the first minibatch's replay (verify_onpolicy) is
    torch.equal to mu, the optimizer holds the adapters only, the base does not move."""
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.train.grpo import build_trainer, grpo_config
    from tests.distributed.grpo_scenarios import grpo_cfg, odd, records

    cfg = grpo_config(grpo_cfg({}, {}, {"skip_onpolicy_replay": False, "minibatches": 1}))
    cfg.model.lora = LoraConfig(rank=4, alpha=8.0)
    trainer = build_trainer(cfg, ParallelDims.single(cfg.model, "cpu"), load_tokenizer("byte"), odd, records(8), [])
    model = trainer.engine.module
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scalars = trainer.job.step(0)
    assert scalars["ratio/onpolicy_max_dev"] == 0.0
    optimized = {id(p) for group in trainer.engine.optimizer.param_groups for p in group["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in optimized}
    assert names == {n for n in before if n.endswith(("lora_A", "lora_B"))}
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (n in names), n  # the adapters moved, nothing else


def test_planner_counts_adapters_and_their_optimizer_memory():
    """The planner's adapters: the module count at tp = pp = 1 and summed over a pipeline's
    stages; Adam's moments and the master copy are the adapters' only."""
    from rlt_mega.config import load_config
    from rlt_mega.cost.costmodel import estimate
    from rlt_mega.cost.layout import Layout
    from rlt_mega.cost.params import rank_adapter_numels

    for cfg in (cfg_of(), cfg_of(share_weights=False, lora=LoraConfig(rank=3, targets=["k", "up", "cross_o"]))):
        assert sum(rank_adapter_numels(cfg)) == adapter_param_count(cfg)
        assert sum(sum(rank_adapter_numels(cfg, 1, 2, s)) for s in range(2)) == adapter_param_count(cfg)
    full = load_config("configs/rlt_48x48.yaml")
    lora = load_config("configs/rlt_48x48.yaml", ["model.lora.rank=16", "model.lora.alpha=32"])
    a, b = (estimate(c.model, Layout.from_config(c)) for c in (full, lora))
    assert b["params"]["adapters"] == adapter_param_count(lora.model) and "adapters" not in a["params"]
    ma, mb = a["per_rank"][0]["memory"], b["per_rank"][0]["memory"]
    numels = rank_adapter_numels(lora.model, b["layout"]["tp"], b["layout"]["pp"], 0, b["layout"].get("pp_split"))
    assert mb["optimizer_state_numel"] < 0.05 * ma["optimizer_state_numel"]
    assert mb["optimizer_state_numel"] <= 2 * sum(numels)
    assert b["peak_memory"] < a["peak_memory"]
    # ZeRO-3: the frozen base rests partitioned beside the adapters (and is gathered with them)
    z3 = ["parallel.pp=1", "parallel.zero_stage=3"]
    full, lora = (load_config("configs/rlt_48x48.yaml", z3 + extra) for extra in ([], ["model.lora.rank=16"]))
    a, b = (estimate(c.model, Layout.from_config(c))["per_rank"][0]["memory"] for c in (full, lora))
    assert b["weights"] > a["weights"] and b["optimizer_state_numel"] < 0.05 * a["optimizer_state_numel"]


def test_init_from_a_base_export_with_adapters_is_not_a_config_mismatch(monkeypatch):
    """train.init_from with model.lora on an export without adapters (their base): no warning
    (B = 0 computes the export's function); another non-shape field still warns."""
    from rlt_mega.checkpoint_tools import export

    said = []
    monkeypatch.setattr(export.log, "warning", lambda *a: said.append(a[0] % a[1:]))
    base = cfg_of(rank=0)
    export.check_fits(base, dataclasses.replace(base, lora=LoraConfig(rank=16, alpha=32)), "base_export")
    assert said == []
    export.check_fits(base, dataclasses.replace(base, memory_block=base.memory_block + 1), "base_export")
    assert len(said) == 1 and "model.memory_block" in said[0]
