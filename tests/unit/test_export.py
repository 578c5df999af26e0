"""The layout-independent export format (docs/design.md, "Checkpoints"): export -> load gives the same
model, sharding does not change what loads, tied weights are stored once, and a damaged or
inconsistent directory is an error that names the file and the problem."""

import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rlt_mega.checkpoint_tools import (
    CheckpointFormatError, export_model, init_from, load_exported, verify_export,
)
from rlt_mega.checkpoint_tools import commands
from rlt_mega.checkpoint_tools.inspect_ckpt import inspect_path
from rlt_mega.config import ConfigError, ModelConfig, TrainConfig
from rlt_mega.model.rlt import RLT, build_model, param_counts


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                memory_block=2, max_seq_len=32)
    return ModelConfig(**{**base, **kw})


def logits(model, seed=0):
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=True, qkv_bias=True), dict(share_weights=False)])
def test_export_load_logits_equal(tmp_path, kw):
    model = build_model(tiny(**kw), seed=1)
    out = export_model(model, None, tmp_path / "exp")
    cfg, sd = load_exported(out)
    assert cfg == model.cfg
    loaded = RLT(cfg)
    loaded.load_state_dict(sd, strict=True)
    assert torch.equal(logits(loaded), logits(model))
    if cfg.tie_embeddings:
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys() and "embed.weight" in f.keys()  # stored once
        assert sd["lm_head.weight"] is sd["embed.weight"]


def test_sharded_export_loads_identical(tmp_path):
    model = build_model(tiny(tie_embeddings=True), seed=2)
    one = export_model(model, None, tmp_path / "one")
    many = export_model(model, None, tmp_path / "many", max_shard_size=6000)
    shards = sorted(p.name for p in many.glob("model-*.safetensors"))
    assert len(shards) > 3 and (many / "model.safetensors.index.json").is_file()
    assert not (many / "model.safetensors").exists()
    weight_map = json.loads((many / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == shards
    _, sd_one = load_exported(one)
    _, sd_many = load_exported(many)
    assert sd_one.keys() == sd_many.keys() and all(torch.equal(sd_one[k], sd_many[k]) for k in sd_one)
    # checksums are per tensor, so they do not depend on how the files are split
    m_one = json.loads((one / "rlt_export.json").read_text())["tensors"]
    m_many = json.loads((many / "rlt_export.json").read_text())["tensors"]
    assert m_one == m_many


def test_export_bf16_and_partial_load(tmp_path):
    model = build_model(tiny(tie_embeddings=True), seed=3)
    out = export_model(model, None, tmp_path / "exp", dtype="bf16")
    _, sd = load_exported(out)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert torch.equal(sd["blocks.0.attn.q.weight"], model.blocks[0].attn.q.weight.detach().bfloat16())
    _, part = load_exported(out, keys=["blocks.1.mlp.up.weight", "lm_head.weight"], dtype="fp32")
    assert sorted(part) == ["blocks.1.mlp.up.weight", "embed.weight", "lm_head.weight"]
    assert part["lm_head.weight"].dtype == torch.float32


def test_init_from(tmp_path, caplog):
    source = build_model(tiny(), seed=4)
    out = export_model(source, None, tmp_path / "exp")
    target = build_model(tiny(memory_block=1), seed=5)  # memory_block may differ, and is logged
    with caplog.at_level(logging.WARNING, logger="rlt_mega"):
        init_from(target, out)
    assert "memory_block" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))
    with pytest.raises(ConfigError, match="n_kv_heads: export 2 vs run 4"):
        init_from(build_model(tiny(n_kv_heads=4)), out)


def test_init_from_config_field():
    assert TrainConfig(init_from="x", resume="auto").init_from == "x"
    with pytest.raises(ConfigError, match="set only one of them"):
        TrainConfig(init_from="x", resume="runs/ckpt/step_100")


def test_export_is_atomic_and_never_overwrites_by_default(tmp_path, monkeypatch):
    model = build_model(tiny(), seed=6)
    out = export_model(model, None, tmp_path / "exp")
    with pytest.raises(FileExistsError, match="not empty"):
        export_model(model, None, out)
    other = build_model(tiny(), seed=7)

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("rlt_mega.checkpoint_tools.export.save_safetensors", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        export_model(other, None, out, overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no partial directory left
    _, sd = load_exported(out)  # the old export is intact
    assert torch.equal(sd["embed.weight"], model.embed.weight)
    export_model(other, None, out, overwrite=True)
    assert torch.equal(load_exported(out)[1]["embed.weight"], other.embed.weight)


def test_export_rejects_state_dict_that_does_not_fit_config(tmp_path):
    sd = build_model(tiny(), seed=8).state_dict()
    with pytest.raises(CheckpointFormatError, match=r"'blocks.0.mlp.gate.weight' has shape \(48, 32\)"):
        export_model(sd, tiny(ffn_hidden=64), tmp_path / "exp")
    sd_tied = build_model(tiny(), seed=8).state_dict()
    with pytest.raises(ValueError, match="lm_head.weight' differs"):
        export_model(sd_tied, tiny(tie_embeddings=True), tmp_path / "exp")
    assert not (tmp_path / "exp").exists()


# ------------------------------------------------------------------------------ damaged exports

@pytest.fixture
def export_dir(tmp_path):
    return export_model(build_model(tiny(), seed=9), None, tmp_path / "exp")


def test_load_missing_config(export_dir):
    (export_dir / "config.json").unlink()
    with pytest.raises(CheckpointFormatError, match=f"{export_dir / 'config.json'}: missing"):
        load_exported(export_dir)


def test_load_config_errors_name_the_file_and_key(export_dir):
    cfg = json.loads((export_dir / "config.json").read_text())
    (export_dir / "config.json").write_text(json.dumps({**cfg, "n_layer": 3}))
    with pytest.raises(CheckpointFormatError, match=r"config\.json: unknown config key 'n_layer'.*n_layers"):
        load_exported(export_dir)
    (export_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(CheckpointFormatError, match="not an exported RLT.*rlt-mega import"):
        load_exported(export_dir)


def test_load_wrong_tensor_shape(export_dir):
    file = export_dir / "model.safetensors"
    sd = load_file(str(file))
    sd["cross.1.attn.k.weight"] = torch.zeros(8, 32)
    save_file(sd, str(file))
    with pytest.raises(CheckpointFormatError) as err:
        load_exported(export_dir)
    msg = str(err.value)
    assert str(file) in msg and "'cross.1.attn.k.weight' has shape (8, 32)" in msg and "(16, 32)" in msg


def test_load_truncated_file(export_dir):
    file = export_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointFormatError, match=f"{file}: not a readable safetensors file.*truncated"):
        load_exported(export_dir)


def test_load_changed_bytes_fail_the_checksum(export_dir):
    file = export_dir / "model.safetensors"
    sd = load_file(str(file))
    sd["blocks.1.attn.o.weight"][0, 0] += 1.0
    save_file(sd, str(file))
    with pytest.raises(CheckpointFormatError, match="'blocks.1.attn.o.weight' does not match its sha256"):
        load_exported(export_dir)
    with pytest.raises(CheckpointFormatError, match="does not match its sha256"):
        verify_export(export_dir)
    load_exported(export_dir, verify=False)  # an explicit opt-out still loads


def test_load_missing_tensor(export_dir):
    file = export_dir / "model.safetensors"
    sd = load_file(str(file))
    del sd["z_init"]
    save_file(sd, str(file))
    with pytest.raises(CheckpointFormatError, match=r"missing 1 tensors.*'z_init'"):
        load_exported(export_dir)


# ------------------------------------------------------------------------------ commands

def test_inspect_report(tmp_path):
    cfg = tiny(tie_embeddings=True, qkv_bias=True)
    out = export_model(build_model(cfg, seed=10), None, tmp_path / "exp", max_shard_size=6000)
    report = inspect_path(out)
    assert report["kind"] == "export" and report["param_counts"] == param_counts(cfg)
    assert report["dtypes"] == {"float32": param_counts(cfg)["total"]}  # tied weights counted once
    assert report["checks"]["sha256"].startswith("ok") and report["tied"] == {"lm_head.weight": "embed.weight"}


def test_commands_print_and_fail_cleanly(tmp_path, capsys):
    out = export_model(build_model(tiny(), seed=11), None, tmp_path / "exp")
    assert commands.main("inspect", [str(out)]) == 0
    text = capsys.readouterr().out
    assert "checks: shapes ok, sha256 ok" in text and "total" in text
    assert commands.main("export", [str(out), str(tmp_path / "bf16"), "--dtype", "bf16",
                                    "--max-shard-size", "6000"]) == 0
    capsys.readouterr()
    assert commands.main("inspect", [str(tmp_path / "bf16"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtypes"] == {"bfloat16": param_counts(tiny())["total"]}
    assert report["source"]["kind"] == "export" and report["source"]["from"] == {"kind": "model"}
    (out / "config.json").unlink()
    assert commands.main("inspect", [str(out)]) == 2
    assert "config.json: missing" in capsys.readouterr().err
