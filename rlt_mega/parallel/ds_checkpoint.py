"""The distributed engine's checkpoint files: DeepSpeed's engine checkpoint (module and ZeRO
optimizer shards of every rank) under ``deepspeed/``, the engine's own ``engine.pt`` and,
optionally, a consolidated ``model.safetensors``, and the layout-free state (``state/``,
reshard.py); resuming from them: on the layout they were written with through DeepSpeed's own
``load_checkpoint`` (bit for bit), on any other from the layout-free state.

The caller (CheckpointManager) makes the directory atomic and writes the manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from rlt_mega.checkpoint import CheckpointError, load_torch, safe_unpickling
from rlt_mega.config import CheckpointConfig, ModelConfig
from rlt_mega.log import get_logger
from rlt_mega.model.lora import has_adapters
from rlt_mega.parallel.adapter_files import base_state, state_hash
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel import reshard
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.ds_state import DeepSpeedState

log = get_logger(__name__)

DS_TAG = "deepspeed"  # sub-directory of a checkpoint with DeepSpeed's per-rank files


class DeepSpeedCheckpoint:
    """``ds``: the DeepSpeed engine; ``layout``: the engine's layout (parallel.engine.Engine.layout)."""

    def __init__(self, ds, dims: ParallelDims, state: DeepSpeedState, model_cfg: ModelConfig,
                 checkpoint: CheckpointConfig, layout: Callable[[], dict]) -> None:
        self.ds, self.dims, self.state, self.model_cfg = ds, dims, state, model_cfg
        self.checkpoint, self.layout = checkpoint, layout
        self.bytes_read = 0  # of the layout-free state, by the last resume on another layout
        self.universal_info = reshard.universal_checkpoint_info(model_cfg)

    def save(self, directory: Path, engine_state: dict) -> None:
        """Every rank writes its shards (with the ``universal_checkpoint_info`` DeepSpeed's
        converter needs) and its part of the layout-free state (``state/``); rank 0 adds ``engine.pt`` (``engine_state``) and, with
        ``checkpoint.consolidate`` (the default), a consolidated ``model.safetensors`` (the
        single-device layout, fp32 masters), which the export and inspect tools read like a
        single-process checkpoint (without it they consolidate from the shards)."""
        directory = Path(directory)
        client = {"universal_checkpoint_info": self.universal_info,
                  "rlt_master_groups": self.state.master_group_names()}
        adapted = has_adapters(self.ds.module)
        if adapted:  # model.lora: the adapters and their optimizer state only, with this rank's base hash
            client["rlt_base_sha256"] = self._base_hash()
        self.ds.save_checkpoint(str(directory), tag=DS_TAG, client_state=client, save_latest=False,
                                exclude_frozen_parameters=adapted)
        if self.checkpoint.layout_free:  # checkpoint.layout_free=false: the optimizer state once, on this layout
            self.state.save_layout_free(directory, engine_state["steps_taken"])
        consolidate = self.checkpoint.consolidate and not adapted
        full = self.state.full_state_dict() if consolidate else None
        if self.dims.rank == 0:
            torch.save(engine_state, directory / "engine.pt")
            if consolidate:
                self._save_consolidated(full, directory / "model.safetensors")
        self.dims.barrier()

    def _save_consolidated(self, full: dict[str, torch.Tensor], file: Path) -> None:
        from safetensors.torch import save_model

        model = build_model(self.model_cfg, "meta")
        model.to_empty(device="cpu")
        if self.model_cfg.tie_embeddings:
            model.lm_head.weight = model.embed.weight  # to_empty unties; re-tie before loading
            full.setdefault("lm_head.weight", full["embed.weight"])
        model.load_state_dict(full, strict=True)
        save_model(model, str(file))

    def load(self, directory: Path) -> dict:
        """Resumes from a checkpoint: on the layout it was written with from DeepSpeed's files
        (bit for bit); on any other layout -- or from a checkpoint ``rlt-mega reshard`` wrote,
        which has no DeepSpeed files -- from its layout-free state (reshard.py). Returns the
        saved ``engine_state``."""
        directory = Path(directory)
        current = self.layout()
        saved = reshard.saved_layout(directory) or current
        if reshard.same_layout(saved, current) and (directory / DS_TAG).is_dir():
            for shard in sorted((directory / DS_TAG).glob("*.pt")):  # an untrusted file named before DeepSpeed reads it
                load_torch(shard, map_location="cpu", mmap=True, deepspeed=True)
            self._load_deepspeed(directory, directory)
            return load_torch(directory / "engine.pt")
        state = reshard.LayoutFreeState.open(directory)
        self.state.load_layout_free(state)
        self.bytes_read = state.bytes_read  # this rank's share of the state (the tests add them up)
        self.dims.barrier()
        if self.dims.rank == 0:
            log.warning("resumed %s, written with layout %s, on %s (%s): fp32 masters, Adam moments and step of %d "
                        "parameters resharded from its layout-free state (rank 0 read %.1f MB: each byte is read "
                        "by one rank of the data-parallel group)", directory,
                        reshard.format_layout(saved), reshard.format_layout(current), reshard.changes(saved, current),
                        len(state.names()), state.bytes_read / 1e6)
        if has_adapters(self.ds.module):
            log.warning("the adapters of %s move to a new layout: their frozen base is this run's train.init_from, "
                        "not checked against the base they were trained on (its hash is per rank of the old "
                        "layout)", directory)
        return {"steps_taken": state.steps_taken}

    def _load_deepspeed(self, load_dir: Path, directory: Path) -> None:
        adapted = has_adapters(self.ds.module)  # the frozen base is not in the checkpoint: not strict
        with safe_unpickling(deepspeed=True):  # DeepSpeed's own torch.load calls too (weights_only=False there)
            load_path, client = self.ds.load_checkpoint(str(load_dir), tag=DS_TAG, load_module_strict=not adapted,
                                                        load_optimizer_states=True, load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load {directory / DS_TAG} on layout {self.layout()}")
        if adapted and (client or {}).get("rlt_base_sha256") != self._base_hash():
            raise CheckpointError(f"checkpoint {directory}: its adapters were trained on another base (sha256 of "
                                  f"rank {self.dims.rank}'s part differs): resume with the run's own train.init_from "
                                  "and train.seed (config.yaml of the checkpoint)")

    def _base_hash(self) -> str:
        """sha256 of this rank's part of the frozen base (model.lora); under ZeRO-3 of its whole
        stage and TP shard, gathered over the data-parallel group (a collective: every rank
        saves and loads)."""
        import deepspeed

        frozen = [p for p in self.ds.module.parameters() if not p.requires_grad]
        with deepspeed.zero.GatheredParameters(frozen, modifier_rank=None):
            return state_hash(base_state(self.ds.module))
