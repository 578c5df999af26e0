"""The bf16 finding's curves (docs/stability.md, "The bf16 copy"): from a GRPO run's metrics, the
held-out greedy accuracy at each evaluation and, under train.dtype=bf16, precision/stale_fraction
and precision/copy_lag at every step; printed and written as JSON with the machine and the date
(docs/stability.md, "The GRPO demo in bf16, measured").

    python launch/demo_precision_curves.py runs/bf16_stochastic_s0/tb --json out.json --run "GRPO_OVERRIDES=..."

With --summary, the study's table from such JSON files, one group per cast: each cast's held-out
accuracy by step (every seed, the mean) and its mean stale fraction and copy lag at each step, and
whether each bf16 cast's mean accuracy lies within the fp32 seeds' range at every evaluation (the
issue's target for stochastic rounding):

    python launch/demo_precision_curves.py --summary fp32=docs/precision/fp32_seed0.json,... \
      nearest=docs/precision/nearest_seed0.json,... stochastic=docs/precision/stochastic_seed0.json,...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlt_mega.metrics import read_metrics


def _mean_by_step(series: list[list]) -> list[list]:
    """[[[step, x], ...] per seed] -> [[step, [x per seed], mean]] over the steps every seed has."""
    by_step: dict[int, list[float]] = {}
    for one in series:
        for step, x in one:
            by_step.setdefault(step, []).append(x)
    return [[step, xs, sum(xs) / len(xs)] for step, xs in sorted(by_step.items()) if len(xs) == len(series)]


def summary(groups: dict[str, list[str]]) -> dict:
    """{cast: [curves.json paths]} -> per cast: accuracy by step (seeds, mean), mean stale
    fraction and copy lag by step; and, with an fp32 group, whether each other cast's mean
    accuracy lies within the fp32 seeds' [min, max] at every evaluation."""
    out: dict = {}
    for cast, paths in groups.items():
        runs = [json.loads(Path(p).read_text()) for p in paths]
        out[cast] = {"runs": [r["run"] for r in runs],
                     **{key: _mean_by_step([r[key] for r in runs]) for key in ("eval_accuracy", "stale_fraction",
                                                                            "copy_lag")}}
    if "fp32" in out:
        band = {step: (min(xs), max(xs)) for step, xs, _ in out["fp32"]["eval_accuracy"]}
        for cast, g in out.items():
            if cast != "fp32":
                outside = [step for step, _, mean in g["eval_accuracy"]
                           if step in band and not band[step][0] <= mean <= band[step][1]]
                g["within_fp32_spread"] = {"steps_outside": outside, "met": not outside}
    return out


def print_summary(out: dict) -> None:
    for cast, g in out.items():
        print(f"{cast} ({len(g['runs'])} seeds), held-out accuracy, mean [seeds]: " + ", ".join(
            f"step {s}: {m:.3f} [{' '.join(f'{x:.3f}' for x in xs)}]" for s, xs, m in g["eval_accuracy"]))
        if g["stale_fraction"]:
            print("  stale fraction, mean: " + " ".join(f"{m:.3f}" for _, _, m in g["stale_fraction"]))
            print("  copy lag, mean:       " + " ".join(f"{m:.1f}" for _, _, m in g["copy_lag"]))
        if "within_fp32_spread" in g:
            w = g["within_fp32_spread"]
            print(f"  mean accuracy within the fp32 seeds' range at every evaluation: "
                  + ("yes" if w["met"] else f"no (outside at steps {w['steps_outside']})"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tb_dir", nargs="?")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--run", default="")
    ap.add_argument("--summary", nargs="+", metavar="CAST=JSON,JSON",
                    help="CAST=JSON[,JSON...]; a cast given again adds its files")
    args = ap.parse_args()
    if args.summary:
        groups = {}
        for item in args.summary:
            cast, sep, paths = item.partition("=")
            if not sep or not paths:
                ap.error(f"--summary {item!r}: give CAST=PATH[,PATH...], e.g. fp32=runs/a/curves.json,runs/b/curves.json")
            groups.setdefault(cast, []).extend(paths.split(","))  # a cast given again adds its paths
        out = summary(groups)
        print_summary(out)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
            print(f"summary: {args.json}")
        return
    if args.tb_dir is None:
        ap.error("give TB_DIR (one run) or --summary CAST=JSON,... (the study)")
    rows = read_metrics(args.tb_dir)
    out = {"eval_accuracy": [[r["step"], r["eval/accuracy"]] for r in rows if "eval/accuracy" in r],
           "reward": [[r["step"], r["reward/mean"]] for r in rows if "reward/mean" in r],
           "stale_fraction": [[r["step"], r["precision/stale_fraction"]] for r in rows
                              if "precision/stale_fraction" in r],
           "copy_lag": [[r["step"], r["precision/copy_lag"]] for r in rows if "precision/copy_lag" in r]}
    print("held-out greedy accuracy: " + ", ".join(f"step {s}: {a:.3f}" for s, a in out["eval_accuracy"]))
    if out["stale_fraction"]:
        print("stale fraction:           " + ", ".join(f"step {s}: {x:.3f}" for s, x in out["stale_fraction"]))
        print("copy lag:                 " + ", ".join(f"step {s}: {x:.1f}" for s, x in out["copy_lag"]))
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
        from harness import machine

        Path(args.json).write_text(json.dumps({"run": args.run, "machine": machine(), **out}, indent=1) + "\n")
        print(f"curves: {args.json}")


if __name__ == "__main__":
    main()
