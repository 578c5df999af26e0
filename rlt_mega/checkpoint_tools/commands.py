"""The export, import and inspect commands: their arguments and what they do, shared by the
``rlt-mega`` subcommands and the scripts in tools/. Each ``run_*`` returns the text to show
the user; the caller prints it (library code never prints).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterable

from rlt_mega.checkpoint import CheckpointError, check_output
from rlt_mega.checkpoint_tools import training
from rlt_mega.checkpoint_tools.export import (
    DEFAULT_MAX_SHARD_SIZE, MANIFEST_NAME, export_state_dict, load_exported, read_manifest,
)
from rlt_mega.checkpoint_tools.files import EXPORT, CheckpointFormatError
from rlt_mega.checkpoint_tools.hf_import import import_hf
from rlt_mega.checkpoint_tools.inspect_ckpt import format_report, inspect_path

# The errors a user can fix from the message alone; the CLI prints them without a traceback.
USER_ERRORS = (CheckpointFormatError, CheckpointError, FileExistsError, FileNotFoundError)


def export_path(src: str | Path, out_dir: str | Path, *, dtype: str = "auto",
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, tokenizer=None,
                overwrite: bool = False, weights: str = "auto", inputs: Iterable[str | Path] = ()) -> Path:
    """Exports ``src`` into ``out_dir``: a training checkpoint (a step directory, or the newest
    valid one under checkpoint.dir; ``weights``: "auto", "consolidated" or "shards", see
    training.weights_source), or an export directory (re-exported, e.g. in bf16 or with other
    shard sizes). The optimizer state is never exported. ``inputs``: further paths the output may
    not replace (the checkpoint root a step directory was found under)."""
    src = Path(src)
    inputs = [*inputs, src]  # as given first: the message names what the user typed
    check_output(out_dir, inputs, overwrite, kind=EXPORT)  # before the weights are read
    if training.is_training_checkpoint(src):
        run_cfg, sd, source = training.load_training_weights(src, weights)
        return export_state_dict(sd, run_cfg.model, out_dir, tokenizer=tokenizer or training.tokenizer_of(run_cfg),
                                 max_shard_size=max_shard_size, dtype=dtype, source=source, overwrite=overwrite,
                                 inputs=inputs)
    if (src / MANIFEST_NAME).is_file():
        cfg, sd = load_exported(src)  # verified: shapes and sha256
        source = {"kind": "export", "path": str(src.resolve()), "from": read_manifest(src).get("source")}
        return export_state_dict(sd, cfg, out_dir, tokenizer=tokenizer if tokenizer else _tokenizer_of(src),
                                 max_shard_size=max_shard_size, dtype=dtype, source=source, overwrite=overwrite,
                                 inputs=inputs)
    raise CheckpointFormatError(f"{src}: nothing to export: expected a training checkpoint (step_N/ with "
                                f"manifest.json, or checkpoint.dir) or an RLT export directory (with "
                                f"{MANIFEST_NAME}); a Hugging Face checkpoint is converted with `rlt-mega import`")


def shard_size(text: str) -> int:
    """argparse type of --max-shard-size: bytes, or a number with KB/MB/GB/TB (powers of 1000,
    as huggingface_hub counts them)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    number, unit = (text[:-2], text[-2:].upper()) if text[-2:].upper() in units else (text, None)
    try:
        value = int(float(number) * units[unit]) if unit else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes or a size such as 500MB or 5GB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the shard size must be positive")
    return value


def _tokenizer_of(export_dir: Path):
    tok = read_manifest(export_dir).get("tokenizer")
    return export_dir if isinstance(tok, list) and tok else tok


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a training checkpoint (step_N/ or checkpoint.dir for the newest) or an export")
    p.add_argument("out_dir", help="the export directory to write")
    p.add_argument("--dtype", default="auto", help="auto (as stored), fp32, bf16 or fp16")
    p.add_argument("--max-shard-size", type=shard_size, default=DEFAULT_MAX_SHARD_SIZE, help="shard the safetensors above this size")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory, tokenizer.json or 'byte'")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it is an earlier export (never the input, nor a directory of other files)")
    p.add_argument("--weights", choices=training.WEIGHT_SOURCES, default="auto",
                   help="a distributed checkpoint's weights from its consolidated model.safetensors, from its "
                        "per-rank shards, or from its layout-free state's fp32 masters (state/: all a reshard "
                        "output holds); auto: the first of these the checkpoint has")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--merge", action="store_true",
                      help="a checkpoint of a run with model.lora: the full export, adapters merged into their base")
    what.add_argument("--adapters", action="store_true",
                      help="a checkpoint of a run with model.lora: a peft adapter directory (adapter_config.json + "
                           "adapter_model.safetensors) for the transformers export of its base")


def run_export(a: argparse.Namespace) -> str:
    if a.adapters or a.merge or _holds_adapters(a.src):
        return _run_adapter_export(a)
    out = export_path(a.src, a.out_dir, dtype=a.dtype, max_shard_size=a.max_shard_size,
                      tokenizer=a.tokenizer, overwrite=a.overwrite, weights=a.weights)
    source = read_manifest(out).get("source") or {}
    if source.get("kind") != "training_checkpoint":
        return f"exported {a.src} -> {out}"
    return (f"exported {a.src} (step {source.get('step')}, layout {json.dumps(source.get('layout'))}, weights from "
            f"the {source.get('weights')}) -> {out}\nweights only: the optimizer state stays in the checkpoint; "
            f"start a run of any layout from it with train.init_from={out}")


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="a Llama/Qwen2 directory: config.json + model.safetensors (or index + shards)")
    p.add_argument("out_dir", help="the RLT export directory to write")
    p.add_argument("--memory-block", type=int, default=1, help="model.memory_block (C) of the RLT")
    p.add_argument("--arch", choices=("rlt", "dense"), default="rlt",
                   help="rlt (default): the RLT that reproduces the model; dense: the model itself (model.arch=dense)")
    p.add_argument("--seed", type=int, default=0, help="seed of the RLT-only weights (cross q/k/v, ...)")
    p.add_argument("--dtype", default="auto", help="auto (as stored), fp32, bf16 or fp16")
    p.add_argument("--max-seq-len", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--max-shard-size", type=shard_size, default=DEFAULT_MAX_SHARD_SIZE, help="shard the safetensors above this size")
    p.add_argument("--no-tokenizer", action="store_true", help="do not copy the tokenizer files")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it is an earlier export (never the input, nor a directory of other files)")


def run_import(a: argparse.Namespace) -> str:
    out = import_hf(a.hf_dir, a.out_dir, memory_block=a.memory_block, seed=a.seed, dtype=a.dtype,
                    max_seq_len=a.max_seq_len, max_shard_size=a.max_shard_size,
                    tokenizer=None if a.no_tokenizer else "auto", overwrite=a.overwrite, arch=a.arch)
    return f"imported {a.hf_dir} -> {out}"


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="an RLT export, a training checkpoint or a Llama/Qwen2 directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 of every tensor")


def run_inspect(a: argparse.Namespace) -> str:
    report = inspect_path(a.path, verify=not a.no_verify)
    return json.dumps(report, indent=2) if a.json else format_report(report)


def _layout_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}tp", type=int, required=not prefix, default=None, help="tensor-parallel size")
    p.add_argument(f"--{prefix}pp", type=int, default=1, help="pipeline stages")
    p.add_argument(f"--{prefix}dp", type=int, default=1, help="data-parallel size")
    p.add_argument(f"--{prefix}zero", type=int, choices=(0, 1, 2, 3), default=1, help="ZeRO stage")
    p.add_argument(f"--{prefix}pp-split", type=lambda t: [int(x) for x in t.split(",")], default=None,
                   help="layers per stage, comma-separated (default: even)")


def add_reshard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a training checkpoint (step_N/ or checkpoint.dir for the newest valid one)")
    p.add_argument("out_dir", help="the checkpoint directory to write (not inside the input)")
    _layout_arguments(p)


def run_reshard(a: argparse.Namespace) -> str:
    from rlt_mega.checkpoint_tools.reshard_ckpt import format_summary, reshard

    return format_summary(reshard(training.resolve(a.src), a.out_dir, a.tp, a.pp, a.dp, a.zero, a.pp_split))


def add_reshard_cost_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a run config (.yaml) or a training checkpoint (its config and layout)")
    _layout_arguments(p)
    _layout_arguments(p, "from-")


def run_reshard_cost(a: argparse.Namespace) -> str:
    from rlt_mega.config import load_config
    from rlt_mega.parallel.reshard import format_cost, reshard_cost

    source, saved = Path(a.source), None
    if training.is_training_checkpoint(source):
        step_dir, cfg, manifest = training.read_checkpoint(source, check_files=False)
        saved = training.layout_of(manifest)
    else:
        cfg = load_config(source)
    if a.from_tp is not None:
        saved = {"tp": a.from_tp, "pp": a.from_pp, "dp": a.from_dp, "zero_stage": a.from_zero,
                 **({"pp_split": a.from_pp_split} if a.from_pp_split else {})}
    if saved is None:
        raise CheckpointError(f"{source}: a config has no layout: give the one to move from (--from-tp, --from-pp, "
                              "--from-dp, --from-zero)")
    dst = {"tp": a.tp, "pp": a.pp, "dp": a.dp, "zero_stage": a.zero, **({"pp_split": a.pp_split} if a.pp_split else {})}
    return format_cost(saved, dst, reshard_cost(cfg.model, saved, dst))


COMMANDS = {
    "export": (add_export_arguments, run_export, "write a layout-independent export directory"),
    "reshard": (add_reshard_arguments, run_reshard,
                "cut a training checkpoint for another layout (tp, pp, dp, ZeRO), with its optimizer state"),
    "reshard-cost": (add_reshard_cost_arguments, run_reshard_cost,
                     "bytes read and written and peak memory per rank of moving a checkpoint to another layout"),
    "import": (add_import_arguments, run_import, "convert a Llama/Qwen2 checkpoint into an RLT export"),
    "inspect": (add_inspect_arguments, run_inspect, "show and verify a checkpoint or export directory"),
}


def main(name: str, argv: list[str] | None = None) -> int:
    """Entry point of one command as a stand-alone script (tools/*.py): a user error is one
    line on stderr and exit status 2 (as `rlt-mega`), not a traceback."""
    import sys

    add_arguments, run, help_text = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"rlt-mega {name}", description=help_text)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        text = run(args)
    except USER_ERRORS as exc:
        sys.stderr.write(f"rlt-mega {name}: error: {exc}\n")
        return 2
    sys.stdout.write(text + "\n")
    return 0


def _holds_adapters(src: str) -> bool:
    from rlt_mega.checkpoint_tools.adapters import is_adapter_checkpoint

    return training.is_training_checkpoint(Path(src)) and is_adapter_checkpoint(training.resolve(src))


def _run_adapter_export(a: argparse.Namespace) -> str:
    """--merge / --adapters: a checkpoint of a run with model.lora (adapters.safetensors)."""
    from rlt_mega.checkpoint_tools.adapters import export_peft

    if not _holds_adapters(a.src):
        raise CheckpointError(f"{a.src}: not a training checkpoint with adapters (adapters.safetensors); "
                              "--merge and --adapters are for runs with model.lora.rank > 0: drop the flag")
    if not (a.merge or a.adapters):
        raise CheckpointError(f"{a.src} holds adapters: export with --merge (a full export, adapters merged) or "
                              "--adapters (a peft adapter directory)")
    step_dir, cfg, _ = training.read_checkpoint(a.src)
    base = cfg.train.init_from or None  # read too: never replaced by the output
    inputs = [a.src, *([base] if base else [])]
    if a.adapters:
        out = export_peft(cfg, step_dir, Path(a.out_dir), base, overwrite=a.overwrite, inputs=inputs)
        return (f"exported the adapters of {step_dir} -> {out} (peft LoRA, r={cfg.model.lora.rank}); load them with "
                f"peft.PeftModel.from_pretrained onto the transformers export of the base "
                f"({base or f'the model of train.seed={cfg.train.seed}: export it with --merge from step 0'})")
    out = export_path(step_dir, a.out_dir, dtype=a.dtype, max_shard_size=a.max_shard_size, tokenizer=a.tokenizer,
                      overwrite=a.overwrite, inputs=inputs)
    return f"exported {step_dir} with its adapters merged -> {out}; start a run from it with train.init_from={out}"
