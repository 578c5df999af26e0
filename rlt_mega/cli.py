"""The ``rlt-mega`` command: one subcommand per job, each from a YAML config plus dotted
overrides (``rlt-mega pretrain --config configs/tiny_cpu.yaml train.steps=100``).

Errors a user can fix (config, data, checkpoint, layout) are printed as one clear message
with exit status 2, not as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from rlt_mega.checkpoint import CheckpointError
from rlt_mega.checkpoint_tools import commands as checkpoint_tools
from rlt_mega.config import Config, ConfigError, load_config
from rlt_mega.data.datasets import DataError
from rlt_mega.data.tokenizer import TokenizerError
from rlt_mega.log import get_logger, setup_logging
from rlt_mega.plan import cli as plan_cli
from rlt_mega.train.loop import TrainingError

log = get_logger(__name__)

USER_ERRORS = (ConfigError, DataError, TokenizerError, CheckpointError, FileNotFoundError,
               *checkpoint_tools.USER_ERRORS)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="YAML config (defaults when omitted)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 model.memory_block=4")


def _load(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config, args.overrides)
    setup_logging(cfg.logging.level)
    return cfg


def cmd_pretrain(args: argparse.Namespace) -> int:
    from rlt_mega.train import pretrain

    result = pretrain.run(_load(args))
    log.info("done: %s", {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})
    return 0


def cmd_params(args: argparse.Namespace) -> int:
    """Builds the model on the meta device (no memory) and prints its parameter counts."""
    from rlt_mega.model import build_model, param_counts

    cfg = _load(args)
    model = build_model(cfg.model, "meta")
    real = sum(p.numel() for p in model.parameters())
    counts = param_counts(cfg.model)
    width = max(len(k) for k in counts)
    for key, value in counts.items():
        sys.stdout.write(f"{key:<{width}}  {value:>16,}\n")
    if real != counts["total"]:  # the closed form and the module disagree: a bug, say so
        sys.stdout.write(f"WARNING: the meta-device model has {real:,} parameters\n")
        return 1
    return 0


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "pretrain": (cmd_pretrain, "pretrain an RLT on packed text (the dense schedule)"),
    "params": (cmd_params, "parameter counts of a config, built on the meta device"),
}


def _tool(run: Callable[[argparse.Namespace], str]) -> Callable[[argparse.Namespace], int]:
    """A checkpoint tool (export, import, inspect): its own arguments, no run config."""

    def fn(args: argparse.Namespace) -> int:
        sys.stdout.write(run(args) + "\n")
        return 0

    return fn


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlt-mega", description="Train Recurrent Looped Transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (fn, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _config_args(p)
        p.set_defaults(fn=fn)
    plan_cli.register(sub)
    for name, (add_arguments, run, help_text) in checkpoint_tools.COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(fn=_tool(run))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as exc:
        sys.stderr.write(f"rlt-mega {args.command}: error: {exc}\n")
        return 2
    except TrainingError as exc:  # the run stopped itself (e.g. non-finite steps); the message says where
        sys.stderr.write(f"rlt-mega {args.command}: stopped: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
