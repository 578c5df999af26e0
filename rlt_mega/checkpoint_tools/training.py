"""Training checkpoints (rlt_mega.checkpoint) as a source for export and inspection.

A training checkpoint is a ``step_NNNNNNNN`` directory (files checked by its manifest.json;
``config.yaml`` is the run's config, ``manifest.json`` holds the step and the engine's
layout), or a checkpoint root (``checkpoint.dir``) from which the newest valid one is taken.

The local engine saves the full model in ``model.safetensors``; the distributed engine
(rlt_mega.parallel.distributed) writes its per-rank DeepSpeed shards under ``deepspeed/`` and,
unless ``checkpoint.consolidate`` is false, a consolidated ``model.safetensors`` beside them;
every engine also writes the layout-free state (``state/``, parallel/reshard.py), and a
``rlt-mega reshard`` output holds nothing else. Export reads the consolidated file when there is
one, otherwise rebuilds the model from the shards (shards.py), otherwise from the layout-free
state's fp32 masters, so any layout exports the same way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model

from rlt_mega.checkpoint import MANIFEST, CheckpointError, CheckpointManager, verify
from rlt_mega.config import Config, ConfigError, load_config
from rlt_mega.checkpoint_tools.adapters import is_adapter_checkpoint, merged_export_state
from rlt_mega.checkpoint_tools.export import check_tensors, empty_model, tied_aliases
from rlt_mega.checkpoint_tools.files import CheckpointFormatError
from rlt_mega.checkpoint_tools.shards import DS_TAG, consolidate
from rlt_mega.parallel.reshard import STATE_DIR, LayoutFreeState

CONFIG_YAML = "config.yaml"
SINGLE_PROCESS = {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}


def is_training_checkpoint(path: Path) -> bool:
    """A step directory (manifest.json + config.yaml) or a root holding step directories."""
    path = Path(path)
    if (path / MANIFEST).is_file() and (path / CONFIG_YAML).is_file():
        return True
    return path.is_dir() and bool(CheckpointManager(path).list())


def resolve(path: str | Path) -> Path:
    """A step directory as given, or the newest valid one under a checkpoint root."""
    path = Path(path)
    if (path / MANIFEST).is_file() or not CheckpointManager(path).list():
        return path
    latest = CheckpointManager(path).latest()
    if latest is None:
        raise CheckpointError(f"{path}: no complete checkpoint (every step directory failed verification)")
    return latest


def read_checkpoint(path: str | Path, check_files: bool = True) -> tuple[Path, Config, dict]:
    """-> (step directory, the run's Config, manifest). ``check_files`` verifies the sha256 of
    every file (rlt_mega.checkpoint.verify); without it only the manifest is read."""
    step_dir = resolve(path)
    manifest = verify(step_dir) if check_files else _read_manifest(step_dir)
    try:
        cfg = load_config(step_dir / CONFIG_YAML)
    except ConfigError as exc:
        raise CheckpointFormatError(f"{step_dir / CONFIG_YAML}: {exc}") from None
    return step_dir, cfg, manifest


def _read_manifest(step_dir: Path) -> dict:
    import json

    file = step_dir / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"checkpoint {step_dir} is incomplete: no {MANIFEST} (an interrupted save?)")
    return json.loads(file.read_text())


def layout_of(manifest: dict) -> dict:
    return dict(manifest.get("layout") or SINGLE_PROCESS)


WEIGHT_SOURCES = ("auto", "consolidated", "shards", "state")


def weights_source(step_dir: Path, source: str = "auto") -> str:
    """Where a checkpoint's weights are read from: "consolidated" (model.safetensors), "shards"
    (deepspeed/) or "state" (the layout-free state's fp32 masters, state/). ``auto`` prefers the
    consolidated file, then the shards."""
    if source not in WEIGHT_SOURCES:
        raise ValueError(f"weights source {source!r}: expected one of {WEIGHT_SOURCES}")
    has_file, has_shards = (step_dir / "model.safetensors").is_file(), (step_dir / DS_TAG).is_dir()
    has_state = (step_dir / STATE_DIR).is_dir()
    if source == "auto":
        source = "consolidated" if has_file else "shards" if has_shards else "state" if has_state else "consolidated"
    if source == "state" and not has_state:
        raise CheckpointFormatError(f"{step_dir / STATE_DIR}: missing; the checkpoint was written before the "
                                    "layout-free state existed (--weights auto reads its other files)")
    if source == "consolidated" and not has_file:
        raise CheckpointFormatError(f"{step_dir / 'model.safetensors'}: missing; "
                                    + ("read the weights from the shards instead (--weights shards)" if has_shards
                                       else "read them from the layout-free state (--weights state)" if has_state
                                       else "the checkpoint holds no weights"))
    if source == "shards" and not has_shards:
        raise CheckpointFormatError(f"{step_dir / DS_TAG}: missing; only the distributed engine writes "
                                    "per-rank shards (this checkpoint's weights are in model.safetensors)")
    return source


def load_training_weights(path: str | Path, source: str = "auto"
                          ) -> tuple[Config, dict[str, torch.Tensor], dict[str, Any]]:
    """A training checkpoint's weights as a full single-process state dict (fp32 as trained).
    ``source``: "auto", "consolidated" or "shards" (:func:`weights_source`); the optimizer
    state is never part of it.

    Returns (the run's Config, state dict with tied aliases, source info for the export).
    """
    step_dir, cfg, manifest = read_checkpoint(path)
    layout = layout_of(manifest)
    if is_adapter_checkpoint(step_dir):  # a run with model.lora: its base with the adapters merged
        sd, model_cfg = merged_export_state(cfg, step_dir)
        info = {"kind": "training_checkpoint", "path": str(step_dir.resolve()), "step": manifest.get("step"),
                "layout": layout, "weights": "adapters merged into their base"}
        return dataclasses.replace(cfg, model=model_cfg), sd, info
    if cfg.model.lora.enabled:
        raise CheckpointFormatError(f"{step_dir}: a distributed checkpoint of a run with model.lora holds DeepSpeed's "
                                    "adapter shards only, which export cannot read yet: resume it on its layout, or "
                                    "train the adapters on one process to export them")
    source = weights_source(step_dir, source)
    model = empty_model(cfg.model)
    if source in ("shards", "state"):
        sd = consolidate(step_dir, cfg.model, layout) if source == "shards" else state_weights(step_dir)
        check_tensors({n: tuple(t.shape) for n, t in sd.items()}, cfg.model,
                      str(step_dir / (DS_TAG if source == "shards" else STATE_DIR)))
        model.load_state_dict({**sd, **{a: sd[s] for a, s in tied_aliases(cfg.model).items()}}, strict=True)
    else:
        # load_model resolves the tied names exactly as the engine's save_model chose them.
        file = step_dir / "model.safetensors"
        try:
            load_model(model, str(file), strict=True)
        except (SafetensorError, RuntimeError) as exc:
            raise CheckpointFormatError(f"{file}: does not hold the weights of the model in "
                                        f"{step_dir / CONFIG_YAML}: {exc}") from None
    info = {"kind": "training_checkpoint", "path": str(step_dir.resolve()), "step": manifest.get("step"),
            "layout": layout, "weights": source}
    return cfg, {n: t.detach() for n, t in model.state_dict().items()}, info


def state_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """The full fp32 masters of the layout-free state (every tensor-parallel piece joined), one
    parameter at a time: the weights of a checkpoint ``rlt-mega reshard`` wrote."""
    state = LayoutFreeState.open(step_dir)
    return {name: state.read(name, "fp32", 1, 0) for name in state.names()}


def tokenizer_of(cfg: Config) -> Optional[str]:
    """The run's tokenizer for the export: "byte", or its tokenizer.json when it still exists."""
    tok = cfg.data.tokenizer
    return tok if tok == "byte" or Path(tok).exists() else None
