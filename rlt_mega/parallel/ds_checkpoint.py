"""The distributed engine's checkpoint files: DeepSpeed's engine checkpoint (module and ZeRO
optimizer shards of every rank) under ``deepspeed/``, the engine's own ``engine.pt`` and,
optionally, a consolidated ``model.safetensors``; and resuming from them, on the same layout
or, through DeepSpeed's universal checkpoint, on another data-parallel size (reshard.py).

The caller (CheckpointManager) makes the directory atomic and writes the manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from rlt_mega.checkpoint import CheckpointError, load_torch, safe_unpickling
from rlt_mega.config import CheckpointConfig, ModelConfig
from rlt_mega.log import get_logger
from rlt_mega.model.lora import base_state, has_adapters, state_hash
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
        self.universal_info = reshard.universal_checkpoint_info(model_cfg)

    def save(self, directory: Path, engine_state: dict) -> None:
        """Every rank writes its shards (with the ``universal_checkpoint_info`` DeepSpeed's
        converter needs); rank 0 adds ``engine.pt`` (``engine_state``) and, with
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
        """Resumes from a checkpoint written by :meth:`save`: on the same layout bit for bit; on
        another data-parallel size (or ZeRO stage within 1-2) with its optimizer state
        re-partitioned (reshard.py); any other layout change is an error naming both layouts.
        Returns the saved ``engine_state``."""
        directory = Path(directory)
        current = self.layout()
        saved = reshard.saved_layout(directory) or current
        plan = reshard.resume_plan(saved, current, directory)
        if not (directory / DS_TAG).is_dir():
            raise CheckpointError(f"checkpoint {directory} has no {DS_TAG}/ directory: it was not written by the "
                                  f"distributed engine; {reshard.weights_only_hint(directory)}")
        if has_adapters(self.ds.module) and plan != reshard.SAME:
            raise CheckpointError(f"checkpoint {directory} holds adapters (model.lora) of layout "
                                  f"{reshard.format_layout(saved)}: adapter checkpoints resume on the layout they "
                                  f"were written with ({reshard.format_layout(current)} here)")
        for shard in sorted((directory / DS_TAG).glob("*.pt")):  # an untrusted file named before DeepSpeed reads it
            load_torch(shard, map_location="cpu", mmap=True, deepspeed=True)
        if plan == reshard.UNIVERSAL:
            self._load_universal(directory)
        else:
            self._load_deepspeed(directory, directory)
        engine_state = load_torch(directory / "engine.pt")
        if plan != reshard.SAME:
            log.warning("resumed %s, written with layout %s, on %s: optimizer state %s", directory,
                        reshard.format_layout(saved), reshard.format_layout(current),
                        "re-partitioned through DeepSpeed's universal checkpoint" if plan == reshard.UNIVERSAL
                        else "replicated over data-parallel ranks, loaded as is")
        return engine_state

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

    def _load_universal(self, directory: Path) -> None:
        """Rank 0 converts the checkpoint's ZeRO shards with DeepSpeed's ds_to_universal into a
        scratch directory under checkpoint.dir; every rank loads its new partition from it
        (DeepSpeed's ``load_universal``, switched on for this load only); the scratch goes."""
        scratch = reshard.scratch_dir(self.checkpoint.dir, directory)
        error: Optional[Exception] = None
        if self.dims.rank == 0:
            try:
                reshard.remove(scratch)
                scratch.mkdir(parents=True)
                with safe_unpickling(deepspeed=True):  # the converter's torch.load calls (and its workers')
                    reshard.to_universal(directory / DS_TAG, scratch / DS_TAG)
            except Exception as exc:  # reported on every rank below, raised here
                error = exc
        failed = self.dims.all_reduce(torch.tensor([float(error is not None)], device=self.dims.device), op="max")
        if failed.item():
            if self.dims.rank == 0:
                reshard.remove(scratch)
                raise error
            raise CheckpointError(f"rank 0 could not convert {directory / DS_TAG} to a universal checkpoint "
                                  "(its log has the reason)")
        # A private field of DeepSpeed's config, read (engine.load_universal_checkpoint()) only
        # inside load_checkpoint; its public switch, the config's checkpoint.load_universal, is
        # fixed at initialize, and only this load reads a universal checkpoint.
        self.ds._config.load_universal_checkpoint = True
        try:
            self._load_deepspeed(scratch, directory)
        finally:
            self.ds._config.load_universal_checkpoint = False
            self.dims.barrier()
            if self.dims.rank == 0:
                reshard.remove(scratch)
