"""The ``rlt-mega`` command: one subcommand per job, each from a YAML config plus dotted
overrides (``rlt-mega pretrain --config configs/tiny_cpu.yaml train.steps=100``).

Errors a user can fix (config, data, checkpoint, layout) are printed as one clear message
with exit status 2, not as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from rlt_mega.checkpoint import CheckpointError
from rlt_mega.checkpoint_tools import commands as checkpoint_tools
from rlt_mega.config import Config, ConfigError, load_config
from rlt_mega.data import preprocess as preprocess_cmd
from rlt_mega.data import tokenizer_train
from rlt_mega.data.datasets import DataError
from rlt_mega.data.tokenizer import TokenizerError
from rlt_mega.log import get_logger, setup_logging
from rlt_mega.cost import cli as plan_cli
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


def _log_done(result: dict) -> None:
    """The final metrics, four significant digits (a 5e-6 log-prob gap must not print as 0.0)."""
    log.info("done: %s", {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in result.items()})


def cmd_pretrain(args: argparse.Namespace) -> int:
    from rlt_mega.train import pretrain

    result = pretrain.run(_load(args))
    _log_done(result)
    return 0


def cmd_params(args: argparse.Namespace) -> int:
    """Builds the model on the meta device (no memory) and prints its parameter counts."""
    from rlt_mega.model.rlt import build_model, param_counts

    cfg = _load(args)
    model = build_model(cfg.model, "meta")
    real = sum(p.numel() for p in model.parameters())
    counts = param_counts(cfg.model)
    width = max(len(k) for k in counts)
    for key, value in counts.items():
        sys.stdout.write(f"{key:<{width}}  {value:>16,}\n")
    from rlt_mega.cost.flops import flop_rows, summarize

    T = cfg.data.seq_len
    per_token = summarize(flop_rows(cfg.model, T, cfg.train.checkpointing), T)["per_token"]
    shape = {"rlt": f"rlt C={cfg.model.memory_block}", "dense": "dense", "looped": f"looped R={cfg.model.loops}"}
    sys.stdout.write(f"model.arch {shape[cfg.model.arch]}: training FLOPs per token at data.seq_len={T}: "
                     f"{per_token['model']:,.0f} (forward {per_token['forward']:,.0f}; with recomputation "
                     f"{per_token['hardware']:,.0f})\n")
    if real != counts["total"]:  # the closed form and the module disagree: a bug, say so
        sys.stdout.write(f"WARNING: the meta-device model has {real:,} parameters\n")
        return 1
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from rlt_mega.train import sft

    result = sft.run(_load(args))
    _log_done(result)
    return 0


def cmd_grpo(args: argparse.Namespace) -> int:
    from rlt_mega.train import grpo

    cfg = _load(args)
    result = grpo.run(cfg)
    _log_done(result)
    if os.environ.get("RANK", "0") != "0":  # a launcher's other ranks: the summary is rank 0's to print
        return 0
    before, after = result.get("eval/accuracy_before"), result.get("eval/accuracy")
    if after is not None:
        shown = "n/a" if before is None else f"{before:.3f}"
        sys.stdout.write(f"held-out greedy accuracy: before GRPO {shown}, after {after:.3f}\n")
    sys.stdout.write(f"TensorBoard logs: {cfg.logging.dir}\n")
    return 0


def _inference_model(cfg: Config):
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.train.builders import check_vocab, inference_model

    from rlt_mega.rollout import Sampler
    from rlt_mega.schedule.rows import RowSwitches

    from rlt_mega.model.baselines import require_rlt

    require_rlt(cfg.model, "rlt-mega generate/eval")
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    check_vocab(cfg, tokenizer)
    sampler = Sampler(inference_model(cfg), check_every=cfg.sampling.check_every,
                      rows=RowSwitches(slots=cfg.sampling.slots))
    return cfg, sampler, tokenizer


def _read_questions(source: str) -> list[str]:
    """One prompt per line (a JSON object's "question", or the raw line); '-' is stdin."""
    import json

    lines = sys.stdin.read().splitlines() if source == "-" else open(source).read().splitlines()
    questions = []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        questions.append(record["question"] if isinstance(record, dict) and "question" in record else line)
    return questions


def cmd_generate(args: argparse.Namespace) -> int:
    import json

    from rlt_mega.train.common import generate_texts, sampling_params

    from rlt_mega.data.datasets import DataStats
    from rlt_mega.data.pairs import fitting_prompts

    if args.input != "-" and not os.path.exists(args.input):  # before the model is loaded
        raise ConfigError(f"--input {args.input}: no such file; give a file of prompts (one per line, or jsonl "
                          "with 'question'), or '-' for stdin")
    questions = _read_questions(args.input)
    if not questions:
        raise ConfigError(f"--input {args.input}: no prompts in it")
    cfg, model, tokenizer = _inference_model(_load(args))
    stats = DataStats()
    questions = [r["question"] for r in fitting_prompts([{"question": q} for q in questions], tokenizer,
                                                         cfg.model.max_seq_len, stats, f"--input {args.input}")]
    if stats.total:
        log.warning("data: %s", stats.summary())
    if not questions:
        raise ConfigError(f"--input {args.input}: no prompt fits model.max_seq_len={cfg.model.max_seq_len}: "
                          "raise model.max_seq_len or shorten the prompts")
    greedy = cfg.sampling.temperature == 0
    completions = generate_texts(model, tokenizer, questions, sampling_params(cfg, tokenizer, greedy),
                                 seeds=[cfg.train.seed * 1_000_003 + i for i in range(len(questions))],
                                 batch_size=cfg.sampling.batch_size, dtype=cfg.train.dtype)
    for q, c in zip(questions, completions):
        sys.stdout.write(json.dumps({"question": q, "completion": c}) + "\n")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from rlt_mega.data.datasets import PROMPT_COLUMNS, DataStats, load_records, prompt_record, train_eval_records
    from rlt_mega.data.pairs import fitting_prompts
    from rlt_mega.train.common import greedy_accuracy

    cfg, model, tokenizer = _inference_model(_load(args))
    extract = prompt_record(cfg.sft.prompt_field, cfg.sft.answer_field)  # with its scripted turns (grpo.env)
    stats = DataStats()
    if args.data is not None:
        records = load_records(args.data, "eval", cfg.data, extract, PROMPT_COLUMNS, stats)
    else:
        records = train_eval_records(cfg.data, extract, PROMPT_COLUMNS, stats, seed=cfg.train.seed)[1]
    records = [records[i] for i in range(min(len(records), args.limit or len(records)))]
    records = fitting_prompts(records, tokenizer, cfg.model.max_seq_len, stats, "eval prompts")
    if stats.total:
        log.warning("data: %s", stats.summary())
    if not records:
        raise ConfigError(f"no evaluation record fits model.max_seq_len={cfg.model.max_seq_len} ({stats.summary()})")
    from rlt_mega.train.grpo import environments

    # With grpo.env (e.g. calculator) the completions run with the environment's turns.
    envs = environments(cfg, tokenizer)  # (it checks sampling.check_every)
    accuracy, completions = greedy_accuracy(model, tokenizer, records, cfg, cfg.train.dtype, envs)
    if cfg.eval.samples:  # pass@k, maj@k, mean@n of eval.samples completions per problem
        from rlt_mega.train.common import sampled_scores

        sums = sampled_scores(model, tokenizer, records, list(range(len(records))), cfg, cfg.train.dtype, envs)
        for name, total in sums.items():
            sys.stdout.write(f"{name.removeprefix('eval/')}: {total / len(records):.4f}\n")
    if args.output:
        with open(args.output, "w") as f:
            for r, c in zip(records, completions):
                f.write(json.dumps({"question": r["question"], "answer": r["answer"], "completion": c}) + "\n")
    sys.stdout.write(f"greedy accuracy: {accuracy:.4f} ({round(accuracy * len(records))}/{len(records)})\n")
    return 0


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", "-i", default="-", help="prompts, one per line or jsonl with 'question' ('-': stdin)")


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="GSM8K-format file/dir/hub name (default: data.eval or the held-out split)")
    p.add_argument("--limit", type=int, default=0, help="evaluate the first N records only")
    p.add_argument("--output", "-o", help="write question/answer/completion jsonl here")


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "pretrain": (cmd_pretrain, "pretrain an RLT on packed text (the dense schedule)"),
    "sft": (cmd_sft, "supervised fine-tuning on prompt/answer pairs (loss on answers only)"),
    "grpo": (cmd_grpo, "GRPO with exact (replayed) log-probabilities"),
    "generate": (cmd_generate, "sample completions for prompts from a file or stdin (jsonl to stdout)"),
    "eval": (cmd_eval, "greedy accuracy on a GSM8K-format dataset (and pass@k, maj@k, mean@n with eval.samples=n)"),
    "params": (cmd_params, "parameter counts of a config, built on the meta device"),
}
EXTRA_ARGS: dict[str, Callable[[argparse.ArgumentParser], None]] = {"generate": _generate_args, "eval": _eval_args}


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
        if name in EXTRA_ARGS:
            EXTRA_ARGS[name](p)
        p.set_defaults(fn=fn)
    plan_cli.register(sub)
    p = sub.add_parser("preprocess", help=preprocess_cmd.HELP, description=preprocess_cmd.HELP)
    preprocess_cmd.add_arguments(p)
    p.set_defaults(fn=_tool(preprocess_cmd.run))
    tokenizer_train.register(sub, _tool)
    for name, (add_arguments, run, help_text) in checkpoint_tools.COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(fn=_tool(run))
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Like parse_args, but dotted overrides may also follow an option (``eval --limit 4
    train.seed=1``): argparse ends a ``nargs="*"`` positional at the first option, and
    parse_intermixed_args refuses parsers with subcommands, so what is left over after an option
    is taken as more overrides when the subcommand has them (in command-line order: a later
    override wins)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(a.startswith("-") for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides or []) + extra
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
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
