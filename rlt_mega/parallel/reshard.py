"""Resuming a distributed checkpoint on another data-parallel layout, with its optimizer state.

A training checkpoint records its layout (``tp``, ``pp``, ``pp_split``, ``dp``, ``zero_stage``).
What a resume may change, and how:

* nothing: DeepSpeed's own ``load_checkpoint`` (bit for bit);
* ``dp`` with ``zero_stage == 0`` before and after: the optimizer state is replicated over the
  data-parallel ranks (one copy per model-parallel rank in ``mp_rank_XX_model_states.pt``), so
  DeepSpeed's ``load_checkpoint`` reads it at any ``dp``;
* ``dp`` and/or ``zero_stage`` within ZeRO-1/2, or ``dp`` under ZeRO-3 with ``tp == 1``:
  DeepSpeed's **universal checkpoint**. ``deepspeed.checkpoint.ds_to_universal`` (run once, by
  rank 0, into a scratch directory under ``checkpoint.dir``) turns the ZeRO partitions into one
  file per parameter and state (``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, full
  tensors: TP shards merged by the patterns of :func:`universal_checkpoint_info`), and every
  rank loads its new partition with ``load_universal`` (each optimizer's
  ``load_hp_checkpoint_state``). We use DeepSpeed's converter rather than re-partitioning the
  flat fp32/Adam buffers ourselves: the partition arithmetic (alignment padding, fragment
  offsets, the ZeRO-3 sub-groups) is DeepSpeed's and changes between its versions, and the
  converter is the code DeepSpeed tests against its own loaders;
* anything else (``tp``, ``pp`` or the stage split, ZeRO-0 <-> ZeRO-1/2/3, ZeRO-1/2 <-> 3, or
  ZeRO-3 with ``tp > 1``, whose universal loader does not slice tensor-parallel shards for
  layers that are not DeepSpeed's AutoTP): weights only, through ``rlt-mega export`` and
  ``train.init_from``; :func:`resume_plan` raises an error naming both layouts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
from pathlib import Path
from typing import Optional

from rlt_mega.checkpoint import CheckpointError
from rlt_mega.config import ModelConfig
from rlt_mega.log import get_logger
from rlt_mega.parallel.tp import param_shard_dim

log = get_logger(__name__)

SAME, REPLICATED, UNIVERSAL = "same", "replicated", "universal"


def model_axes_differ(a: dict, b: dict) -> bool:
    """Whether two layouts slice the model differently (tensor/pipeline parallel, stage split).
    A layout without ``pp_split`` (written before it was recorded) matches any split: DeepSpeed's
    strict module loading still catches a real difference."""
    if a.get("tp", 1) != b.get("tp", 1) or a.get("pp", 1) != b.get("pp", 1):
        return True
    sa, sb = a.get("pp_split"), b.get("pp_split")
    return sa is not None and sb is not None and list(sa) != list(sb)


def saved_layout(directory: Path) -> Optional[dict]:
    """The layout in a checkpoint's manifest.json (None without one: a bare engine save)."""
    manifest = Path(directory) / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        return json.loads(manifest.read_text()).get("layout")
    except (json.JSONDecodeError, AttributeError):
        raise CheckpointError(f"checkpoint {directory}: manifest.json is corrupt") from None


def format_layout(layout: dict) -> str:
    keys = ("tp", "pp", "dp", "zero_stage") + (("pp_split",) if layout.get("pp_split") else ())
    return "{" + ", ".join(f"{k}={layout.get(k)}" for k in keys) + "}"


def weights_only_hint(directory: Path) -> str:
    return (f"to continue from its weights with a fresh optimizer state, run `rlt-mega export {directory} EXPORT_DIR` "
            "and start the run with train.init_from=EXPORT_DIR (without train.resume)")


def resume_plan(saved: dict, current: dict, directory: Path) -> str:
    """How a checkpoint written with layout ``saved`` resumes on ``current``: SAME, REPLICATED or
    UNIVERSAL (module docstring). Raises CheckpointError, naming both layouts, when only the
    weights can move."""
    zs, zc = saved.get("zero_stage", 0), current.get("zero_stage", 0)
    if model_axes_differ(saved, current):
        why = ("the tensor/pipeline layout changed: every rank's parameters and optimizer state are sliced by it, "
               "and the optimizer state does not move across tensor/pipeline layouts")
    elif saved.get("dp", 1) == current.get("dp", 1) and zs == zc:
        return SAME
    elif zs == 0 and zc == 0:
        return REPLICATED
    elif (zs == 0) != (zc == 0):
        why = "the optimizer state moves between ZeRO stages 1-3 only, not to or from ZeRO-0"
    elif (zs == 3) != (zc == 3):
        why = "DeepSpeed's universal checkpoint moves ZeRO-3 optimizer state only to ZeRO-3 (and 1/2 only to 1/2)"
    elif zs == 3 and current.get("tp", 1) > 1:
        why = ("DeepSpeed's ZeRO-3 universal loader does not slice tensor-parallel shards of megatron layers, "
               "so ZeRO-3 with tp > 1 resumes only on its own data-parallel size")
    else:
        return UNIVERSAL
    raise CheckpointError(f"checkpoint {directory} was written with layout {format_layout(saved)}; this run has "
                          f"{format_layout(current)}: {why}. Resume on {format_layout(saved)}, or "
                          f"{weights_only_hint(directory)}")


def resumable_on(layout: dict) -> str:
    """In words, the layouts on which a distributed checkpoint of ``layout`` resumes with its
    optimizer state (the rules of :func:`resume_plan`)."""
    tp, pp, dp, zero = (layout.get(k, d) for k, d in (("tp", 1), ("pp", 1), ("dp", 1), ("zero_stage", 0)))
    split = f" (stage split {layout['pp_split']})" if layout.get("pp_split") else ""
    if zero == 0:
        where = f"tp={tp}, pp={pp}{split}, zero_stage=0 and any dp"
    elif zero in (1, 2):
        where = f"tp={tp}, pp={pp}{split}, zero_stage 1 or 2 and any dp"
    elif tp == 1:
        where = "tp=1, pp=1, zero_stage=3 and any dp"
    else:
        where = f"tp={tp}, pp=1, zero_stage=3, dp={dp} only"
    return (f"with its optimizer state on {where}; on any other layout with its weights only "
            "(export, then train.init_from)")


def universal_checkpoint_info(cfg: ModelConfig) -> dict:
    """The ``universal_checkpoint_info`` DeepSpeed's converter needs to merge tensor-parallel
    slices into full tensors (TP_TABLE): row-parallel weights are concatenated on dim 1,
    replicated parameters (norms, recur_proj, null_memory, z_init, row-parallel biases) are
    checked equal on every TP rank and kept once (they get identical gradients and updates on
    every TP rank), everything else is concatenated on dim 0.
    ``null_memory`` lives on every pipeline stage: the first stage's copy is kept. Patterns are
    whole names: the converter's strict mode requires every pattern to match a parameter."""
    from rlt_mega.model.rlt import build_model

    names = [n for n, _ in build_model(cfg, "meta").named_parameters()]
    exact = lambda n: re.escape(n) + "$"  # noqa: E731
    return {
        "universal_checkpoint_version": 0.4,
        "tp_replicated_parameter_patterns": [exact(n) for n in names if param_shard_dim(n) is None],
        "parameter_with_row_parallelism_patterns": [exact(n) for n in names if param_shard_dim(n) == 1],
        "pipeline_replicated_parameter_patterns": [exact("null_memory")],
    }


def to_universal(ds_dir: Path, out_dir: Path, workers: int = 1) -> None:
    """DeepSpeed's ``ds_to_universal`` on one checkpoint tag directory (``step_N/deepspeed``) ->
    ``out_dir`` (its universal form, same tag name; ``out_dir.parent/latest_universal``).
    Its progress output is captured and logged at debug level; a failure is a CheckpointError
    carrying the converter's last lines."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(ds_dir), output_folder=str(out_dir), num_extract_workers=workers,
                              num_merge_workers=workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)  # checkpoints written before the info was stored
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            ds_to_universal.main(args)
    except Exception as exc:  # the converter raises asserts, RuntimeErrors, FileNotFoundErrors...
        tail = "\n".join(out.getvalue().splitlines()[-5:])
        raise CheckpointError(f"DeepSpeed's universal-checkpoint converter failed on {ds_dir} "
                              f"({type(exc).__name__}: {exc}); its last output:\n{tail}") from exc
    log.debug("ds_to_universal %s:\n%s", ds_dir, out.getvalue())


def scratch_dir(checkpoint_root: str | Path, step_dir: Path) -> Path:
    """Where a resume converts ``step_dir``: under the run's checkpoint.dir (shared by every
    node, writable), hidden from CheckpointManager (not a step_N name)."""
    return Path(checkpoint_root) / f".universal-{step_dir.name}"


def remove(path: Optional[Path]) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
