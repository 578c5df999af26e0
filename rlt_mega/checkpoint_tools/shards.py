"""A distributed training checkpoint read from its per-rank shards (``step_N/deepspeed/``).

DeepSpeed names its files by model-parallel rank ``mp = pp_rank * tp + tp_rank`` (our
ParallelDims.mp_rank) and data-parallel rank ``dp``::

    mp_rank_{mp:02d}_model_states.pt                      ZeRO 0-2: the stage's module (one per mp)
    zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt    ZeRO-3: one per (dp, mp), no weights
    [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   ZeRO 1-3: fp32 master and Adam
                                                          partitions (bf16_: DeepSpeed's bf16 mode)

:func:`consolidate` rebuilds the single-device fp32 state dict offline, for a checkpoint saved
without the consolidated model.safetensors (``checkpoint.consolidate=false``) or to check it:
each model-parallel rank's fp32 masters come from DeepSpeed's own
``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (run on that rank's files; the
utility handles one model-parallel rank at a time), or, without ZeRO, from the module (fp32) or
the optimizer's fp32 groups (bf16); the tensor-parallel slices are then concatenated by the TP
plan and the pipeline stages merged by name. :func:`index_shards` and :func:`check_shards`
find every file the layout implies and check the shapes each one records.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from rlt_mega.checkpoint import (CheckpointError, UntrustedCheckpointError, load_torch, refused_type, safe_unpickling,
                                 untrusted)
from rlt_mega.config import ModelConfig
from rlt_mega.checkpoint_tools.files import CheckpointFormatError
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.dims import split_layers
from rlt_mega.parallel.ds_checkpoint import DS_TAG
from rlt_mega.parallel.stage import prune_to_stage
from rlt_mega.parallel.tp import param_shard_dim

_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass
class ShardFiles:
    """The DeepSpeed files of one checkpoint, by rank."""

    directory: Path  # step_N/deepspeed
    layout: dict
    model: dict[tuple[int, Optional[int]], Path] = field(default_factory=dict)  # (mp, dp or None) -> file
    optim: dict[tuple[int, int], Path] = field(default_factory=dict)  # (mp, dp) -> file

    @property
    def tp(self) -> int:
        return self.layout.get("tp", 1)

    @property
    def num_mp(self) -> int:
        return self.layout.get("tp", 1) * self.layout.get("pp", 1)

    def coords(self, mp: int) -> tuple[int, int]:
        """(tp_rank, pp_rank) of model-parallel rank ``mp``."""
        return mp % self.tp, mp // self.tp

    def files_of(self, mp: int) -> list[Path]:
        return sorted([f for (m, _), f in self.model.items() if m == mp]
                      + [f for (m, _), f in self.optim.items() if m == mp])


def _layout_text(layout: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in layout.items())


def index_shards(step_dir: Path, layout: dict) -> ShardFiles:
    """Every DeepSpeed file of the checkpoint, checked against what ``layout`` writes: one
    module file per model-parallel rank (per (data-parallel, model-parallel) rank under ZeRO-3)
    and, with ZeRO, one optimizer partition per (data-parallel, model-parallel) rank."""
    ds_dir = Path(step_dir) / DS_TAG
    if not ds_dir.is_dir():
        raise CheckpointFormatError(f"{ds_dir}: missing; a distributed checkpoint without a consolidated "
                                    "model.safetensors keeps its weights there (DeepSpeed's per-rank shards)")
    files = ShardFiles(ds_dir, dict(layout))
    for f in sorted(ds_dir.iterdir()):
        if m := _MODEL_FILE.match(f.name):
            files.model[(int(m.group(2)), None if m.group(1) is None else int(m.group(1)))] = f
        elif m := _OPTIM_FILE.match(f.name):
            files.optim[(int(m.group(2)), int(m.group(1)))] = f
    dp, zero = layout.get("dp", 1), layout.get("zero_stage", 0)
    ranks = [(mp, d) for mp in range(files.num_mp) for d in range(dp)]
    want_model = ranks if zero == 3 else [(mp, None) for mp in range(files.num_mp)]
    want_optim = ranks if zero > 0 else []
    for kind, have, want, name in (("module", files.model, want_model, _model_name),
                                   ("optimizer", files.optim, want_optim, _optim_name)):
        missing = [k for k in want if k not in have]
        if missing:
            mp, d = missing[0]
            per = "(data-parallel, model-parallel) rank" if d is not None else "model-parallel rank"
            raise CheckpointFormatError(
                f"{ds_dir / name(mp, d)}: missing ({len(missing)} {kind} shard(s) missing in all); the layout "
                f"{{{_layout_text(layout)}}} writes one per {per}: the checkpoint is incomplete (a rank did "
                "not save, or files were lost)")
        extra = sorted(set(have) - set(want), key=str)
        if extra:
            raise CheckpointFormatError(f"{have[extra[0]]}: not a file of layout {{{_layout_text(layout)}}} "
                                        f"(manifest.json): shards of another layout mixed into {ds_dir}?")
    return files


def _model_name(mp: int, dp: Optional[int]) -> str:
    return f"mp_rank_{mp:02d}_model_states.pt" if dp is None else f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt"


def _optim_name(mp: int, dp: int) -> str:
    return f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"


def load_file(path: Path) -> dict:
    """A DeepSpeed file, weights-only with the allow-list (checkpoint.load_torch; memory-mapped:
    tensors are read when touched). A file holding anything else is refused, not unpickled."""
    try:
        return load_torch(path, map_location="cpu", mmap=True, deepspeed=True)
    except UntrustedCheckpointError:
        raise
    except CheckpointError as exc:  # a truncated zip, a pickle error...
        raise CheckpointFormatError(f"{exc}; it is probably truncated or damaged") from None


# ------------------------------------------------------------------------------------------
# What each model-parallel rank holds
# ------------------------------------------------------------------------------------------

def stage_shapes(cfg: ModelConfig, layout: dict) -> dict[int, dict[str, tuple[int, ...]]]:
    """mp rank -> {parameter name: the shape of its shard}, from the config and the TP plan
    (meta tensors: nothing allocated). Names are global (prune_to_stage keeps them)."""
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    stages = split_layers(cfg.n_layers, pp, layout.get("pp_split"))
    out = {}
    for pp_rank, layers in enumerate(stages):
        model = build_model(cfg, "meta")
        if pp > 1:
            prune_to_stage(model, layers, pp_rank == 0, pp_rank == pp - 1)
        shapes = {}
        for name, p in model.named_parameters():
            shape, dim = list(p.shape), param_shard_dim(name)
            if dim is not None:
                shape[dim] //= tp
            shapes[name] = tuple(shape)
        for tp_rank in range(tp):
            out[pp_rank * tp + tp_rank] = shapes
    return out


def recorded_shapes(files: ShardFiles, mp: int) -> dict[str, tuple[int, ...]]:
    """The parameter shapes the files of model-parallel rank ``mp`` record: DeepSpeed's
    ``param_shapes`` with ZeRO, the module's tensors without."""
    dp_key = 0 if files.layout.get("zero_stage", 0) == 3 else None
    path = files.model[(mp, dp_key)]
    state = load_file(path)
    if state.get("param_shapes"):
        return {n: tuple(s) for group in state["param_shapes"] for n, s in group.items()}
    module = state.get("module")
    if not isinstance(module, dict):
        raise CheckpointFormatError(f"{path}: holds neither param_shapes nor a module state: not a DeepSpeed "
                                    "module file")
    buffers = set(state.get("buffer_names") or ())
    return {n: tuple(t.shape) for n, t in module.items() if torch.is_tensor(t) and n not in buffers}


def check_shards(files: ShardFiles, cfg: ModelConfig) -> dict[int, dict[str, Any]]:
    """Checks every model-parallel rank's recorded shapes against the config and the layout,
    and every optimizer partition's ZeRO stage and partition count; returns a summary per mp
    rank (coordinates, layers, parameters, files and bytes)."""
    expected = stage_shapes(cfg, files.layout)
    stages = split_layers(cfg.n_layers, files.layout.get("pp", 1), files.layout.get("pp_split"))
    dp, zero = files.layout.get("dp", 1), files.layout.get("zero_stage", 0)
    report = {}
    for mp in range(files.num_mp):
        tp_rank, pp_rank = files.coords(mp)
        got, want = recorded_shapes(files, mp), expected[mp]
        where = files.model[(mp, 0 if zero == 3 else None)]
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            raise CheckpointFormatError(f"{where}: holds other parameters than stage {pp_rank} of the config needs "
                                        f"(missing {missing[:3]}, unexpected {extra[:3]}): the shards and "
                                        "config.yaml do not belong together")
        for name, shape in want.items():
            if got[name] != shape:
                raise CheckpointFormatError(f"{where}: parameter '{name}' has shape {got[name]}, but the config "
                                            f"with tp={files.tp} needs {shape} on tensor-parallel rank {tp_rank}")
        for d in range(dp) if zero > 0 else ():
            path = files.optim[(mp, d)]
            opt = load_file(path).get("optimizer_state_dict", {})
            stage, count = opt.get("zero_stage"), opt.get("partition_count")
            count = max(count) if isinstance(count, list) else count
            if stage != zero or count != dp:
                raise CheckpointFormatError(f"{path}: a ZeRO-{stage} partition of {count} ranks, but the layout "
                                            f"says zero_stage={zero} over dp={dp}")
        report[mp] = {"tp_rank": tp_rank, "pp_rank": pp_rank, "layers": [stages[pp_rank].start, stages[pp_rank].stop],
                      "num_params": sum(math.prod(s) for s in want.values()),
                      "files": [{"name": f.name, "bytes": f.stat().st_size} for f in files.files_of(mp)]}
    return report


# ------------------------------------------------------------------------------------------
# Consolidation
# ------------------------------------------------------------------------------------------

def rank_state_dict(files: ShardFiles, mp: int) -> dict[str, torch.Tensor]:
    """The fp32 master weights of one model-parallel rank (its TP slice of its stage)."""
    if files.layout.get("zero_stage", 0) > 0:
        return _zero_to_fp32(files, mp)
    path = files.model[(mp, None)]
    state = load_file(path)
    groups, optimizer = state.get("rlt_master_groups"), state.get("optimizer") or {}
    if groups and "fp32_groups" in optimizer:  # bf16 without ZeRO: masters in the optimizer, by group
        return {n: t.float() for names, ts in zip(groups, optimizer["fp32_groups"]) for n, t in zip(names, ts)}
    module = state.get("module") or {}
    return {n: t.float() for n, t in module.items() if torch.is_tensor(t)}


def _zero_to_fp32(files: ShardFiles, mp: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's zero_to_fp32 on the files of one model-parallel rank, seen through a
    directory of links (the utility reads every file of a directory as one model)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory(prefix="rlt_shards_") as tmp:
        view = Path(tmp) / DS_TAG
        view.mkdir()
        for f in files.files_of(mp):
            os.symlink(f.resolve(), view / f.name)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), safe_unpickling(deepspeed=True):
                sd = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=DS_TAG)
        except Exception as exc:
            kind = refused_type(str(exc))
            if kind is not None:
                raise untrusted(files.directory / DS_TAG, kind) from None
            raise CheckpointFormatError(f"{files.directory}: DeepSpeed's zero_to_fp32 cannot rebuild model-parallel "
                                        f"rank {mp} ({type(exc).__name__}: {exc})") from None
    return {n: t.float() for n, t in sd.items()}


def consolidate(step_dir: Path, cfg: ModelConfig, layout: dict) -> dict[str, torch.Tensor]:
    """The full single-device fp32 state dict (stored names: a tied lm_head is left out) from
    the per-rank shards of a distributed checkpoint."""
    files = index_shards(step_dir, layout)
    check_shards(files, cfg)
    by_stage: dict[int, list[dict[str, torch.Tensor]]] = {}
    for mp in range(files.num_mp):
        tp_rank, pp_rank = files.coords(mp)
        by_stage.setdefault(pp_rank, []).append(rank_state_dict(files, mp))
    expected = stage_shapes(cfg, layout)
    full: dict[str, torch.Tensor] = {}
    for pp_rank in sorted(by_stage):
        slices = by_stage[pp_rank]  # in tp_rank order
        for name in expected[pp_rank * files.tp]:
            if name in full:  # a pipeline replica (null_memory, a tied lm_head): the first stage's copy
                continue
            parts = [sd.get(name) for sd in slices]
            if any(p is None for p in parts):
                raise CheckpointFormatError(f"{files.directory}: stage {pp_rank} has no '{name}' in "
                                            f"tensor-parallel rank {parts.index(None)}'s shards")
            dim = param_shard_dim(name)
            full[name] = parts[0] if dim is None or files.tp == 1 else torch.cat(parts, dim=dim)
    if cfg.tie_embeddings:
        full.pop("lm_head.weight", None)  # stored once, as embed.weight
    return full
