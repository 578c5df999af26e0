"""verl 0.9.1's own ``verl/trainer/ppo/core_algos.py``, loaded for tests as an independent
implementation of the GRPO toolbox (agg_loss, compute_policy_loss_vanilla, ..._gspo,
compute_grpo_outcome_advantage, compute_rloo_outcome_advantage, kl_penalty), and its
``rollout_corr_helper.py`` (the off-policy corrections: compute_rollout_correction_weights,
compute_rollout_rejection_mask).

``import verl`` pulls ray (verl/protocol.py) and verl pins transformers<5.11, so verl is NOT
installed into the venv's site-packages: launch/env.sh (run by launch/test.sh, the README's test
command) puts its source beside it with ``pip install --no-deps --target $VENV/verl-0.9.1``
(about 10 s; RLT_VERL_DIR names another folder), and the package and the few modules
core_algos imports besides torch and numpy are stand-ins made here, stated plainly:

- ``verl``, ``verl.utils``, ``verl.trainer``, ``verl.workers``: empty packages over the real
  folders (their ``__init__`` files import ray and the trainers), so the real submodules load;
- ``verl.utils.device``: get_device_name() = "cpu" (verl probes the accelerator);
- ``verl.trainer.config.AlgoConfig``, ``verl.workers.config.ActorConfig``: empty classes (used
  as type hints and in one isinstance check); ``DistillationConfig``, ``DistillationLossConfig``:
  empty classes (type hints of the distillation losses; a test passes what they read);
  ``verl.trainer.distillation``: an empty package over the real folder; ``verl.protocol.DataProto``,
  ``RolloutCorrectionConfig``, ``PolicyLossConfig``: empty classes (type hints of
  rollout_corr_helper);
- ``omegaconf.DictConfig`` and ``tensordict.TensorDict``: empty classes (type hints only);
- ``transformers.PreTrainedTokenizer`` is the real one.

Everything core_algos computes (and verl.utils.torch_functional's masked_sum / masked_mean,
verl.utils.groupwise) is verl's own code. Without that folder the tests that need it fail,
saying how to install it: a comparison with verl never silently does not run.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest

VERSION = "0.9.1"


def _source_dir() -> Path:
    root = Path(os.environ.get("RLT_VERL_DIR", Path(sys.prefix) / f"verl-{VERSION}"))
    if not (root / "verl" / "trainer" / "ppo" / "core_algos.py").is_file():
        pytest.fail(f"verl {VERSION}'s source is not in {root}: run `bash launch/test.sh` (launch/env.sh installs it), "
                    f"or `pip install --no-deps --target {root} verl=={VERSION}`, or set RLT_VERL_DIR to such a folder")
    if not (root / f"verl-{VERSION}.dist-info").is_dir():
        pytest.fail(f"{root} holds another verl than {VERSION}: remove it and run `bash launch/test.sh` again")
    return root


def _package(name: str, path: Path) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    sys.modules[name] = mod
    return mod


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


_LOADED: dict[str, types.ModuleType] = {}


def _load(name: str) -> types.ModuleType:
    """verl's module ``name`` over the stand-ins (loaded once); the stand-ins are removed after."""
    if name in _LOADED:
        return _LOADED[name]
    root = _source_dir() / "verl"
    saved = {k: v for k, v in sys.modules.items() if k == "verl" or k.startswith("verl.")
             or k in ("omegaconf", "tensordict")}
    if "omegaconf" not in sys.modules:
        _module("omegaconf", DictConfig=type("DictConfig", (dict,), {}))
    if "tensordict" not in sys.modules:
        _module("tensordict", TensorDict=type("TensorDict", (), {}))
    _package("verl", root)
    utils = _package("verl.utils", root / "utils")
    _package("verl.trainer", root / "trainer")
    _package("verl.workers", root / "workers")
    import torch

    _module("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu,
            is_cuda_available=False, is_npu_available=False)
    _module("verl.trainer.config", AlgoConfig=type("AlgoConfig", (), {}))
    _module("verl.workers.config", ActorConfig=type("ActorConfig", (), {}),
            DistillationConfig=type("DistillationConfig", (), {}),
            DistillationLossConfig=type("DistillationLossConfig", (), {}))
    _package("verl.trainer.distillation", root / "trainer" / "distillation")  # (its __init__ pulls the trainers)
    # rollout_corr_helper's imports besides torch_functional: type hints only
    _module("verl.protocol", DataProto=type("DataProto", (), {}))
    _module("verl.trainer.config.algorithm", RolloutCorrectionConfig=type("RolloutCorrectionConfig", (), {}))
    _module("verl.workers.config.actor", PolicyLossConfig=type("PolicyLossConfig", (), {}))
    groupwise = importlib.import_module("verl.utils.groupwise")
    utils.as_torch_index, utils.group_mean_std = groupwise.as_torch_index, groupwise.group_mean_std
    try:
        _LOADED[name] = importlib.import_module(name)
    finally:  # leave no stand-in behind for other tests
        for k in [k for k in sys.modules if k == "verl" or k.startswith("verl.") or k in ("omegaconf", "tensordict")]:
            if k not in saved:
                del sys.modules[k]
        sys.modules.update(saved)
    return _LOADED[name]


def core_algos():
    """verl's core_algos module."""
    return _load("verl.trainer.ppo.core_algos")


def rollout_corr_helper():
    """verl's rollout_corr_helper module (off-policy IS weights and rejection masks)."""
    return _load("verl.trainer.ppo.rollout_corr_helper")


def distillation_fsdp_losses():
    """verl's FSDP distillation losses (compute_forward_kl_topk, kl_divergence)."""
    return _load("verl.trainer.distillation.fsdp.losses")


def actor_config(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float = 3.0, **global_batch_info):
    """What compute_policy_loss_* read of verl's ActorConfig (attributes, ``get``), as an
    instance of core_algos' ActorConfig stand-in (GSPO checks the type)."""
    base = core_algos().ActorConfig
    cfg = type("ActorSettings", (base, dict), {})()
    cfg["clip_ratio_c"] = clip_ratio_c
    cfg.clip_ratio = clip_ratio_low
    cfg.clip_ratio_low, cfg.clip_ratio_high = clip_ratio_low, clip_ratio_high
    cfg.global_batch_info = global_batch_info
    return cfg
