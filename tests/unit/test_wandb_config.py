"""logging.wandb without wandb installed (issue 14): configuring it is a clear error, not
configuring it needs nothing (an offline run: tests/e2e/test_wandb.py)."""

import importlib.util

import pytest

from rlt_mega.config import ConfigError, load_config


def test_wandb_is_optional(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert load_config(None, []).logging.wandb.enabled is False  # not configured: nothing needed
    assert load_config(None, ["logging.wandb.project=p", "logging.wandb.mode=disabled"]).logging.wandb.enabled is False
    with pytest.raises(ConfigError, match="wandb is not installed: `pip install wandb`, or set logging.wandb.project"):
        load_config(None, ["logging.wandb.project=p"])
    with pytest.raises(ConfigError, match="logging.wandb.mode"):
        load_config(None, ["logging.wandb.mode=sometimes"])
