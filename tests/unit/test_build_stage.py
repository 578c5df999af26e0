"""A rank builds only its own pipeline stage (parallel/build.py): from the meta device, every
parameter of the stage takes the value it has in the single-process model of the same seed,
and no other parameter is ever materialised (the initialisation is a function of (seed,
parameter name) alone). Tensor-parallel shards are covered by the distributed tests, which
compare every layout with the single-process model."""

from types import SimpleNamespace

import pytest
import torch

from rlt_mega.config import ModelConfig
from rlt_mega.model.rlt import build_model
from rlt_mega.model import init as rlt_module
from rlt_mega.parallel import build
from rlt_mega.parallel.dims import split_layers

CFG = dict(vocab_size=40, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, memory_block=2,
           max_seq_len=16)


def stage_dims(stage: int, num_stages: int, n_layers: int):
    layers = split_layers(n_layers, num_stages)
    return SimpleNamespace(pp=num_stages, tp=1, layers=layers[stage], is_first_stage=stage == 0,
                           is_last_stage=stage == num_stages - 1)


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True, "share_weights": False, "qkv_bias": True}])
def test_each_stage_equals_its_part_of_the_single_process_model(kw, monkeypatch):
    cfg = ModelConfig(**{**CFG, **kw})
    full = dict(build_model(cfg, seed=9).named_parameters())
    requested = []
    original = build.initial_value
    monkeypatch.setattr(build, "initial_value", lambda *a: requested.append(a[1]) or original(*a))
    seen = set()
    for stage in range(2):
        requested.clear()
        model = build.build_stage(cfg, stage_dims(stage, 2, cfg.n_layers), seed=9)
        mine = dict(model.named_parameters())
        assert not any(p.is_meta for p in mine.values())
        assert sorted(requested) == sorted(mine)  # nothing else was ever materialised
        for name, p in mine.items():  # a tied lm_head on the last stage is a copy of the embedding
            assert torch.equal(p, full.get(name, full["embed.weight"])), name
        seen |= set(mine)
        if kw.get("tie_embeddings"):
            assert (stage == 0) == ("embed.weight" in mine) and (stage == 1) == ("lm_head.weight" in mine)
    assert seen >= set(full)  # the stages together hold the whole model


def test_the_initialisation_is_a_function_of_seed_and_name():
    cfg = ModelConfig(**CFG)
    a, b = build_model(cfg, seed=1), build_model(cfg, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    value = rlt_module.initial_value(cfg, "blocks.2.attn.q.weight", (32, 32), 1)
    assert torch.equal(value, dict(a.named_parameters())["blocks.2.attn.q.weight"])
    c = build_model(cfg, seed=2)
    assert not torch.equal(dict(a.named_parameters())["embed.weight"], dict(c.named_parameters())["embed.weight"])
    # residual-stream outputs are scaled down, norms start at 1
    assert float(dict(a.named_parameters())["blocks.0.attn.o.weight"].detach().std()) < 0.02 / 2
    assert torch.equal(dict(a.named_parameters())["final_norm.weight"], torch.ones(32))
