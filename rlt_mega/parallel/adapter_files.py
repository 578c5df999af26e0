"""The files of a checkpoint of a run with low-rank adapters (model.lora, rlt_mega/model/lora.py),
as the engines write and read them: ``adapters.safetensors`` (the adapters under their clean
names, ``blocks.0.attn.q.lora_A``) and ``base.json`` (the sha256 of the frozen base they were
trained on, checked on load), never the base itself; and the states they are made of
(``adapter_state``, the base's ``base_state`` and its ``state_hash``, the export's
``merged_state``). Export: checkpoint_tools/adapters.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlt_mega.checkpoint import CheckpointError
from rlt_mega.model.lora import adapters

ADAPTERS = "adapters.safetensors"
BASE = "base.json"
_PARAM = ".parametrizations.weight."  # (model/lora.py: where parametrize keeps the base weight)


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


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{``<module>.lora_A``, ``<module>.lora_B``: tensor} of every adapter (detached)."""
    out = {}
    for name, a in adapters(model):
        out[f"{name}.lora_A"] = a.lora_A.detach()
        out[f"{name}.lora_B"] = a.lora_B.detach()
    return out


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copies ``adapter_state``'s tensors into the model's adapters (every key must match)."""
    mine = {f"{n}.{k}": getattr(a, k) for n, a in adapters(model) for k in ("lora_A", "lora_B")}
    if set(mine) != set(state):
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        raise ValueError(f"adapter state does not fit the model's adapters: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}; build the model with the adapters' model.lora")
    with torch.no_grad():
        for k, p in mine.items():
            if tuple(state[k].shape) != tuple(p.shape):
                raise ValueError(f"adapter {k}: shape {tuple(state[k].shape)} in the state, {tuple(p.shape)} "
                                 "in the model; use the adapters' model.lora.rank")
            p.copy_(state[k])


def base_name(name: str) -> str:
    """A state_dict name of an adapted model -> the base model's name (``...q.parametrizations.
    weight.original`` -> ``...q.weight``); adapter names are returned unchanged."""
    if name.endswith(_PARAM + "original"):
        return name[: -len(_PARAM + "original")] + ".weight"
    return name


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base's parameters under the base model's names (adapters left out)."""
    return {base_name(k): v for k, v in model.state_dict().items() if _PARAM not in k or k.endswith("original")}


@torch.no_grad()
def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict under the base model's names with every adapted weight merged
    (W + s B A): what a full export of the adapted model holds."""
    state = base_state(model)
    for name, _ in adapters(model):
        module = model.get_submodule(name)
        state[f"{name}.weight"] = module.weight.detach().clone()
    return state


def state_hash(state: dict[str, torch.Tensor]) -> str:
    """A hash of a state dict's names, shapes, dtypes and bytes (the base an adapter checkpoint
    was trained on)."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().cpu().contiguous()
        h.update(f"{k}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
