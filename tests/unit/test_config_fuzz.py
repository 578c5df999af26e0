"""Property-based tests of the config loader: whatever the YAML file or the dotted overrides
hold, ``load_config`` returns a Config or raises ConfigError with a short readable message;
never another exception from deep inside (a TypeError from a dataclass, a YAML constructor
error, a RecursionError...)."""

import dataclasses
import datetime
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlt_mega.config import Config, ConfigError, load_config, save_config


def _valid_paths(cls=Config, prefix=""):
    """Every dotted key of the config tree (sections and leaves)."""
    out = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        out.append(path)
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out += _valid_paths(tp, path + ".")
    return out


VALID_PATHS = _valid_paths()
VALID_NAMES = sorted({p.split(".")[-1] for p in VALID_PATHS})

names = st.one_of(st.sampled_from(VALID_NAMES), st.text(min_size=0, max_size=8))
keys = st.one_of(st.sampled_from(VALID_PATHS), st.lists(names, min_size=1, max_size=4).map(".".join))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-3, max_value=300),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["auto", "cpu", "cuda:0", "fp32", "bf16", "cosine", "generated", "byte", "step", "every_k"]),
    st.dates(min_value=datetime.date(1990, 1, 1), max_value=datetime.date(2100, 1, 1)),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(names, st.integers()), inner, max_size=3)), max_leaves=6)
# raw strings typed after "key=": YAML scalars, flow collections, tags, garbage
raw_values = st.one_of(
    values.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()),
    st.text(max_size=20),
    st.sampled_from(["[", "{a: ", "!!python/object:os.system", "*alias", "&a [*a]", ".inf", ".nan", "-.inf",
                     "1e400", "0x10", "0o17", "1_000", "~", "'", "\"", "- - -", "[" * 2000, "? [a]\n: 1",
                     "2001-02-03", "true", "yes", "on", "12:30:00"]),
)
overrides = st.one_of(
    st.tuples(keys, raw_values).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=30),
)


def _check_outcome(fn):
    try:
        cfg = fn()
    except ConfigError as exc:
        message = str(exc)
        assert message.strip(), "empty ConfigError message"
        assert len(message) < 2000, f"message too long to read ({len(message)} chars)"
        return None
    assert isinstance(cfg, Config)
    return cfg


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(overrides, max_size=4))
def test_random_overrides_load_or_raise_config_error(items):
    cfg = _check_outcome(lambda: load_config(None, items))
    if cfg is not None:  # what loads round-trips through the saved YAML (checkpoints store it)
        assert load_config_roundtrip(cfg) == cfg


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.one_of(keys, st.integers(), st.none()), values, max_size=5), st.lists(overrides, max_size=2))
def test_random_yaml_files_load_or_raise_config_error(tmp_path, data, items):
    path = tmp_path / "c.yaml"
    nested = {}
    for key, value in data.items():  # dotted keys become nested sections, as users write them
        node, parts = nested, str(key).split(".") if isinstance(key, str) else [key]
        for part in parts[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        node[parts[-1]] = value
    path.write_text(yaml.safe_dump(nested))
    _check_outcome(lambda: load_config(path, items))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200)))
def test_random_file_contents_load_or_raise_config_error(tmp_path, text):
    path = tmp_path / "c.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _check_outcome(lambda: load_config(path))


def load_config_roundtrip(cfg):
    with tempfile.TemporaryDirectory() as d:
        save_config(cfg, Path(d) / "c.yaml")
        return load_config(Path(d) / "c.yaml")


@pytest.mark.parametrize("override, fragment", [
    (["optim.lr=.nan"], "optim.lr: expected a finite number"),
    (["model.rope_theta=.inf"], "model.rope_theta: expected a finite number"),
    (["model.init_std=-1"], "model.init_std"),
    (["train.seed=-1"], "train.seed"),
    (["train.device=gpu"], "train.device"),
    (["logging.level=LOUD"], "logging.level"),
    (["checkpoint.dir="], "checkpoint.dir"),
    (["parallel.pp_split=[a, 2]"], "parallel.pp_split"),
])
def test_values_that_would_fail_later_are_rejected_at_load(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert fragment in str(err.value)


@pytest.mark.parametrize("argv", [
    ["params", "optim.lr=.nan"],
    ["params", "model.d_model=[[[[1]]]]"],
    ["params", "train.stpes=3"],
    ["params", "nonsense"],
    ["params", "train.device=gpu"],
])
def test_cli_reports_bad_configs_in_one_line(argv, capsys):
    from rlt_mega.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlt-mega params: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_binary_config_file(tmp_path, capsys):
    from rlt_mega.cli import main

    (tmp_path / "c.yaml").write_bytes(b"\x80\xff\x00model: 1")
    assert main(["params", "--config", str(tmp_path / "c.yaml")]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
