"""The files of a checkpoint of a run with low-rank adapters (model.lora, rlt_mega/model/lora.py),
as the engines write and read them: ``adapters.safetensors`` (the adapters under their clean
names, ``blocks.0.attn.q.lora_A``) and ``base.json`` (the sha256 of the frozen base they were
trained on, checked on load), never the base itself. Export: checkpoint_tools/adapters.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlt_mega.checkpoint import CheckpointError
from rlt_mega.model.lora import adapter_state, load_adapter_state

ADAPTERS = "adapters.safetensors"
BASE = "base.json"


def save_adapters(model: torch.nn.Module, directory: Path, base_hash: str) -> None:
    """The adapters of ``model`` (this process's, whole) and the hash of its base into a checkpoint directory."""
    save_file({k: v.detach().cpu().contiguous() for k, v in adapter_state(model).items()},
              str(Path(directory) / ADAPTERS))
    (Path(directory) / BASE).write_text(json.dumps({"sha256": base_hash}) + "\n")


def load_adapters(model: torch.nn.Module, directory: Path, base_hash: str) -> None:
    """Loads a checkpoint's adapters into ``model``, whose base must be the one they were trained on."""
    directory = Path(directory)
    saved = json.loads((directory / BASE).read_text())["sha256"] if (directory / BASE).is_file() else None
    if saved != base_hash:
        raise CheckpointError(f"checkpoint {directory}: its adapters were trained on a base of sha256 {saved}, this "
                              f"run's base is {base_hash}: resume with the run's own train.init_from and train.seed "
                              f"(config.yaml of the checkpoint)")
    device = next(model.parameters()).device
    try:
        load_adapter_state(model, load_file(str(directory / ADAPTERS), device=str(device)))
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {directory}: {exc}") from None


