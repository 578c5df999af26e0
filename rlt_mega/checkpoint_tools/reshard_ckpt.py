"""``rlt-mega reshard CKPT OUT --tp N --pp N --dp N --zero S [--pp-split ...]``: a training
checkpoint cut for another layout, offline, with its optimizer state.

The input is verified against its manifest first (sha256 of every file: a missing or damaged file
is refused, named, before any work) and never written; the output may not be, contain or lie
inside the input (files.check_output, as export). The target layout is checked by the same rules
a run checks (parallel/dims.resolve_layout: heads divisible by tp, stages, ZeRO-3 without pp),
naming the keys. The output is one complete step directory: the layout-free state
(parallel/reshard.py) re-cut into the target's tensor-parallel slices and dealt over its
data-parallel ranks, trainer.pt (step, data position), config.yaml with the new ``parallel.*``
and a manifest with the sha256 of every file written, which records the layout it was cut for and
where it came from. ``train.resume=OUT`` resumes it on the target layout (on any other too: the
state is the same layout-free form). The output is written in files of at most one bucket, each
streamed: its header planned from the shapes, then every tensor read from the input (one key of
one parameter's slice) and written at once; the peak memory is one such tensor (two where
tensor-parallel pieces are joined), not a bucket.

The per-rank files (job_rank<r>.pt: an asynchronous GRPO queue and its kept policy versions;
rng_rank<r>.pt) are carried as they are, never loaded, with the layout whose ranks wrote them
(the manifest's ``rank_files_layout``): the resume moves them as it moves a checkpoint's own, by
one mechanism (train/loop.py: every saved replica's queue re-split into the new layout's shares,
train/async_grpo.py ``resplit``), so resuming the output equals resuming the input on the same
layout. What a reshard does not carry: DeepSpeed's own files (the resume rebuilds them from the
state), the consolidated model.safetensors (``rlt-mega export OUT`` reads the weights from the
state's fp32 masters).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path
from typing import Optional

from rlt_mega.checkpoint import MANIFEST, CheckpointError, rank_files_layout, seal, verify
from rlt_mega.config import ConfigError, load_config, save_config
from rlt_mega.checkpoint_tools.files import atomic_directory
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.dims import resolve_layout, split_layers
from rlt_mega.parallel.reshard import (BUCKET_BYTES, KEYS, SEP, STATE_DIR, LayoutFreeState, changes, format_layout,
                                       owner, saved_layout, state_metadata, write_streamed)
from rlt_mega.parallel.stage import prune_to_stage

CARRIED = ("trainer.pt",)  # layout-free files copied as they are


def target_layout(tp: int, pp: int, dp: int, zero: int, pp_split: Optional[list[int]]) -> dict:
    out = {"tp": tp, "pp": pp, "dp": dp, "zero_stage": zero}
    if pp > 1:
        out["pp_split"] = list(pp_split) if pp_split else None
    return out


def stage_names(cfg, state: LayoutFreeState, pp: int, pp_split) -> list[list[str]]:
    """The stored names each pipeline stage of the target writes, in the model's order: a name
    belongs to the first stage whose module holds it (a pipeline replica is the first stage's)."""
    stages = split_layers(cfg.model.n_layers, pp, pp_split)
    stored, seen, out = set(state.names()), set(), []
    for pp_rank, layers in enumerate(stages):
        model = build_model(cfg.model, "meta")
        if pp > 1:
            prune_to_stage(model, layers, pp_rank == 0, pp_rank == pp - 1)
        prefixes = {n for n, _ in model.named_modules()}
        names = []
        for name in sorted(stored - seen, key=_order(cfg)):
            module = name.split(".parametrizations.")[0] if ".parametrizations." in name else name.rpartition(".")[0]
            if module in prefixes or (module == "" and hasattr(model, name)):
                names.append(name)
        seen |= set(names)
        out.append(names)
    missing = stored - seen
    if missing:
        raise CheckpointError(f"the layout-free state holds parameters no stage of the config has: "
                              f"{sorted(missing)[:3]}: the checkpoint and its config.yaml do not belong together")
    return out


def _order(cfg):
    """Sort key: the single-device model's parameter order (adapters after their layer)."""
    order = {n: i for i, (n, _) in enumerate(build_model(cfg.model, "meta").named_parameters())}

    def key(name: str) -> tuple:
        base = name.split(".parametrizations.")[0] + ".weight" if ".parametrizations." in name else name
        return order.get(base, len(order)), name

    return key


def buckets(state: LayoutFreeState, names: list[str], tp: int, tp_rank: int, bucket_bytes: int) -> list[list[str]]:
    """``names`` in files of at most ``bucket_bytes`` of state (one larger parameter alone), as
    StateWriter fills them."""
    out, size = [], 0
    for name in names:
        n = 12 * math.prod(state.slice_shape(name, tp, tp_rank))
        if not out or (size + n > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def reshard(src: str | Path, out: str | Path, tp: int, pp: int, dp: int, zero: int,
            pp_split: Optional[list[int]] = None, bucket_bytes: Optional[int] = None) -> dict:
    """Writes ``out``: checkpoint ``src`` cut for the layout (tp, pp, dp, zero, pp_split).
    Returns a summary (layouts, bytes read and written, files)."""
    src, out = Path(src), Path(out)
    manifest = verify(src)  # every file against its sha256, before any work
    cfg = load_config(src / "config.yaml")
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero_stage = tp, pp, dp, zero
    cfg.parallel.pp_split = list(pp_split) if pp_split else None
    try:
        resolve_layout(cfg.parallel, cfg.model, tp * pp * dp)
    except (ConfigError, ValueError) as exc:
        raise CheckpointError(f"cannot reshard {src} onto {{tp={tp}, pp={pp}, dp={dp}, zero_stage={zero}}}: "
                              f"{exc}") from None
    source_layout = saved_layout(src) or {}
    state = LayoutFreeState.open(src)
    stages = stage_names(cfg, state, pp, cfg.parallel.pp_split)
    layout = target_layout(tp, pp, dp, zero, [len(r) for r in split_layers(cfg.model.n_layers, pp, cfg.parallel.pp_split)])
    written = 0
    meta = {"adam_step": state.adam_step, "steps_taken": state.steps_taken}
    with atomic_directory(out, inputs=[src]) as tmp:
        (tmp / STATE_DIR).mkdir()
        for pp_rank, names in enumerate(stages):
            for tp_rank in range(tp):
                metadata = state_metadata(tp, tp_rank, meta)
                for d in range(dp):
                    mine = [n for i, n in enumerate(names) if owner(i, n, tp_rank, d, dp)]
                    for k, group in enumerate(buckets(state, mine, tp, tp_rank, bucket_bytes or BUCKET_BYTES)):
                        entries = [(f"{n}{SEP}{key}", state.slice_shape(n, tp, tp_rank)) for n in group for key in KEYS]
                        file = tmp / STATE_DIR / f"mp{pp_rank * tp + tp_rank:03d}_dp{d:03d}_{k:03d}.safetensors"
                        write_streamed(file, entries, metadata,
                                       lambda e: state.read(*e.rsplit(SEP, 1), tp, tp_rank))
                        written += sum(4 * math.prod(shape) for _, shape in entries)
        for name in CARRIED:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        per_rank = rank_files(src)
        for f in per_rank:
            shutil.copy2(f, tmp / f.name)
        save_config(cfg, tmp / "config.yaml")
        carried = {"rank_files_layout": rank_files_layout(src)} if per_rank else {}
        seal(tmp, int(manifest["step"]), {"layout": layout, "job": manifest.get("job"), **carried,
                                          "resharded_from": {"path": str(src.resolve()), "layout": source_layout,
                                                             "time": time.time()}})
    files = json.loads((out / MANIFEST).read_text())["files"]
    return {"source": str(src), "out": str(out), "from": source_layout, "to": layout,
            "changes": changes(source_layout, layout), "parameters": len(state.names()),
            "bytes_read": state.bytes_read, "bytes_written": written, "files": len(files),
            "rank_files": len(per_rank)}


def rank_files(src: Path) -> list[Path]:
    """A checkpoint's per-rank files (job_rank<r>.pt, rng_rank<r>.pt), in rank order."""
    found = [(m.group(1), int(m.group(2)), f) for f in src.iterdir()
             if f.is_file() and (m := re.fullmatch(r"(job|rng)_rank(\d+)\.pt", f.name))]
    return [f for _, _, f in sorted(found)]


def format_summary(s: dict) -> str:
    return (f"resharded {s['source']} {format_layout(s['from'])} -> {s['out']} {format_layout(s['to'])} "
            f"({s['changes']}): {s['parameters']} parameters with their fp32 masters and Adam moments"
            + (f", {s['rank_files']} per-rank files as they are (an asynchronous GRPO queue is re-split at the "
               "resume)" if s.get("rank_files") else "") + ", read "
            f"{s['bytes_read'] / 1e6:.2f} MB, wrote {s['bytes_written'] / 1e6:.2f} MB in {s['files']} files "
            f"(manifest.json: sha256 of each); resume it with train.resume={s['out']} and parallel.tp={s['to']['tp']} "
            f"parallel.pp={s['to']['pp']} parallel.zero_stage={s['to']['zero_stage']} on "
            f"{s['to']['tp'] * s['to']['pp'] * s['to']['dp']} processes")
