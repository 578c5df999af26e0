"""Strict config loading: unknown keys, wrong types and impossible values give clear errors."""

from pathlib import Path

import pytest

from rlt_mega.config import Config, ConfigError, load_config


def test_shipped_configs_load():
    for path in sorted(Path("configs").glob("*.yaml")):
        cfg = load_config(path)
        assert isinstance(cfg, Config)


def test_unknown_key_names_it_and_suggests_the_closest():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.stpes=100"])
    msg = str(err.value)
    assert "train.stpes" in msg and "did you mean 'steps'" in msg


def test_unknown_section():
    with pytest.raises(ConfigError, match="unknown config key 'modle'.*did you mean 'model'"):
        load_config(None, ["modle.d_model=64"])


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  d_modle: 64\n")
    with pytest.raises(ConfigError, match="model.d_modle.*did you mean 'd_model'"):
        load_config(path)


def test_wrong_type_names_the_expected_type():
    with pytest.raises(ConfigError, match=r"train.steps: expected int, got 'many'"):
        load_config(None, ["train.steps=many"])
    with pytest.raises(ConfigError, match=r"model.share_weights: expected bool"):
        load_config(None, ["model.share_weights=3"])
    with pytest.raises(ConfigError, match=r"train.dtype: expected one of 'fp32', 'bf16'"):
        load_config(None, ["train.dtype=fp16"])


@pytest.mark.parametrize("override, fragment", [
    (["model.n_heads=3"], "does not divide model.d_model"),
    (["model.memory_block=0"], "memory_block (C) = 0: must be >= 1"),
    (["model.n_kv_heads=3"], "must divide model.n_heads"),
    (["data.seq_len=4096"], "exceeds model.max_seq_len"),
    (["optim.min_lr=1.0"], "must be in [0, optim.lr]"),
    (["parallel.zero_stage=4"], "must be 0, 1, 2 or 3"),
])
def test_impossible_values_say_how_to_fix(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert fragment in str(err.value)


def test_overrides_parse_yaml_scalars_and_ints_widen_to_float():
    cfg = load_config(None, ["optim.lr=1", "train.resume=auto", "model.n_kv_heads=null", "data.eval=x.jsonl"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.train.resume == "auto" and cfg.model.n_kv_heads == cfg.model.n_heads


def test_malformed_override():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["train.steps"])


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.yaml")


def test_cli_reports_config_error_without_traceback(capsys):
    from rlt_mega.cli import main

    assert main(["pretrain", "--config", "configs/tiny_cpu.yaml", "train.stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.stpes'" in err and "Traceback" not in err
