"""Which layout changes a distributed checkpoint survives with its optimizer state (one process,
no DeepSpeed): the rules of rlt_mega/parallel/reshard.py, and the patterns that tell DeepSpeed's
universal-checkpoint converter how our tensor-parallel slices join."""

import re
from pathlib import Path

import pytest

from rlt_mega.checkpoint import CheckpointError
from rlt_mega.config import ModelConfig
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.reshard import (REPLICATED, SAME, UNIVERSAL, resumable_on, resume_plan,
                                       universal_checkpoint_info)

CKPT = Path("runs/x/step_00000010")


def layout(tp=1, pp=1, dp=1, zero=0, split=None):
    out = {"tp": tp, "pp": pp, "dp": dp, "zero_stage": zero}
    if split is not None:
        out["pp_split"] = split
    return out


@pytest.mark.parametrize("saved,current,plan", [
    (layout(tp=2, pp=2, dp=2, zero=1, split=[1, 1]), layout(tp=2, pp=2, dp=2, zero=1, split=[1, 1]), SAME),
    (layout(pp=2, dp=2, zero=1), layout(pp=2, dp=2, zero=1, split=[2, 2]), SAME),  # written before pp_split
    (layout(dp=2, zero=0), layout(dp=1, zero=0), REPLICATED),
    (layout(tp=2, dp=2, zero=1), layout(tp=2, dp=1, zero=1), UNIVERSAL),
    (layout(dp=2, zero=1), layout(dp=4, zero=2), UNIVERSAL),
    (layout(dp=2, zero=2), layout(dp=2, zero=1), UNIVERSAL),
    (layout(dp=2, zero=3), layout(dp=1, zero=3), UNIVERSAL),
])
def test_layout_changes_that_keep_the_optimizer_state(saved, current, plan):
    assert resume_plan(saved, current, CKPT) == plan


@pytest.mark.parametrize("saved,current,why", [
    (layout(tp=2, dp=1, zero=1), layout(tp=1, dp=2, zero=1), "tensor/pipeline layout changed"),
    (layout(pp=2, zero=1, split=[3, 1]), layout(pp=2, zero=1, split=[2, 2]), "tensor/pipeline layout changed"),
    (layout(dp=2, zero=0), layout(dp=2, zero=1), "not to or from ZeRO-0"),
    (layout(dp=2, zero=2), layout(dp=2, zero=3), "ZeRO-3 optimizer state only to ZeRO-3"),
    (layout(tp=2, dp=2, zero=3), layout(tp=2, dp=1, zero=3), "does not slice tensor-parallel shards"),
])
def test_other_changes_are_refused_naming_both_layouts_and_the_way_out(saved, current, why):
    with pytest.raises(CheckpointError) as err:
        resume_plan(saved, current, CKPT)
    message = str(err.value)
    assert why in message
    assert f"written with layout {{tp={saved['tp']}, pp={saved['pp']}, dp={saved['dp']}" in message
    assert f"this run has {{tp={current['tp']}, pp={current['pp']}, dp={current['dp']}" in message
    assert f"rlt-mega export {CKPT} EXPORT_DIR" in message and "train.init_from=EXPORT_DIR" in message


def test_resumable_on_says_where_the_optimizer_state_goes():
    assert "tp=2, pp=2, zero_stage 1 or 2 and any dp" in resumable_on(layout(tp=2, pp=2, dp=4, zero=1))
    assert "dp=2 only" in resumable_on(layout(tp=2, dp=2, zero=3))
    assert "weights only" in resumable_on(layout())


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True, "tie_embeddings": True, "share_weights": False}])
def test_universal_patterns_name_each_parameter_once_with_its_tensor_parallel_split(overrides):
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, **overrides)
    info = universal_checkpoint_info(cfg)
    names = [n for n, _ in build_model(cfg, "meta").named_parameters()]
    replicated, rows = info["tp_replicated_parameter_patterns"], info["parameter_with_row_parallelism_patterns"]
    for pattern in replicated + rows:  # the converter's strict mode: every pattern matches a parameter
        assert sum(bool(re.match(pattern, n)) for n in names) == 1, pattern
    row_names = {n for n in names if any(re.match(p, n) for p in rows)}
    assert row_names == {n for n in names if n.endswith(("attn.o.weight", "mlp.down.weight"))}
    replicated_names = {n for n in names if any(re.match(p, n) for p in replicated)}
    assert {"null_memory", "z_init", "recur_proj.weight", "final_norm.weight"} <= replicated_names
    split = ("attn.q.weight", "attn.q.bias", "mlp.up.weight", "embed.weight")
    assert not any(n.endswith(split) for n in replicated_names)
