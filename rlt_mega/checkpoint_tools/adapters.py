"""Checkpoints and exports of a run with low-rank adapters (model.lora, rlt_mega/model/lora.py).

A training checkpoint of such a run holds the adapters (``adapters.safetensors``, their clean
names ``blocks.0.attn.q.lora_A``) and the optimizer state (which holds only them), never the
frozen base: the checkpoint's config.yaml names the base (the run's train.init_from, or the
model of train.seed) and ``base.json`` holds the sha256 of its weights (``adapter_files.state_hash``),
checked on resume and on export (parallel/adapter_files.py).

Exports: ``merged_export_state`` rebuilds the base, loads the adapters and merges them (the
full export, loadable by transformers as any other); ``export_peft`` writes a peft adapter
directory (``adapter_config.json`` + ``adapter_model.safetensors``) for the transformers
export of the base."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors.torch import save_file

from rlt_mega.checkpoint import CheckpointError, OutputKind, check_output
from rlt_mega.checkpoint_tools.files import atomic_directory
from rlt_mega.config import Config, LoraConfig
from rlt_mega.model.rlt import build_model
from rlt_mega.model.lora import apply_lora, has_adapters
from rlt_mega.parallel.adapter_files import ADAPTERS, adapter_state, base_state, load_adapters, merged_state, state_hash


def is_adapter_checkpoint(step_dir: Path) -> bool:
    return (Path(step_dir) / ADAPTERS).is_file()


def base_model(cfg: Config):
    """The run's base (the single-process model of train.init_from or of train.seed), without adapters."""
    from rlt_mega.checkpoint_tools.export import init_from

    model = build_model(cfg.model, "cpu", seed=cfg.train.seed)
    if cfg.train.init_from:
        init_from(model, cfg.train.init_from)
    return model


def adapted_model(cfg: Config, step_dir: Path):
    """The base of ``cfg`` with the adapters of checkpoint ``step_dir`` (their base checked)."""
    model = apply_lora(base_model(cfg), cfg.model.lora, cfg.train.seed)
    load_adapters(model, step_dir, state_hash(base_state(model)))
    return model


def merged_export_state(cfg: Config, step_dir: Path) -> tuple[dict[str, torch.Tensor], object]:
    """(the merged model's state dict under the base model's names, its ModelConfig without adapters)."""

    model = adapted_model(cfg, step_dir)
    return merged_state(model), dataclasses.replace(cfg.model, lora=LoraConfig())


# peft's names: its LoraModel's ``model`` is RLTForCausalLM, whose modules are named as the RLT's
PEFT_PREFIX = "base_model.model."


PEFT = OutputKind("a peft adapter directory", "adapter_config.json")  # what `export --adapters` writes


def export_peft(cfg: Config, step_dir: Path, out_dir: Path, base_path: Optional[str] = None, *,
                overwrite: bool = False, inputs: Iterable[str | Path] = ()) -> Path:
    """A peft LoRA directory of checkpoint ``step_dir``'s adapters: adapter_config.json (explicit
    target module names, r, lora_alpha) and adapter_model.safetensors (peft's key names), written
    atomically; ``inputs`` (the checkpoint, the base) may not be replaced (checkpoint.check_output)."""
    inputs = [*inputs, step_dir]
    check_output(out_dir, inputs, overwrite, kind=PEFT)  # before the base is built
    model = adapted_model(cfg, step_dir)
    if not has_adapters(model):
        raise CheckpointError(f"checkpoint {step_dir} has no adapters")
    lora = cfg.model.lora
    state = adapter_state(model)
    modules = sorted({k.rsplit(".", 1)[0] for k in state})
    tensors = {}
    for k, v in state.items():
        module, which = k.rsplit(".", 1)
        tensors[f"{PEFT_PREFIX}{module}.{which}.weight"] = v.detach().cpu().contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "target_modules": modules, "base_model_name_or_path": base_path,
              "inference_mode": True}
    with atomic_directory(out_dir, overwrite, inputs, kind=PEFT) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(out_dir)
