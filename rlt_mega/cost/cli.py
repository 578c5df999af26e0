"""``rlt-mega plan``: the cost of a configuration, or the layouts that fit a cluster.

    rlt-mega plan --config configs/rlt_48x48.yaml [--json] [section.key=value ...]
    rlt-mega plan --config configs/rlt_48x48.yaml --nodes 8 --gpus-per-node 8 --gpu-mem-gb 80

Without ``--nodes`` it costs the layout the config describes (parallel.*, train.*; dp from
``--world-size`` when parallel.dp is null). With ``--nodes`` it ranks every layout that fits.
``register(subparsers)`` adds the subcommand to the package CLI; ``python -m
rlt_mega.cost.cli`` runs it standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from rlt_mega.config import ConfigError, load_config
from rlt_mega.cost.costmodel import estimate, format_report
from rlt_mega.cost.layout import Layout
from rlt_mega.cost.planner import load_calibration, Hardware, explain, format_rows_curve, plan_layouts, estimate_to_dict, rows_curve

HELP = "cost model of a configuration, or the parallel layouts that fit a cluster"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", help="YAML config (defaults when omitted)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.seq_len=4096")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--world-size", type=int, help="ranks, to derive dp when parallel.dp is null")
    parser.add_argument("--attention-kernel", choices=("flash", "math"), default="flash")
    parser.add_argument("--rollout-batch", type=int, default=0, help="sequences per sampling batch")
    parser.add_argument("--rollout-len", type=int, default=0, help="positions per sampled sequence")
    parser.add_argument("--drop-logits", action="store_true",
                        help="the trainer frees the logits before the backward")
    cluster = parser.add_argument_group("layout planner (ranks layouts when --nodes is given)")
    cluster.add_argument("--nodes", type=int)
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--gpu-mem-gb", type=float, default=80.0)
    cluster.add_argument("--global-batch", type=int, default=512,
                         help="sequences per optimizer step (at least this many: see --max-global-batch)")
    cluster.add_argument("--max-global-batch", type=int, default=4096,
                         help="the most sequences per step the planner may use, when more rows per decoder "
                              "step (a larger micro-batch) pay; set it to --global-batch for a fixed batch")
    cluster.add_argument("--top", type=int, default=10, help="layouts to list")
    cluster.add_argument("--calibration", default=None,
                         help="tools/gpu/calibrate.py's JSON: the decoder tick measured on this GPU scales the roofline's")
    defaults = Hardware()
    for name, help_text in (("usable_fraction", "fraction of GPU memory the step may use"),
                            ("peak_tflops_bf16", "peak dense bf16 TFLOP/s per GPU"),
                            ("peak_tflops_fp32", "peak fp32 TFLOP/s per GPU"),
                            ("mfu", "achieved fraction of peak on large matmuls"),
                            ("hbm_gbps", "HBM bandwidth GB/s"), ("hbm_eff", "achieved HBM fraction"),
                            ("intra_gbps", "all-reduce bus bandwidth inside a node, GB/s"),
                            ("inter_gbps", "network bandwidth per GPU between nodes, GB/s"),
                            ("intra_latency_us", "collective latency inside a node, us"),
                            ("inter_latency_us", "collective latency between nodes, us"),
                            ("launch_us", "CPU cost per eager operator charged to the step (0: CUDA graphs)")):
        cluster.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name),
                             help=f"{help_text} (default {getattr(defaults, name):g})")
    return parser


def register(subparsers) -> argparse.ArgumentParser:
    """Adds ``plan`` to an ``argparse`` subparsers object; the handler is ``args.fn``."""
    parser = subparsers.add_parser("plan", help=HELP, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(fn=run_plan)
    return parser


def _hardware(args) -> Hardware:
    return Hardware(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_mem_gb=args.gpu_mem_gb,
                    usable_fraction=args.usable_fraction, peak_tflops_bf16=args.peak_tflops_bf16,
                    peak_tflops_fp32=args.peak_tflops_fp32, mfu=args.mfu, hbm_gbps=args.hbm_gbps,
                    hbm_eff=args.hbm_eff, intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps,
                    intra_latency_us=args.intra_latency_us, inter_latency_us=args.inter_latency_us,
                    launch_us=args.launch_us,
                    decoder_efficiency=load_calibration(args.calibration) if args.calibration else 1.0)


def run_plan(args, out=None) -> int:
    """Handler of ``rlt-mega plan``; returns the exit status."""
    out = out or sys.stdout
    try:
        cfg = load_config(args.config, args.overrides)
        if args.nodes is None:
            layout = Layout.from_config(cfg, world_size=args.world_size,
                                        attention_kernel=args.attention_kernel,
                                        rollout_batch=args.rollout_batch, rollout_len=args.rollout_len,
                                        keep_logits=not args.drop_logits)
            report = estimate(cfg.model, layout)
            out.write((json.dumps(report, indent=2) if args.json else format_report(report)) + "\n")
            return 0
        hw = _hardware(args)
        plans, considered = plan_layouts(cfg.model, hw, cfg.data.seq_len, args.global_batch,
                                         dtype=cfg.train.dtype, max_global_batch=args.max_global_batch,
                                         head_chunk=cfg.train.checkpointing.head_chunk)
    except ConfigError as exc:
        sys.stderr.write(f"rlt-mega plan: error: {exc}\n")
        return 2
    if args.json:
        curve = rows_curve(plans)
        out.write(json.dumps({"hardware": vars(hw), "considered": considered, "fit": len(plans),
                              "plans": [estimate_to_dict(p) for p in plans[:args.top]], "rows_curve": curve},
                             indent=2) + "\n")
        return 0
    out.write(f"{hw.nodes} x {hw.gpus_per_node} GPUs of {hw.gpu_mem_gb:g} GB; T={cfg.data.seq_len}, "
              f"{args.global_batch} to {args.max_global_batch} sequences per step, {cfg.train.dtype}: "
              f"{len(plans)} of {considered} layouts fit\n")
    for i, p in enumerate(plans[:args.top], 1):
        out.write(f"{i:>3}. {p.describe():<62} {p.step_time:9.2f} s/step {p.tokens_per_s:>12,.0f} tok/s "
                  f"{p.peak_memory / 1e9:6.1f} GB\n")
    out.write(explain(plans, cfg.model, hw) + "\n")
    out.write(format_rows_curve(rows_curve(plans)) + "\n")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="rlt-mega plan", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_plan(parser.parse_intermixed_args(argv))


if __name__ == "__main__":
    sys.exit(main())
