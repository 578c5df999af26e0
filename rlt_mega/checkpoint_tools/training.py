"""Training checkpoints (rlt_mega.checkpoint) as a source for export and inspection.

A training checkpoint is a ``step_NNNNNNNN`` directory (files checked by its manifest.json;
``config.yaml`` is the run's config, ``manifest.json`` holds the step and the engine's
layout), or a checkpoint root (``checkpoint.dir``) from which the newest valid one is taken.

Every checkpoint holds the full model in ``model.safetensors``: the local engine saves it, and
the distributed engine (rlt_mega.parallel.distributed) writes a consolidated copy beside its
per-rank DeepSpeed shards, so export and inspect read any layout the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model

from rlt_mega.checkpoint import MANIFEST, CheckpointError, CheckpointManager, verify
from rlt_mega.config import Config, ConfigError, load_config
from rlt_mega.checkpoint_tools.export import empty_model
from rlt_mega.checkpoint_tools.files import CheckpointFormatError

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


def holds_full_model(layout: dict) -> bool:
    return layout.get("tp", 1) == 1 and layout.get("pp", 1) == 1 and layout.get("zero_stage", 0) != 3


def load_training_weights(path: str | Path) -> tuple[Config, dict[str, torch.Tensor], dict[str, Any]]:
    """A training checkpoint's weights as a full single-process state dict (fp32 as trained).

    Returns (the run's Config, state dict with tied aliases, source info for the export).
    """
    step_dir, cfg, manifest = read_checkpoint(path)
    layout = layout_of(manifest)
    file = step_dir / "model.safetensors"
    if not holds_full_model(layout) and not file.is_file():
        raise CheckpointFormatError(f"{step_dir}: written with layout {layout} and without a consolidated "
                                    "model.safetensors (the distributed engine writes one at every save)")
    # load_model resolves the tied names exactly as the engine's save_model chose them.
    model = empty_model(cfg.model)
    try:
        load_model(model, str(file), strict=True)
    except (SafetensorError, RuntimeError) as exc:
        raise CheckpointFormatError(f"{file}: does not hold the weights of the model in "
                                    f"{step_dir / CONFIG_YAML}: {exc}") from None
    source = {"kind": "training_checkpoint", "path": str(step_dir.resolve()), "step": manifest.get("step"),
              "layout": layout}
    return cfg, {n: t.detach() for n, t in model.state_dict().items()}, source


def tokenizer_of(cfg: Config) -> Optional[str]:
    """The run's tokenizer for the export: "byte", or its tokenizer.json when it still exists."""
    tok = cfg.data.tokenizer
    return tok if tok == "byte" or Path(tok).exists() else None
