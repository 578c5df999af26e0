"""Inspect a checkpoint directory: what it is, its config, parameter counts by group, dtypes,
where it came from (step and layout for a training checkpoint), and whether its tensors agree
with its config and checksums.

:func:`inspect_path` returns a plain dict (the CLI prints it with :func:`format_report`, or as
JSON); any problem found while verifying is raised as a CheckpointFormatError naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from rlt_mega.model.rlt import param_counts
from rlt_mega.checkpoint_tools import shards, training
from rlt_mega.parallel import reshard
from rlt_mega.checkpoint_tools.export import (
    CONFIG_NAME, MANIFEST_NAME, check_tensors, open_export, tied_aliases, verify_export,
)
from rlt_mega.checkpoint_tools.files import CheckpointFormatError, SafetensorsDir, dtype_name, read_json
from rlt_mega.checkpoint_tools.hf_import import SUPPORTED, check_hf_tensors, hf_model_config, hf_names


def _tensor_summary(st: SafetensorsDir, names: list[str]) -> dict[str, Any]:
    dtypes: Counter = Counter()
    for name in names:
        dtypes[dtype_name(st.dtype(name))] += math.prod(st.shape(name))
    return {
        "num_tensors": len(names),
        "dtypes": dict(dtypes),  # dtype -> number of parameters stored in it
        "files": [{"name": f.name, "bytes": f.stat().st_size} for f in st.files()],
    }


def detect_kind(path: Path) -> str:
    if (path / MANIFEST_NAME).is_file():
        return "export"
    if training.is_training_checkpoint(path):
        return "training_checkpoint"
    if (path / CONFIG_NAME).is_file():
        model_type = read_json(path / CONFIG_NAME, "").get("model_type")
        if model_type in SUPPORTED:
            return "hf"
    raise CheckpointFormatError(
        f"{path}: not a checkpoint this tool knows: an RLT export has {MANIFEST_NAME} and {CONFIG_NAME}, "
        f"a training checkpoint step_N/ has manifest.json and config.yaml (or give checkpoint.dir), "
        f"a Hugging Face checkpoint has {CONFIG_NAME} with model_type in {sorted(SUPPORTED)}")


def inspect_export(path: Path, verify: bool = True) -> dict[str, Any]:
    cfg, manifest, st = open_export(path)  # names, shapes and dtypes checked against config.json
    with st:
        report = {"path": str(path), "kind": "export", "config": dataclasses.asdict(cfg),
                  "param_counts": param_counts(cfg), **_tensor_summary(st, st.names()),
                  "tied": tied_aliases(cfg), "tokenizer": manifest.get("tokenizer"),
                  "source": manifest.get("source") or {}}
    source = report["source"]
    report["step"] = source.get("step")
    report["layout"] = source.get("layout")
    report["checks"] = {"shapes": "ok"}
    if verify:
        report["checks"]["sha256"] = f"ok ({len(verify_export(path))} tensors)"
    return report


def inspect_training_checkpoint(path: Path, verify: bool = True) -> dict[str, Any]:
    """A step directory (or the newest valid one under a checkpoint root): its consolidated
    weights and, for a distributed checkpoint, its per-rank shards (every file the layout
    implies, and the shapes each records, against the config)."""
    step_dir, run_cfg, manifest = training.read_checkpoint(path, check_files=verify)
    cfg, layout = run_cfg.model, training.layout_of(manifest)
    report = {"path": str(step_dir), "kind": "training_checkpoint", "step": manifest.get("step"),
              "layout": layout, "config": dataclasses.asdict(cfg), "param_counts": param_counts(cfg),
              "files": [{"name": n, "bytes": m["size"]} for n, m in manifest["files"].items()],
              "checks": {}}
    if (step_dir / "model.safetensors").is_file():
        with SafetensorsDir(step_dir) as st:
            check_tensors({n: st.shape(n) for n in st.names()}, cfg, str(step_dir), st.file_of)
            summary = _tensor_summary(st, st.names())
        report.update(num_tensors=summary["num_tensors"], dtypes=summary["dtypes"], tied=tied_aliases(cfg))
        report["checks"]["shapes"] = "ok"
    if (step_dir / shards.DS_TAG).is_dir():
        files = shards.index_shards(step_dir, layout)
        report["shards"] = {str(mp): info for mp, info in shards.check_shards(files, cfg).items()}
        report["checks"]["shards"] = (f"ok ({len(files.model) + len(files.optim)} files: {files.num_mp} model-parallel "
                                      f"x {layout.get('dp', 1)} data-parallel ranks, shapes as the config)")
    elif "shapes" not in report["checks"] and not (step_dir / reshard.STATE_DIR).is_dir():
        raise CheckpointFormatError(f"{step_dir}: neither model.safetensors nor {shards.DS_TAG}/: it holds no weights")
    if (step_dir / reshard.STATE_DIR).is_dir():
        state = reshard.LayoutFreeState.open(step_dir)
        own = (step_dir / shards.DS_TAG).is_dir() or (step_dir / "engine.pt").is_file()
        report["resumes"] = reshard.resumable_on(layout, own)
        report["moves"] = moves(run_cfg, layout)
        report["checks"]["state"] = (f"ok ({len(state.names())} parameters: fp32 masters and Adam moments at Adam step "
                                     f"{state.adam_step}, in {state.tp} tensor-parallel slices)")
    else:
        report["resumes"] = (f"with its optimizer state on {reshard.format_layout(layout)} only (written without "
                             "the layout-free state: checkpoint.layout_free=false, or before it existed); elsewhere "
                             "with its weights only (export, then train.init_from)")
    queue = queue_moves(run_cfg, manifest, step_dir)
    if queue:
        report["queue"] = queue
    if verify:
        report["checks"]["sha256"] = f"ok ({len(manifest['files'])} files)"
    return report


def queue_moves(run_cfg, manifest: dict, step_dir: Path) -> Optional[str]:
    """In words, an asynchronous GRPO checkpoint's queue of sampled data steps and how it moves
    (train/async_grpo.py ``resplit``); None for any other checkpoint."""
    g = run_cfg.grpo
    files = [f for f in step_dir.glob("job_rank*.pt") if f.is_file()]
    if manifest.get("job") != "grpo" or not g.max_staleness or not files:
        return None
    layout = manifest.get("rank_files_layout") or training.layout_of(manifest)
    dp = layout.get("dp", 1) or 1
    partial = f", partial_rollouts={g.partial_rollouts}" if g.partial_rollouts else ""
    kept = (" Its kept policy versions (grpo.partial_rollouts, grpo.verify_onpolicy) move with it, re-cut by the TP "
            "plan for another tp, pp or stage split; the on-policy check (grpo.verify_onpolicy) of its queued samples "
            f"holds on tp={layout.get('tp', 1) or 1} only." if g.partial_rollouts or g.verify_onpolicy else "")
    return (f"{g.max_staleness} data step{'s' if g.max_staleness > 1 else ''} sampled ahead (grpo.max_staleness={g.max_staleness}{partial}) on each "
            f"of {dp} data-parallel replicas, in {len(files)} job_rank<r>.pt written on {reshard.format_layout(layout)}; "
            f"it moves to any layout with the checkpoint (train.resume, or rlt-mega reshard first): each data step's "
            f"{g.prompts_per_step * dp} prompts x {g.group_size} completions are re-split into the new data-parallel "
            f"replicas' shares as that layout samples them, keeping the global batch (grpo.prompts_per_step x "
            f"parallel.dp = {g.prompts_per_step * dp}) and the rows of a rollout batch (train.grad_accum).{kept}")


def candidate_layouts(run_cfg, layout: dict) -> list[dict]:
    """The layouts of the same number of processes the config allows (every tp x pp; the
    checkpoint's ZeRO stage, or 1 where it would be 3 with pp > 1), and one process."""
    from rlt_mega.config import ConfigError
    from rlt_mega.parallel.dims import resolve_layout

    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    out = []
    for tp in (t for t in range(1, world + 1) if world % t == 0):
        for pp in (q for q in range(1, world // tp + 1) if (world // tp) % q == 0):
            zero = layout.get("zero_stage", 0)
            zero = 1 if zero == 3 and pp > 1 else zero
            cand = {"tp": tp, "pp": pp, "dp": world // (tp * pp), "zero_stage": zero}
            par = dataclasses.replace(run_cfg.parallel, tp=tp, pp=pp, dp=None, zero_stage=zero, pp_split=None)
            try:
                resolve_layout(par, run_cfg.model, world)
            except (ConfigError, ValueError):
                continue
            if not reshard.same_layout(cand, layout):
                out.append(cand)
    if world > 1:
        out.append({"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0})
    return out


def moves(run_cfg, layout: dict) -> list[dict]:
    """What resuming on each candidate layout costs (parallel/reshard.py, reshard_cost)."""
    out = []
    for cand in candidate_layouts(run_cfg, layout):
        cost = reshard.reshard_cost(run_cfg.model, layout, cand)["resume"]
        out.append({"layout": cand, "read_per_rank": cost["most_per_rank"],
                    "gathered_per_rank": cost["gathered_per_rank"], "peak_per_rank": cost["peak_per_rank"]})
    return out


def inspect_hf(path: Path) -> dict[str, Any]:
    """A Llama/Qwen2 directory: the RLT it would import as, and its tensors checked against it."""
    file = path / CONFIG_NAME
    hf = read_json(file, "")
    cfg = hf_model_config(hf, file)
    with SafetensorsDir(path) as st:
        check_hf_tensors(st, cfg, hf_names(cfg))
        report = {"path": str(path), "kind": "hf", "model_type": hf.get("model_type"),
                  "config": dataclasses.asdict(cfg), "param_counts": param_counts(cfg),
                  **_tensor_summary(st, st.names()), "checks": {"shapes": "ok"}}
    return report


def inspect_path(path: str | Path, verify: bool = True) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: not a directory")
    kind = detect_kind(path)
    if kind == "export":
        return inspect_export(path, verify)
    if kind == "training_checkpoint":
        return inspect_training_checkpoint(path, verify)
    return inspect_hf(path)


def _human(n: int) -> str:
    for unit in ("", "K", "M", "B"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.2f}{unit}"
        n /= 1000
    return f"{n:.2f}T"


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['path']}: {report['kind']}"]
    if report.get("step") is not None:
        lines.append(f"step: {report['step']}")
    if report.get("layout"):
        lines.append(f"layout: {json.dumps(report['layout'])}")
    if report.get("resumes"):
        lines.append(f"resumes: {report['resumes']}")
    for move in report.get("moves") or ():
        lines.append(f"  on {reshard.format_layout(move['layout'])}: each rank reads at most "
                     f"{_human(move['read_per_rank'])}B (and receives at most {_human(move['gathered_per_rank'])}B "
                     f"from its data-parallel group), peak {_human(move['peak_per_rank'])}B beside the engine "
                     f"(train.resume, or rlt-mega reshard first)")
    if report.get("queue"):
        lines.append(f"queue: {report['queue']}")
    if report.get("source"):
        lines.append(f"source: {json.dumps(report['source'])}")
    as_rlt = " (of the RLT it imports as)" if report["kind"] == "hf" else ""
    lines.append(f"config{as_rlt}:")
    lines += [f"  {k}: {v}" for k, v in report["config"].items()]
    lines.append(f"parameters{as_rlt}:")
    lines += [f"  {k:<15} {v:>14,d}  ({_human(v)})" for k, v in report["param_counts"].items()]
    if "num_tensors" in report:
        lines.append(f"tensors: {report['num_tensors']} stored"
                     + (f", tied: {report['tied']}" if report.get("tied") else ""))
        lines.append("dtypes: " + ", ".join(f"{k} ({_human(v)} parameters)" for k, v in report["dtypes"].items()))
    if report.get("shards"):
        lines.append(f"shards per model-parallel rank (mp = pp_rank * tp + tp_rank) in {shards.DS_TAG}/:")
        for mp, info in report["shards"].items():
            files = ", ".join(f"{f['name']} ({_human(f['bytes'])}B)" for f in info["files"])
            lines.append(f"  mp {mp} (tp {info['tp_rank']}, pp {info['pp_rank']}, layers {info['layers'][0]}.."
                         f"{info['layers'][1] - 1}): {_human(info['num_params'])} parameters; {files}")
        lines.append("files: " + ", ".join(f"{f['name']} ({_human(f['bytes'])}B)" for f in report["files"]
                                           if not f["name"].startswith(shards.DS_TAG + "/")))
    else:
        lines.append("files: " + ", ".join(f"{f['name']} ({_human(f['bytes'])}B)" for f in report["files"]))
    if report.get("tokenizer"):
        lines.append(f"tokenizer: {report['tokenizer']}")
    lines.append("checks: " + ", ".join(f"{k} {v}" for k, v in report["checks"].items()))
    return "\n".join(lines)
